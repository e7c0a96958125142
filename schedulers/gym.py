"""Gym-style environments as rollout, with ms-swift's interface (``swift.plugin.env`` / ``context_manager``,
now ``swift.rollout.gym_env``): an ``Env`` per trajectory, a ``ContextManager`` over the history, and the
``gym_scheduler`` that drives them on the token-level multi-turn loop of ``MultiTurnScheduler.run``.

An ms-swift plugin's env and context manager run as they are (``from swift.plugin import Env, envs`` resolves
to these when ms-swift itself is not installed), or imported from here::

    from schedulers import Env, envs

    class MyEnv(Env):
        async def reset(self, config):        # -> (observation, info, system_message)
            ...
        async def step(self, action):         # action = the whole conversation, the reply last
            ...                               # -> (next_observation, reward, done, info)
        async def close(self):
            ...

    envs["my_env"] = MyEnv

The loop (as ms-swift's ``GYMScheduler``): ``reset`` gives the system prompt and the first user message;
then generate -> ``step`` -> the next observation as a user message, until ``done`` or ``max_turns``.
``close()`` runs exactly once per env, however the trajectory ends (done, max_turns, an error, a timeout,
a cancellation). Model tokens are trained, observations get mask 0 and no logprobs (the base run's rule).

The step rewards' sum is the trajectory's environment reward: ``rollout_infos["total_reward"]`` (ms-swift's
key), with ``step_rewards``, ms-swift's ``trajectory_id`` (the request id) and ``trajectory_info`` (the info
dicts: the reset's, then each step's), ``trajectory_infos`` (rollstream's: one dict per step with its reward,
done and info, the reset's first) and ``env_done`` / ``gym_done``, which the built-in reward ``env_reward``
and any reward function see.

Robustness: every ``reset`` / ``step`` / ``close`` call has ``env_timeout_s``; a sync method runs in a
thread pool of this scheduler, so it cannot block the event loop; at most ``max_concurrent_envs`` envs
are live at once (a request waits for a slot before its ``reset``). A request whose env raised or timed
out is run again with a fresh env ``env_max_retries`` times; then it raises ``EnvFailed`` with the reason
and the rollout stage applies ``reward.on_error`` (drop the group, or dead-letter it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import copy
import difflib
import functools
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import msgspec

from pipeline.errors import UserError
from schedulers.base import MultiTurnScheduler, SchedulerError
from schedulers.engine import CURRENT
from schedulers.env_http import close_sessions
from schedulers.protocol import ChatCompletionResponseChoice, Messages, RequestConfig, RolloutInferRequest

ENV_ENTRY_POINT_GROUP = "rollstream.envs"
CONTEXT_MANAGER_ENTRY_POINT_GROUP = "rollstream.context_managers"
DEFAULT_ENV_TIMEOUT_S = 60.0
DEFAULT_MAX_CONCURRENT_ENVS = 64


class Env(ABC):
    """ms-swift's environment: one instance per trajectory, built with the row's ``env_config``."""

    def __init__(self, env_config: dict[str, Any]) -> None:
        self.env_config = env_config

    @abstractmethod
    async def reset(self, config: RolloutInferRequest) -> tuple[str, dict[str, Any], str]:
        """-> (observation: the first user message, info, system_message: the trajectory's system prompt)."""

    @abstractmethod
    async def step(self, action: Messages) -> tuple[str, float, bool, dict[str, Any]]:
        """``action`` is the whole conversation, the model's reply last.
        -> (next_observation, reward, done, info)."""

    @abstractmethod
    async def close(self) -> None:
        """Release the env's resources (called exactly once, however the trajectory ended)."""


class ContextManager(ABC):
    """ms-swift's context manager: ``manage_context(history, trajectory_id) -> messages`` before each turn."""

    def __init__(self, ctx_config: dict[str, Any]) -> None:
        self.ctx_config = ctx_config

    @abstractmethod
    def manage_context(self, history: Messages, trajectory_id: str) -> Messages:
        """The messages the next turn is generated from."""


class DummyContextManager(ContextManager):
    """The history as it is (ms-swift's default)."""

    def manage_context(self, history: Messages, trajectory_id: str) -> Messages:
        return history


# The registries: name -> class. Plugins add to them (``envs["my_env"] = MyEnv``); built-ins register in
# schedulers/gym_envs.py and schedulers/remote_env.py.
envs: dict[str, type[Env]] = {}
context_managers: dict[str, type[ContextManager]] = {"dummyContextManager": DummyContextManager}


class EnvError(SchedulerError):
    """An env call raised or timed out (the request is run again with a fresh env, up to env_max_retries)."""


class EnvFailed(SchedulerError):
    """A request's env failed on every attempt; the message is the reason (rollout applies reward.on_error)."""


class UnknownEnvError(UserError, SchedulerError):
    pass


def _lookup(registry: dict[str, type], group: str, name: str, what: str, setting: str) -> type:
    if name not in registry:
        for ep in entry_points(group=group):
            registry.setdefault(ep.name, ep.load())
    cls = registry.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, list(registry), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UnknownEnvError(
            f"{setting} = {name!r} is not a registered {what}; {hint}registered: {', '.join(sorted(registry))}. "
            f'Register your own with `{what}s["{name}"] = MyClass` in a file listed in run.external_plugins, '
            f"or an entry point in the group {group!r}"
        )
    return cls


def env_class(name: str | None) -> type[Env]:
    """The env registered as ``name`` (``rollout.gym_env`` or the row's ``env_config["name"]``)."""
    if not name:
        raise UnknownEnvError(
            f"no environment selected: set rollout.gym_env or give each row an env_config with a name; "
            f"registered: {', '.join(sorted(envs))}"
        )
    cls = _lookup(envs, ENV_ENTRY_POINT_GROUP, name, "env", "rollout.gym_env / env_config.name")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise SchedulerError(f"envs[{name!r}] is {cls!r}; register an Env subclass")
    return cls


def context_manager_class(name: str | None) -> type[ContextManager]:
    cls = _lookup(
        context_managers,
        CONTEXT_MANAGER_ENTRY_POINT_GROUP,
        name or "dummyContextManager",
        "context_manager",
        "rollout.context_manager / ctx_config.name",
    )
    if not (isinstance(cls, type) and issubclass(cls, ContextManager)):
        raise SchedulerError(f"context_managers[{name!r}] is {cls!r}; register a ContextManager subclass")
    return cls


async def call_env(
    method: Any, *args: Any, timeout_s: float, what: str, executor: concurrent.futures.Executor | None = None
) -> Any:
    """Call an env method, sync or async, under ``timeout_s``: a sync one runs in ``executor`` (a thread),
    so a slow or hung env never blocks the event loop. Any failure becomes ``EnvError`` naming ``what``."""
    try:
        if inspect.iscoroutinefunction(method):
            return await asyncio.wait_for(method(*args), timeout=timeout_s)
        loop = asyncio.get_running_loop()
        result = await asyncio.wait_for(
            loop.run_in_executor(executor, functools.partial(method, *args)), timeout=timeout_s
        )
        if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
            result = await asyncio.wait_for(result, timeout=timeout_s)
        return result
    except TimeoutError:
        raise EnvError(f"{what} timed out after {timeout_s:g} s") from None
    except EnvError:
        raise
    except Exception as exc:  # the env's own bug: the request is retried, then reward.on_error
        raise EnvError(f"{what} raised {type(exc).__name__}: {exc}") from exc


@dataclass
class _Episode:
    """One trajectory's env state (held in a ContextVar: one scheduler serves many requests at once)."""

    env: Env
    manager: ContextManager
    trajectory_id: str
    total_reward: float = 0.0
    step_rewards: list[float] = field(default_factory=list)
    trajectory_infos: list[dict[str, Any]] = field(default_factory=list)
    pending_observation: str | None = None
    done: bool = False


_EPISODE: contextvars.ContextVar[_Episode | None] = contextvars.ContextVar(
    "rollstream_env_episode", default=None
)


def _episode() -> _Episode:
    """The episode of the trajectory being run (set around each one by the scheduler's run)."""
    episode = _EPISODE.get()
    assert episode is not None, "a hook of the gym scheduler called outside its run"
    return episode


class GYMScheduler(MultiTurnScheduler):
    """``gym_scheduler``: ms-swift's GYMScheduler on the token-level default run (see the module docstring).

    kwargs: ``gym_env`` (default env name), ``context_manager`` (default manager name), ``env_config``
    (default init keys under every row's own), ``env_timeout_s``, ``max_concurrent_envs``, ``env_max_retries``.
    """

    # A context manager that compresses the history starts a new record from the compressed history.
    split_on_rewrite = True

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(infer_engine, max_turns, *args, **kwargs)
        self.gym_env: str | None = kwargs.get("gym_env")
        self.gym_env_name = self.gym_env  # ms-swift's attribute name
        self.context_manager: str | None = kwargs.get("context_manager")
        self.env_config: dict[str, Any] = dict(kwargs.get("env_config") or {})
        self.env_timeout_s = float(kwargs.get("env_timeout_s") or DEFAULT_ENV_TIMEOUT_S)
        self.max_concurrent_envs = int(kwargs.get("max_concurrent_envs") or DEFAULT_MAX_CONCURRENT_ENVS)
        self.env_max_retries = int(kwargs.get("env_max_retries") or 0)
        self.live_envs = 0  # envs between construction and close (a gauge for metrics and tests)
        self.env_errors = 0  # env calls that raised or timed out
        self._slots: asyncio.Semaphore | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ the request

    async def run(
        self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None, **kwargs: Any
    ) -> list[dict[str, Any]]:
        row_env = dict(infer_request.data_dict.get("env_config") or {})
        env_config = {**self.env_config, **row_env}
        env_cls = env_class(env_config.get("name") or self.gym_env)
        ctx_config = dict(infer_request.data_dict.get("ctx_config") or {})
        manager_cls = context_manager_class(ctx_config.get("name") or self.context_manager)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_concurrent_envs)
        reasons = []
        for attempt in range(self.env_max_retries + 1):
            async with self._slots:
                try:
                    return await self._episode(
                        env_cls(env_config),
                        manager_cls(ctx_config),
                        copy.deepcopy(infer_request),
                        request_config,
                        **kwargs,
                    )
                except EnvError as exc:
                    self.env_errors += 1
                    reasons.append(str(exc))
        raise EnvFailed(f"env {env_cls.__name__} failed on all {len(reasons)} attempts: {reasons[-1]}")

    async def _episode(
        self,
        env: Env,
        manager: ContextManager,
        request: RolloutInferRequest,
        request_config: RequestConfig | None,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        self.live_envs += 1
        episode = _Episode(env=env, manager=manager, trajectory_id=request.uuid or "")
        token = _EPISODE.set(episode)
        try:
            results = await super().run(request, request_config, **kwargs)
        finally:
            _EPISODE.reset(token)
            # Shielded: a cancelled request still closes its env (a second cancel leaves it closing).
            await asyncio.shield(self._close(env))
        last = results[-1]
        last["rollout_infos"] = {
            **last.get("rollout_infos", {}),
            "total_reward": episode.total_reward,
            "step_rewards": list(episode.step_rewards),
            # ms-swift's keys: the request id, and the plain info dicts (reset's first, then each step's)
            "trajectory_id": episode.trajectory_id,
            "trajectory_info": [entry["info"] for entry in episode.trajectory_infos],
            "trajectory_infos": list(episode.trajectory_infos),  # rollstream's: each with step, reward, done
            "env_done": episode.done,
            "gym_done": episode.done,  # ms-swift main's name
        }
        return results

    async def _close(self, env: Env) -> None:
        try:
            await call_env(
                env.close,
                timeout_s=self.env_timeout_s,
                what=f"{type(env).__name__}.close()",
                executor=self._executor(),
            )
        except EnvError:
            self.env_errors += 1  # the trajectory stands: a close failure only leaks the env's resources
        finally:
            self.live_envs -= 1

    async def shutdown(self) -> None:
        """The rollout stage's close: drop the env threads (a hung sync env keeps its thread, unwaited) and
        the remote envs' HTTP session."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        await close_sessions()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """Threads for sync env methods, one per live env at most (a hung one keeps its thread)."""
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                self.max_concurrent_envs + 1, thread_name_prefix="env"
            )
        return self._threads

    async def _call(self, method: Any, *args: Any) -> Any:
        name = f"{type(method.__self__).__name__}.{method.__name__}()"
        return await call_env(
            method, *args, timeout_s=self.env_timeout_s, what=name, executor=self._executor()
        )

    # ------------------------------------------------------------ the hooks of the base run

    async def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        episode = _episode()
        for request in requests:
            observation, info, system_message = _reset_result(await self._call(episode.env.reset, request))
            messages: Messages = [{"role": "system", "content": system_message}] if system_message else []
            messages.append({"role": "user", "content": observation})
            request.messages = episode.manager.manage_context(messages, episode.trajectory_id)
            episode.trajectory_infos.append({"step": 0, "info": info})
        ctx = CURRENT.get()
        if ctx is not None:  # the stage tokenized the dataset's placeholder prompt: the env's replaces it
            ctx.prompt_ids = None

    async def on_turn_end(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        episode = _episode()
        result = await self._call(episode.env.step, copy.deepcopy(infer_request.messages))
        observation, reward, done, info = _step_result(result, type(episode.env).__name__)
        episode.total_reward += reward
        episode.step_rewards.append(reward)
        episode.trajectory_infos.append({"step": current_turn, "reward": reward, "done": done, "info": info})
        episode.done = done
        episode.pending_observation = None if done else observation
        # A full context samples nothing more: stop rather than loop on empty turns.
        context_full = response_choice.finish_reason == "length" and not response_choice.token_ids
        return {"done": done or context_full}

    def check_finished(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> bool:
        return bool(self.max_turns and current_turn >= self.max_turns)  # the env decides, via on_turn_end

    def step(
        self,
        infer_request: RolloutInferRequest,
        response_choice: ChatCompletionResponseChoice,
        current_turn: int,
    ) -> dict[str, Any]:
        episode = _episode()
        if episode.pending_observation is not None:
            infer_request.messages.append({"role": "user", "content": episode.pending_observation})
            episode.pending_observation = None
        infer_request.messages = episode.manager.manage_context(infer_request.messages, episode.trajectory_id)
        return {"infer_request": infer_request}


def _reset_result(result: Any) -> tuple[str, dict[str, Any], str]:
    if not (isinstance(result, tuple | list) and len(result) == 3):
        raise EnvError(
            f"reset() returned {result!r}; return (observation: str, info: dict, system_message: str)"
        )
    observation, info, system_message = result
    return str(observation), _as_info(info), str(system_message or "")


def _step_result(result: Any, env: str) -> tuple[str, float, bool, dict[str, Any]]:
    if not (isinstance(result, tuple | list) and len(result) == 4):
        raise EnvError(
            f"{env}.step() returned {result!r}; return (next_observation: str, reward: float, done: bool, info: dict)"
        )
    observation, reward, done, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise EnvError(f"{env}.step() returned reward {reward!r}; give a float") from None
    return str(observation or ""), reward, bool(done), _as_info(info)


def _as_info(info: Any) -> dict[str, Any]:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise EnvError(f"an env returned info {info!r}; give a dict (it goes to completions.jsonl)")
    # Plain JSON-able values: infos travel in the Trajectory record and land in completions.jsonl.
    return msgspec.to_builtins(info, enc_hook=repr, str_keys=True)
