"""verifiers environments, unchanged: ``data.dataset = "verifiers:<env id>"`` (an installed verifiers >= 0.4 package).

verifiers runs in its own interpreter (``rollout.verifiers_python``, ``make venv-verifiers``): its pins (openai
2.x, mcp, transformers through ``renderers``) are not rollstream's. rollstream talks to it through
``compat/verifiers_bridge.py`` over JSON lines (``VerifiersBridge``): the taskset becomes the dataset (one row per
task, ``num_generations`` episodes per task, as GRPO groups them), and each request runs one episode through
verifiers' own runner (the ``null`` harness in the ``subprocess`` runtime: nothing calls Prime's services) against
this worker's agent endpoint (``schedulers/agent_endpoint.py``): verifiers renders the chat template itself and
samples through ``/inference/v1/generate`` (token ids in, token ids and log-probs out) with a per-episode key in
its base URL.

Each trainable trace's branches become records of the request (``token_ids`` / ``sampled_mask`` / ``logprobs``, a
sampled token shared by two branches trained once: the bridge masks it in all but the first); the trace's named
rewards travel as ``rollout_infos["rewards"]`` with their weights (``rewards/<name>/mean`` in metrics.jsonl; the
total is verifiers' ``trace.reward``), added to whatever ``reward.reward_funcs`` score.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from pathlib import Path
from typing import Any

from schedulers.agent_endpoint import AgentEndpoint
from schedulers.base import MultiTurnScheduler, SchedulerError
from schedulers.engine import CURRENT, RequestContext
from schedulers.gym import EnvFailed
from schedulers.protocol import RequestConfig, RolloutInferRequest

PREFIX = "verifiers:"
BRIDGE = Path(__file__).resolve().parents[1] / "compat" / "verifiers_bridge.py"
TASK_KEY = "vf_task"  # the row's column holding the verifiers task data (JSON), as the bridge rebuilds it
START_TIMEOUT_S = 120.0  # importing verifiers and loading the env: 4.5-7 s measured on 2 busy cores


class VerifiersError(SchedulerError):
    """The bridge cannot start, or an environment cannot be used (the message says which and the fix)."""


def env_id(dataset: str) -> str:
    return dataset.removeprefix(PREFIX)


def check_python(python: str) -> str:
    path = Path(python)
    if not path.exists():
        raise VerifiersError(
            f"rollout.verifiers_python = {python!r} does not exist: verifiers runs in its own venv (its pins are "
            f"not rollstream's); build it with `make venv-verifiers` (verifiers 0.4.0 and uv), then install the "
            f"environment package into it (`{python} -m pip install <env package>`)"
        )
    return str(path)


def bridge_command(python: str, env: str, taskset: dict[str, Any]) -> list[str]:
    return [check_python(python), str(BRIDGE), "--env", env, "--taskset-json", json.dumps(taskset)]


def load_tasks(python: str, env: str, taskset: dict[str, Any], limit: int | None = None) -> list[dict[str, Any]]:
    """The taskset as dataset rows ``{"prompt": messages, "vf_task": task data}`` (a bridge started for it)."""
    async def ask() -> dict[str, Any]:
        bridge = VerifiersBridge(bridge_command(python, env, taskset))
        try:
            return await bridge.request({"op": "tasks", **({"limit": limit} if limit else {})}, START_TIMEOUT_S)
        except TimeoutError:
            raise VerifiersError(f"verifiers env {env!r}: the bridge did not list its tasks in "
                                 f"{START_TIMEOUT_S:g} s") from None
        finally:
            await bridge.close()

    answer = asyncio.run(ask()) if not _loop_running() else _in_thread(ask)
    if "tasks" not in answer:
        raise VerifiersError(f"verifiers env {env!r}: the bridge did not list tasks ({answer})")
    return [{"prompt": prompt, TASK_KEY: task} for task, prompt in zip(answer["tasks"], answer["prompts"])]


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _in_thread(make: Any) -> Any:
    """Run ``make()``'s coroutine on a loop of its own (the caller is inside one: the in-process train)."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


