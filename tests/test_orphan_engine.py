"""A SIGKILLed rollout worker takes its vLLM engine core with it (engines/orphan_guard.py).

A real ``rollstream worker rollout`` on the tiny model and a test-owned redis-server: once the worker serves
(its lease on the weights edge is in Redis, so its engine is up), only the worker's own PID is SIGKILLed
(not its process group, which would take the engine core too and prove nothing), and the engine core must
be gone within a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from polling import wait_until
from procs import ROOT, RedisServer, Workers

from pipeline.transport import connect
from stages import WEIGHTS

pytestmark = pytest.mark.slow

ENGINE_START_S = 300  # a loaded 2-core machine: the engine takes 10-60 s here
ORPHAN_DEADLINE_S = 5.0  # "within a few seconds" of its worker


def alive(pid: int) -> bool:
    """Running (a zombie already released its memory; its parent, init, reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def rollout_settings(run: str, out: Path, url: str) -> list[str]:
    return [
        f"run.name={run}",
        f"run.output_dir={json.dumps(str(out))}",
        "run.metrics_port=0",
        "run.log_level=warning",
        "rollout.max_model_len=256",
        "rollout.engine_threads=1",
        f"transport.url={url}",
    ]


async def test_sigkilled_rollout_worker_leaves_no_engine_core(tmp_path):
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    run = f"orphan-{uuid.uuid4().hex[:8]}"
    workers = Workers(
        "configs/demo-redis.toml", rollout_settings(run, tmp_path / "out", redis.url), tmp_path / "logs"
    )
    transport = await connect("redis", run=run, url=redis.url)
    engines: list[int] = []
    try:
        worker = await workers.start("rollout")

        async def serving() -> bool:
            if worker.process.returncode is not None:
                pytest.fail(
                    f"the rollout worker exited {worker.process.returncode}:\n{workers.log('rollout-0')}"
                )
            return worker.worker_id in await transport.leases(WEIGHTS)

        await wait_until(serving, "the rollout worker to serve (its engine up)", ENGINE_START_S, 0.2)
        engines = workers.children("rollout-0")
        assert engines, "the rollout worker has no engine-core child process"

        os.kill(worker.process.pid, signal.SIGKILL)  # the worker alone, as the OOM killer would
        await asyncio.wait_for(worker.process.wait(), 30)
        killed_at = time.monotonic()
        await wait_until(
            lambda: not any(alive(pid) for pid in engines),
            f"engine core(s) {engines} to die with their worker",
            ORPHAN_DEADLINE_S,
            0.05,
        )
        print(f"ORPHAN engine core gone {time.monotonic() - killed_at:.2f} s after its worker")
    finally:
        for pid in engines:  # never leave one behind, whatever failed above
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        workers.running.pop("rollout-0", None)
        await transport.close()
        redis.stop()


# The guard itself, in both ways vLLM starts its engine core (fork by default, spawn once CUDA is
# initialised): a parent process that starts a child which sleeps, then is SIGKILLed itself.
PARENT = """
import multiprocessing, sys, time
import engines.orphan_guard  # as the front end imports it (via engines.weight_loader) before starting

def child():
    import engines.orphan_guard  # as vLLM imports the worker extension in the engine core
    time.sleep(600)

if __name__ == "__main__":
    process = multiprocessing.get_context(sys.argv[1]).Process(target=child, name="EngineCore")
    process.start()
    print(process.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
async def test_guarded_child_dies_with_its_parent(tmp_path, method):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        method,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    child = 0
    try:
        child = int(await asyncio.wait_for(parent.stdout.readline(), 60))
        # The guard arms as the child starts (spawn: once it has imported the module): wait for its thread.
        await wait_until(lambda: len(os.listdir(f"/proc/{child}/task")) > 1, "the guard's thread", 60, 0.05)
        parent.send_signal(signal.SIGKILL)
        await parent.wait()
        await wait_until(
            lambda: not alive(child), f"the {method}ed child {child} to die", ORPHAN_DEADLINE_S, 0.05
        )
    finally:
        for pid in (parent.pid, child):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_child_whose_parent_is_already_gone_dies_at_once():
    """The race: the parent died before the guard armed (the child was reparented): it must not live on."""
    code = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, engines.orphan_guard as g; g.arm(os.getppid() + 1); print('alive')",
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert code.returncode == -signal.SIGKILL and "alive" not in code.stdout
