"""An engine core forked on a CPU (engines/vllm_engine.py) waits until no other thread of the process is
importing a module: the core would inherit that module half-made, with its import lock held by a thread
the core does not have, and hang at its own import of it (in ``rollstream train`` the learner loads its
model in a thread beside the engine's start)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import types

from engines import vllm_engine
from tests.polling import wait_until


async def test_the_core_fork_waits_for_another_threads_import_and_the_core_imports_it_whole(tmp_path, monkeypatch):
    gate = types.SimpleNamespace(entered=threading.Event(), release=threading.Event())
    monkeypatch.setitem(sys.modules, "_fork_gate", gate)
    (tmp_path / "half_made.py").write_text(
        "import _fork_gate\n_fork_gate.entered.set()\n_fork_gate.release.wait(60)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forked: dict[str, int] = {}
    status: dict[str, int] = {}

    def fork_a_core() -> None:
        with vllm_engine.forking_engine_core():
            pid = os.fork()
            if pid == 0:  # the "engine core": imports what the other thread was importing, then exits
                import half_made

                os._exit(0 if half_made.DONE else 1)
            forked["pid"] = pid

    def exited() -> bool:
        done, code = os.waitpid(forked["pid"], os.WNOHANG)
        if done:
            status["code"] = code
        return bool(done)

    importer = threading.Thread(target=__import__, args=("half_made",))
    forker = threading.Thread(target=fork_a_core)
    importer.start()
    try:
        assert gate.entered.wait(30)
        assert "half_made" in vllm_engine.modules_being_imported()
        forker.start()
        assert vllm_engine.core_fork_waiting.wait(30), "the fork did not wait for the other thread's import"
        assert "pid" not in forked
        gate.release.set()  # the import ends; then the fork goes ahead
        forker.join(30)
        await wait_until(exited, "the forked process to import the module whole and exit", 30, 0.05)
        assert os.waitstatus_to_exitcode(status["code"]) == 0
        assert not vllm_engine.core_fork_waiting.is_set()
    finally:
        gate.release.set()
        importer.join(30)
        forker.join(30)
        if "pid" in forked and "code" not in status:  # a child that hung on the import
            os.kill(forked["pid"], signal.SIGKILL)
            await asyncio.to_thread(os.waitpid, forked["pid"], 0)


async def test_a_started_engine_leaves_the_spawn_method_of_vllms_cpu_check_out_of_the_environment(vllm_engine):
    """vLLM's CPU config check writes VLLM_WORKER_MULTIPROC_METHOD=spawn into the environment. Left there,
    every process started afterwards (a test's stage workers, a launcher's children) inherits it as if the
    user had asked for spawn, and spawns its engine core: 7 s and 8 CPU-seconds more per engine. This session
    never set it (conftest does not), so after the session engine's start it is still unset."""
    assert vllm_engine is not None
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