class VerifiersBridge:
    """One bridge process: requests written as JSON lines, each answered by the line with its id."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.proc: asyncio.subprocess.Process | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._starting = asyncio.Lock()
        self.startup_s: float | None = None

    async def start(self) -> None:
        async with self._starting:
            if self.proc is not None and self.proc.returncode is None:
                return
            self.proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=64 * 1024 * 1024)  # stderr: the console (verifiers' own logs and errors stay visible)
            stdout = self.proc.stdout
            assert stdout is not None, "started with a stdout pipe"
            try:
                line = await asyncio.wait_for(stdout.readline(), timeout=START_TIMEOUT_S)
            except TimeoutError:
                await self.close()
                raise VerifiersError(f"the verifiers bridge did not start in {START_TIMEOUT_S:g} s") from None
            ready = json.loads(line) if line.strip() else {}
            if not ready.get("ready"):
                await self.close()
                raise VerifiersError(f"the verifiers bridge failed to start: {ready.get('error', 'it exited')}")
            self.startup_s = ready.get("startup_s")
            self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            answer = json.loads(line)
            future = self._waiting.pop(answer.get("id"), None)
            if future is not None and not future.done():
                future.set_result(answer)
        for future in self._waiting.values():  # the bridge died: every run in flight fails with that
            if not future.done():
                future.set_exception(VerifiersError(f"the verifiers bridge exited (code {self.proc.returncode})"))
        self._waiting.clear()

    async def request(self, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        await self.start()
        ident = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[ident] = future
        stdin = self._stdin()
        stdin.write((json.dumps({**body, "id": ident}) + "\n").encode())
        await stdin.drain()
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=timeout_s)
        except (TimeoutError, asyncio.CancelledError):
            self._waiting.pop(ident, None)
            with contextlib.suppress(Exception):  # the episode and its harness process are torn down there
                stdin.write((json.dumps({"op": "cancel", "id": ident}) + "\n").encode())
            raise

    def _stdin(self) -> asyncio.StreamWriter:
        assert self.proc is not None and self.proc.stdin is not None, "started with a stdin pipe"
        return self.proc.stdin

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                stdin = self._stdin()
                stdin.write(b'{"op": "close"}\n')
                await stdin.drain()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
        self.proc = None


def trace_records(trace: dict[str, Any], infos: dict[str, Any]) -> list[dict[str, Any]]:
    """Pure: one trace's branches as result dicts: the ids before the branch's first sampled token are its
    prompt, the rest its completion with the bridge's mask (0 on inserted tokens and on sampled tokens an earlier
    branch trains)."""
    out = []
    for branch in trace["branches"]:
        ids, mask, logprobs = branch["token_ids"], [int(m) for m in branch["sampled_mask"]], branch["logprobs"]
        start = next((i for i, m in enumerate(mask) if m), None)
        if start is None:
            continue  # every sampled token of this branch is trained in an earlier one
        out.append({
            "prompt_token_ids": ids[:start],
            "response_token_ids": [ids[start:]],
            "response_loss_mask": [mask[start:]],
            "rollout_logprobs": [[lp for lp, m in zip(logprobs[start:], mask[start:]) if m]],
            "explicit_loss_mask": True,
            "messages": trace.get("messages") or None,
            "finish_reason": "length" if trace.get("truncated") else "stop",
            "rollout_infos": infos,
        })
    return out


class VerifiersScheduler(MultiTurnScheduler):
    """``verifiers``: one request = one episode of the verifiers environment, run by the bridge."""

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *, verifiers_env: str | None = None,
                 verifiers_python: str = ".venv-verifiers/bin/python", verifiers_taskset: dict[str, Any] | None = None,
                 verifiers_max_episodes: int = 4, agent_timeout_s: float = 600.0, agent_host: str = "127.0.0.1",
                 max_completion_length: int | None = None, **kwargs: Any) -> None:
        super().__init__(infer_engine, max_turns, **kwargs)
        if not verifiers_env:
            raise VerifiersError('the verifiers scheduler needs data.dataset = "verifiers:<env id>"')
        self.bridge = VerifiersBridge(bridge_command(verifiers_python, verifiers_env, dict(verifiers_taskset or {})))
        self.slots = asyncio.Semaphore(verifiers_max_episodes)  # each episode runs a harness process: CPU-bound
        self.timeout_s = agent_timeout_s
        self.host = agent_host
        self.max_completion_length = max_completion_length
        self.endpoint: AgentEndpoint | None = None

    async def shutdown(self) -> None:
        await self.bridge.close()
        if self.endpoint is not None:
            await self.endpoint.close()

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None,
                  **kwargs: Any) -> list[dict[str, Any]]:
        if self.endpoint is None:
            self.endpoint = AgentEndpoint(self.infer_engine, host=self.host)
        await self.endpoint.start()
        task = infer_request.data_dict.get(TASK_KEY)
        if task is None:
            raise VerifiersError(f"the row has no {TASK_KEY!r} column: verifiers episodes need rows from "
                                 f'data.dataset = "verifiers:<env id>"')
        ctx = CURRENT.get() or RequestContext(request_id=infer_request.uuid or "request",
                                              config=request_config or RequestConfig())
        config = ctx.config
        sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                    "min_p": config.min_p, "repetition_penalty": config.repetition_penalty,
                    "max_tokens": self.max_completion_length or config.max_tokens, "seed": config.seed}
        session = self.endpoint.open(ctx, self.max_completion_length or config.max_tokens)
        try:
            async with self.slots:
                answer = await self.bridge.request({
                    "op": "run", "task": task, "base_url": self.endpoint.session_url(session), "model": "policy",
                    "renderer_model_name": str(self.infer_engine.model),
                    "sampling": {k: v for k, v in sampling.items() if v is not None}}, self.timeout_s)
        except TimeoutError:
            raise EnvFailed(f"verifiers episode timed out after {self.timeout_s:g} s (rollout.agent_timeout_s)") from None
        finally:
            self.endpoint.close_session(session)
        if not answer.get("ok"):
            raise EnvFailed(f"verifiers episode failed: {'; '.join(answer.get('errors') or ['no reason given'])}")
        traces = answer.get("traces") or []
        if len(traces) != 1:
            raise EnvFailed(f"verifiers episode gave {len(traces)} trainable traces; one per episode is supported "
                            f"(a multi-agent env needs one request per trace)")
        trace = traces[0]
        infos = {"rewards": trace["rewards"], "reward_weights": trace["weights"], "vf_metrics": trace.get("metrics", {}),
                 "vf_stop": trace.get("stop"), "branches": len(trace["branches"]), "num_turns": len(session.calls)}
        records = trace_records(trace, infos)
        if not records:
            raise EnvFailed("verifiers episode sampled no token to train")
        versions = [c.versions for c in session.calls] or [(0, 0)]
        for record in records:
            record["policy_versions"] = (min(v[0] for v in versions), max(v[1] for v in versions))
        return records


__all__ = ["PREFIX", "VerifiersBridge", "VerifiersError", "VerifiersScheduler", "env_id", "load_tasks",
           "trace_records"]
