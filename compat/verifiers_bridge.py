"""The verifiers bridge: a verifiers 0.4 (v1 API) environment, run unchanged, served to rollstream over JSON lines.

It runs under its own interpreter (``.venv-verifiers/bin/python``, built by ``make venv-verifiers``) and imports
only verifiers and the standard library: verifiers 0.4.0 pins openai 2.54, mcp 2.0.0 and transformers 5 through
``renderers``, which rollstream's venv does not share, and an environment's code, crashes and event-loop blocking
stay out of the rollout worker (the shape prime-rl and torchtitan use; shared/NOTES-verifiers.md §5).

    python compat/verifiers_bridge.py --env rollstream-add --taskset-json '{"num_tasks": 8}'

loads the environment with the ``null`` harness (a tool-less chat loop) in the ``subprocess`` runtime (verifiers'
defaults are the ``bash`` harness, which runs the model's shell commands, and Prime's remote sandboxes), prints
one ``{"ready": true, ...}`` line, then serves requests, one JSON object per line on stdin, each answered by one
line on stdout matching its ``id`` (logs go to stderr):

- ``{"op": "tasks", "id": 1, "limit": 100}`` -> ``{"id": 1, "tasks": [task data], "prompts": [chat messages]}``;
- ``{"op": "run", "id": 2, "task": {task data}, "base_url": "http://127.0.0.1:PORT/s/KEY/v1", "model": "policy",
  "renderer_model_name": "/local/model/dir", "sampling": {"temperature": 1.0, ...}}`` -> one episode through
  verifiers' train client (it renders the chat template itself and calls ``POST {base_url minus /v1}/inference/
  v1/generate``: token ids in, token ids and logprobs out) -> ``{"id": 2, "ok": ..., "errors": [...], "traces":
  [...]}``, one entry per trainable trace, each with its branches as ``token_ids``/``sampled_mask``/``logprobs``;
- ``{"op": "cancel", "id": 2}`` cancels run 2 (it answers ok=false, "cancelled");
- ``{"op": "close"}`` (or end of input) cancels what is in flight and exits 0.

Runs are concurrent: each is answered when its episode ends. A failing run answers its id with ok=false and the
error; it never takes the bridge down.

``--warm`` prepares what the environment's harnesses install on first use (the ``null`` harness: a uv-managed
venv for its chat program, synced from PyPI) and exits: ``make venv-verifiers`` runs it, so episodes start warm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

VENV = Path(sys.prefix)  # the bridge venv (.venv-verifiers): its uv cache and verifiers' home live under it


def isolate(home: Path) -> None:
    """Point every file verifiers, uv and the harness write at directories the bridge owns, before verifiers is
    imported (it reads ``$HOME`` at import: ``verifiers/v1/utils/paths.py`` ``CACHE_DIR``)."""
    home.mkdir(parents=True, exist_ok=True)
    os.environ["HOME"] = str(home)
    for name, sub in (("XDG_CACHE_HOME", ".cache"), ("XDG_DATA_HOME", ".local/share"),
                      ("XDG_CONFIG_HOME", ".config")):
        os.environ[name] = str(home / sub)
    # The uv cache the make target warmed; never let uv fetch a Python (the harness program runs on ours).
    os.environ.setdefault("UV_CACHE_DIR", str(VENV / "uv-cache"))
    os.environ["UV_PYTHON_DOWNLOADS"] = "never"
    # The runtime runs `uv` from PATH (and otherwise tries `pip install --user uv`, then curl | sh): ours first.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # rollstream's interpreter settings must not reach the harness's own venv.
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        os.environ.pop(name, None)


def env_config(env_id: str, knobs: dict[str, Any]) -> dict[str, Any]:
    return {"taskset": {**knobs, "id": env_id},
            "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}


def prompt_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation the ``null`` harness opens with: the system prompt as its own message (the harness sets
    ``APPENDS_SYSTEM_PROMPT``), then the prompt, a string being one user message."""
    system, prompt = data.get("system_prompt"), data.get("prompt")
    messages = [{"role": "system", "content": system}] if system is not None else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt:
        messages.extend(prompt)
    return messages


def trace_branches(trace: Any) -> list[dict[str, Any]]:
    """A trace's trainable branches as plain lists. A sampled message node on two branches (a turn both share
    before they diverge) keeps its mask in the first branch only, so no sampled token is trained twice (as
    prime-rl, orchestrator/trajectories.py)."""
    trained: set[int] = set()  # id() of the nodes already trained: Branch.nodes holds the trace's own nodes
    out = []
    for branch in trace.branches:
        if not branch.trainable:  # an abandoned compaction attempt
            continue
        mask, logprobs = [int(m) for m in branch.sampled_mask], list(branch.logprobs)
        start = 0
        for node in branch.nodes:
            end = start + len(node.token_ids)
            if id(node) in trained:
                mask[start:end] = logprobs[start:end] = [0] * (end - start)
            elif any(node.mask):
                trained.add(id(node))
            start = end
        out.append({"token_ids": list(branch.token_ids), "sampled_mask": mask, "logprobs": logprobs})
    return out


