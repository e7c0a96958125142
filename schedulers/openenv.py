"""ms-swift's OpenEnv integration (``swift.rollout.multi_turn.OpenEnvScheduler``, registered as
``openenv_scheduler``, and ``swift.rollout.openenv_wrapper.OpenEnvWrapper``): a gym scheduler whose
environment is an OpenEnv server (openenv-core), reached over its WebSocket by ``GenericEnvClient``.

As ms-swift: each row's ``env_config`` (``base_url``, ``reset_kwargs``, ``system_message``; under
``rollout.env_config``, which is ms-swift's ``env_config_defaults``) picks the server; ``reset()`` gives the
first observation, ``format_observation`` turns it into the user message; each reply goes through
``parse_action`` (JSON, else ``{"message": text}``) to ``step()``; the rewards add up in ``_total_rewards``
and reach the rewards as ``rollout_infos["total_reward"]`` with ``step_rewards`` and ``gym_done``. The
per-trajectory state lives in ms-swift's dicts keyed by the request's ``uuid`` (``_envs``, ``_total_rewards``,
``_step_rewards``, ``_pending_obs``), so a subclass written for ms-swift (its Sudoku example overrides
``on_trajectory_start`` / ``on_turn_end`` and keeps its own per-uuid dicts) runs unchanged.

What rollstream adds, as its ``gym_scheduler`` does: the wrapper's blocking calls run in this scheduler's
threads under ``rollout.env_timeout_s`` (ms-swift calls them on the event loop); at most
``rollout.max_concurrent_envs`` episodes at once; the client is closed exactly once however the episode ends
(ms-swift closes it on ``done`` only). A failed connection, reset or step raises ``EnvError``: the request is
run again with a fresh client ``reward.max_retries`` times (ms-swift's wrapper reconnects in place, which
restarts the episode on the server under the old history), then ``EnvFailed`` and ``reward.on_error``.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from schedulers.base import MultiTurnScheduler
from schedulers.engine import CURRENT
from schedulers.gym import EnvError, EnvFailed, GYMScheduler
from schedulers.protocol import ChatCompletionResponseChoice, Messages, RequestConfig, RolloutInferRequest

DEFAULT_BASE_URL = "http://localhost:8000"  # ms-swift's default


class OpenEnvWrapper:
    """ms-swift's ``OpenEnvWrapper``: one OpenEnv session (``GenericEnvClient(base_url).sync()``), opened on the
    first call. ``reset() -> (observation, metadata)``, ``step(action) -> (observation, reward, done,
    metadata)``, ``close()``; observations are the server's raw dicts. Blocking: call it from a thread."""

    def __init__(self, env_config: dict[str, Any]) -> None:
        self.base_url = env_config.get("base_url", DEFAULT_BASE_URL)
        self.reset_kwargs = env_config.get("reset_kwargs", {})
        self._client: Any = None

    def _ensure_client(self) -> Any:
        if self._client is None:
            # openenv-core: imported late, only OpenEnv runs need it
            from openenv.core.generic_client import GenericEnvClient

            client = GenericEnvClient(base_url=self.base_url).sync()
            client.__enter__()
            self._client = client
        return self._client

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._ensure_client(), name)(*args, **kwargs)
        except ImportError as exc:
            raise EnvError(f"OpenEnv needs openenv-core (pip install openenv-core): {exc}") from exc
        except Exception as exc:  # connection refused, server error, timeout: the request is retried afresh
            raise EnvError(f"OpenEnv {name}() at {self.base_url} raised {type(exc).__name__}: {exc}") from exc

    def reset(self) -> tuple[Any, Any]:
        result = self._call("reset", **self.reset_kwargs)
        return result.observation, getattr(result, "metadata", None)

    def step(self, action_dict: dict[str, Any]) -> tuple[Any, float, bool, Any]:
        result = self._call("step", action_dict)
        return result.observation, float(result.reward or 0.0), bool(result.done), getattr(result, "metadata", None)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.__exit__(None, None, None)


class OpenEnvScheduler(GYMScheduler):
    """``openenv_scheduler``: ms-swift's ``OpenEnvScheduler`` (see the module docstring). Subclasses override
    ``parse_action`` and ``format_observation``, or the hooks themselves, as ms-swift's are overridden."""

    split_on_rewrite = False  # no context manager: the history only grows

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(infer_engine, max_turns, *args, **kwargs)
        # ms-swift's per-trajectory state, keyed by the request's uuid (subclasses read and extend it)
        # By request uuid (ms-swift's RolloutInferRequest.uuid, which may be None).
        self._envs: dict[str | None, Any] = {}
        self._total_rewards: dict[str | None, float] = {}
        self._step_rewards: dict[str | None, list[float]] = {}
        self._pending_obs: dict[str | None, str | None] = {}
        self.env_config_defaults: dict[str, Any] = self.env_config  # ms-swift's name: rollout.env_config

    # ------------------------------------------------------------ the request

    async def run(
        self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None, **kwargs: Any
    ) -> list[dict[str, Any]]:
        ctx = CURRENT.get()
        if ctx is not None:  # the stage tokenized the dataset's placeholder prompt: reset's observation replaces it
            ctx.prompt_ids = None
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent_envs)
        reasons = []
        for _ in range(self.env_max_retries + 1):
            request = copy.deepcopy(infer_request)
            async with self._slots:
                self.live_envs += 1
                try:
                    results = await MultiTurnScheduler.run(self, request, request_config, **kwargs)
                except EnvError as exc:
                    self.env_errors += 1
                    reasons.append(str(exc))
                    continue
                finally:
                    try:  # shielded: a cancelled request still closes its client (ms-swift closes on done only)
                        await asyncio.shield(self._close_and_remove(request.uuid))
                    finally:
                        self.live_envs -= 1
            infos = results[-1].setdefault("rollout_infos", {})
            infos.setdefault("env_done", bool(infos.get("gym_done")))  # rollstream's name for gym_done
            return results
        raise EnvFailed(f"{type(self).__name__}: the OpenEnv episode failed on all {len(reasons)} attempts: "
                        f"{reasons[-1]}")

    def _create_env(self, env_config: dict[str, Any]) -> Any:
        """An ``OpenEnvWrapper`` (not an ``Env``) for the row's merged ``env_config``."""
        return OpenEnvWrapper(env_config)

    async def _close_and_remove(self, uuid: str | None) -> None:
        """Close the uuid's wrapper (in a thread, under env_timeout_s) and drop its state."""
        wrapper = self._envs.pop(uuid, None)
        if wrapper is not None:
            try:
                await self._call(wrapper.close)
            except EnvError:
                self.env_errors += 1  # the trajectory stands: a close failure only leaks the session
        self._total_rewards.pop(uuid, None)
        self._step_rewards.pop(uuid, None)
        self._pending_obs.pop(uuid, None)

    # ------------------------------------------------------------ ms-swift's hooks

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        """One wrapper per request: ``reset()``, then the system message and the first observation."""
        for req in requests:
            uuid = req.uuid
            if uuid in self._envs:
                await self._close_and_remove(uuid)
            env_config = {**self.env_config_defaults, **((req.data_dict or {}).get("env_config") or {})}
            wrapper = self._create_env(env_config)
            self._envs[uuid] = wrapper  # registered first: a failed reset is still closed
            obs, _metadata = await self._call(wrapper.reset)
            system_message = env_config.get("system_message", "")
            messages: Messages = [{"role": "system", "content": system_message}] if system_message else []
            messages.append({"role": "user", "content": self.format_observation(obs)})
            req.messages = messages
            self._total_rewards[uuid] = 0.0
            self._step_rewards[uuid] = []
            self._pending_obs[uuid] = None

    async def on_turn_end(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> dict[str, Any]:
        """``parse_action`` on the reply, ``step()``, the reward added up; ``done`` ends the trajectory."""
        uuid = infer_request.uuid
        wrapper = self._envs.get(uuid)
        if wrapper is None:
            return {"done": True, "rollout_infos": {}}
        obs, reward, done, _metadata = await self._call(wrapper.step, self.parse_action(response_choice.message.content))
        self._total_rewards[uuid] = self._total_rewards.get(uuid, 0.0) + float(reward)
        self._step_rewards.setdefault(uuid, []).append(float(reward))
        self._pending_obs[uuid] = None if done else self.format_observation(obs)
        rollout_infos = {
            "total_reward": self._total_rewards[uuid],
            "step_rewards": list(self._step_rewards[uuid]),
            "gym_done": done,
        }
        if done:
            await self._close_and_remove(uuid)
        return {"done": done, "rollout_infos": rollout_infos}

    def step(
        self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice, current_turn: int
    ) -> dict[str, Any]:
        """The pending observation becomes the next user message."""
        next_obs = self._pending_obs.get(infer_request.uuid)
        if next_obs is not None:
            infer_request.messages.append({"role": "user", "content": next_obs})
            self._pending_obs[infer_request.uuid] = None
        return {"infer_request": infer_request}

    def parse_action(self, text: str) -> dict[str, Any]:
        """The reply as an OpenEnv action: a JSON object (a fenced code block is unwrapped), else
        ``{"message": text}`` (ms-swift's default)."""
        text = text.strip()
        lines = text.splitlines()
        if text.startswith("```") and len(lines) >= 2 and lines[-1].strip().startswith("```"):
            text = "\n".join(lines[1:-1]).strip()
        try:
            parsed = json.loads(text)
        except ValueError:
            return {"message": text}
        return parsed if isinstance(parsed, dict) else {"message": str(parsed)}

    def format_observation(self, observation: Any) -> str:
        """The observation as the user message: JSON (ms-swift's default); override to pick a field."""
        try:
            return json.dumps(observation, ensure_ascii=False, default=str)
        except (TypeError, ValueError):
            return str(observation)