def trace_result(trace: Any) -> dict[str, Any]:
    timing = trace.timing
    return {
        "trace_id": trace.id,  # what the train client sent as X-Session-ID on each call
        "reward": trace.reward,
        "rewards": {name: r.score for name, r in trace.rewards.items() if r is not None},
        "weights": {name: r.weight for name, r in trace.rewards.items() if r is not None},
        "metrics": dict(trace.metrics),
        "stop": trace.stop_condition,
        "truncated": trace.is_truncated,
        "num_turns": trace.num_turns,
        "messages": [m.model_dump(mode="json", exclude_none=True) for m in trace.messages],
        "branches": trace_branches(trace),
        "timing_s": {"setup": timing.setup.duration, "agent": timing.agent.duration,
                     "model": timing.agent.model.duration, "harness": timing.agent.harness.duration,
                     "scoring": timing.scoring.duration},
    }


def error_text(error: Any) -> str:
    return f"{error.type}: {error.message}"


class Bridge:
    def __init__(self, env: Any, out: Any, max_concurrent: int | None) -> None:
        self.env = env
        self.out = out
        self.task_cls = type(env.taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self.semaphore = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self.running: dict[Any, asyncio.Task] = {}

    def send(self, message: dict[str, Any]) -> None:
        # One write per line: concurrent answers never interleave (one thread, no await inside).
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    def tasks(self, request: dict[str, Any]) -> dict[str, Any]:
        import itertools

        limit = request.get("limit")
        if limit is None and not self.env.taskset.bounded:
            raise ValueError("this taskset is infinite: ask for tasks with a \"limit\"")
        tasks = [t.data.model_dump(mode="json") for t in itertools.islice(self.env.taskset, limit)]
        return {"tasks": tasks, "prompts": [prompt_messages(t) for t in tasks]}

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        for key in ("task", "base_url", "renderer_model_name"):
            if not request.get(key):
                raise ValueError(f"a run needs {key!r}")
        # Rebuilt from its wire data, as verifiers' own EnvServer does (serve/server.py _build_task).
        task = self.task_cls(self.data_cls.model_validate(request["task"]), self.env.config.taskset.task)
        client = vf.TrainClientConfig(base_url=request["base_url"], api_key_var="",
                                      renderer_model_name=request["renderer_model_name"],
                                      renderer=request.get("renderer"))
        ctx = vf.ModelContext(model=request.get("model") or "policy", client=client,
                              sampling=vf.SamplingConfig(**(request.get("sampling") or {})))
        (slot,) = self.env.slots(task, n=1)
        try:
            episode = await self.env.run_slot(slot, ctx, self.semaphore)
        finally:
            await self.forget_client(client)
        errors = [error_text(e) for e in episode.errors]
        errors += [error_text(e) for t in episode.traces for e in t.errors]
        traces = [trace_result(t) for t in episode.traces if t.ok and t.agent.trainable]
        ok = bool(episode.ok)
        if ok and not any(any(b["sampled_mask"]) for t in traces for b in t["branches"]):
            ok = False  # an ok episode that sampled nothing has nothing to train (prime-rl promotes it too)
            errors.append("EmptyEpisode: the episode made no model call that sampled a token")
        return {"ok": ok, "errors": errors, "traces": traces}

    async def forget_client(self, client: Any) -> None:
        """Drop the run's model client. verifiers' interception server keeps one client per distinct client
        config until ``serving()`` ends (interception/server.py ``_client``), and renderers caches
        ``GET /models`` per base URL (renderers/client.py ``_max_prompt_len_cache``): with a base URL per episode
        both would grow by one entry per episode."""
        from renderers import client as renderers_client

        cache = renderers_client._max_prompt_len_cache
        for cached in [k for k in cache if k[0].rstrip("/") == client.base_url.rstrip("/")]:
            cache.pop(cached, None)
        key = client.model_dump_json()
        interception = self.env._interception
        for server in getattr(interception, "servers", None) or [interception]:
            dropped = getattr(server, "clients", {}).pop(key, None)
            if dropped is not None:
                await dropped.close()

    async def respond(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.tasks(request) if request["op"] == "tasks" else await self.run(request)

    def answer(self, ident: Any, task: asyncio.Task) -> None:
        """``task``'s outcome as its answer: a done callback, so a run cancelled before it ever started (a cancel
        read right after it) is answered too."""
        self.running.pop(ident, None)
        if task.cancelled():
            result = {"ok": False, "errors": ["Cancelled: the run was cancelled"], "traces": []}
        elif (exc := task.exception()) is not None:  # one request's failure is its answer, never the bridge's end
            print("".join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
            result = {"ok": False, "errors": [f"{type(exc).__name__}: {exc}"], "traces": []}
        else:
            result = task.result()
        self.send({"id": ident, **result})

    async def serve(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError as exc:
                request = f"not JSON ({exc})"
            if not isinstance(request, dict):
                self.send({"id": None, "ok": False, "errors": [f"BadRequest: a request is a JSON object: {request}"]})
                continue
            op, ident = request.get("op"), request.get("id")
            if op == "close":
                break
            if op == "cancel":
                task = self.running.get(ident)
                if task is not None:
                    task.cancel()
                continue
            if op not in ("tasks", "run"):
                self.send({"id": ident, "ok": False, "errors": [f"BadRequest: unknown op {op!r}"]})
                continue
            if ident in self.running:
                self.send({"id": ident, "ok": False, "errors": [f"BadRequest: id {ident!r} is already running"]})
                continue
            task = self.running[ident] = asyncio.create_task(self.respond(request))
            task.add_done_callback(lambda done, ident=ident: self.answer(ident, done))
        in_flight = list(self.running.values())
        for task in in_flight:
            task.cancel()
        await asyncio.gather(*in_flight, return_exceptions=True)


async def stdin_reader() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=256 * 1024 * 1024)  # a task's data can be large
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def warm(env: Any) -> None:
    """Run each harness's ``setup`` once in a throwaway subprocess runtime: for the uv-script harnesses
    (``null``, ``bash``) that is ``uv sync --script`` of their program into the shared script env. Then lock each
    script (``<script>.py.lock`` beside it): verifiers re-runs ``uv sync --script`` once per process, which without
    a lock re-resolves against PyPI every time (offline, the first episode fails); with one it installs from the
    cache (0.2 s)."""
    from verifiers.v1.runtimes import make_runtime
    from verifiers.v1.runtimes.subprocess import SubprocessConfig, SubprocessRuntime

    for harness in {id(h): h for h in env._harnesses.values()}.values():
        runtime = make_runtime(SubprocessConfig())
        await runtime.start()
        try:
            started = time.monotonic()
            await harness.setup(runtime)
            print(f"warmed harness {harness.config.id!r} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        finally:
            await runtime.stop()
    for script in sorted(Path(SubprocessRuntime.scripts_dir).glob("*.py")):
        if not script.with_name(f"{script.name}.lock").exists():
            lock = await asyncio.create_subprocess_exec("uv", "lock", "--script", str(script), "-q", "--no-config")
            if await lock.wait() != 0:
                raise RuntimeError(f"uv lock --script {script} failed (exit {lock.returncode})")
            print(f"locked {script}", file=sys.stderr)


async def main(args: argparse.Namespace, out: Any) -> int:
    started = time.monotonic()
    try:
        import verifiers
        import verifiers.v1 as vf

        config = vf.resolve_env_config(env_config(args.env, json.loads(args.taskset_json)))
        env = vf.load_environment(config)
    except Exception as exc:  # noqa: BLE001 - reported on the protocol, so the parent can say why
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        out.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    if args.warm:
        await warm(env)
        return 0
    reader = await stdin_reader()
    async with env.serving():
        bridge = Bridge(env, out, args.max_concurrent)
        bridge.send({"ready": True, "env": args.env, "verifiers": verifiers.__version__,
                     "home": os.environ["HOME"], "startup_s": round(time.monotonic() - started, 3)})
        await bridge.serve(reader)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", required=True, help="the environment: its taskset's id or module (owner/name@v ok)")
    parser.add_argument("--taskset-json", default="{}", help="taskset knobs, a JSON object (its TasksetConfig)")
    parser.add_argument("--home", type=Path, default=VENV / "bridge-home",
                        help="HOME (and XDG dirs) for verifiers' working files and the harness's script env")
    parser.add_argument("--max-concurrent", type=int, default=None, help="episodes run at once (default: all)")
    parser.add_argument("--warm", action="store_true", help="prepare the harnesses' first-use installs and exit")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    isolate(arguments.home.resolve())
    # The protocol owns stdout: anything else printing to it (a library, the env's code) lands on stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.exit(asyncio.run(main(arguments, protocol)))
