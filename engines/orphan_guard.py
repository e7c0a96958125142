"""The vLLM engine core dies with the process that started it.

vLLM's ``AsyncLLM`` runs its engine core as a child process that nothing ties to its parent: a SIGKILLed
rollout worker left it running (seen: 50 s later, 1.7 GB resident; on a GPU it would keep the card's
memory, so the restarted worker could not start its engine). This module is imported by the worker
extension (``engines.weight_loader``), which vLLM imports in the process that runs the model: the engine
core (or, with a multi-process executor, its workers, which vLLM already ties to the engine core). There it
starts a watchdog thread that SIGKILLs its own process as soon as its parent exits.

Why not ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the parent *thread* that forked the child
exits, and the engine core is forked from a worker thread of asyncio's default executor
(``asyncio.to_thread``), which may end long before the process does. A pidfd on the parent process (or,
where there is none, polling ``getppid``) follows the process itself, on CPU and GPU alike.

Two ways the code gets to run in the child:

- spawn (vLLM's choice once CUDA is initialised): the child imports this module afresh, and
  ``multiprocessing.parent_process()`` names the parent (or, while the child still imports its parent's
  main module, ``getppid()`` does);
- fork (vLLM's default otherwise): the module was imported by the parent before it forked, so importing it
  again does nothing; the ``os.register_at_fork`` hook below arms the guard in every child forked from a
  process that imported it (anything such a process forks should not outlive it either).

Either way the parent may already be gone when the guard arms (a kill during the engine's start-up): the
guard then compares ``getppid()`` with the expected parent and dies at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import threading
import time

POLL_S = 0.5  # where no pidfd can be opened: how often getppid is compared

_armed_in: int | None = None  # the pid of the process the guard runs in (a forked child re-arms)
_forking_pid: int | None = None  # set in the parent just before a fork: the child's expected parent


def _die() -> None:
    # SIGKILL: the engine core's own SIGTERM handler starts a graceful shutdown that waits for a front end
    # that no longer exists; its multi-process workers follow it (vLLM's death pipe).
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int, pidfd: int | None) -> None:
    if pidfd is not None:
        select.select([pidfd], [], [])  # readable once the parent has exited
    else:
        while os.getppid() == parent:
            time.sleep(POLL_S)  # no pidfd here (old kernel, seccomp): poll the parent
    _die()


def arm(parent: int) -> None:
    """Kill this process when process ``parent`` (its parent) exits; at once if it already has. Once per
    process: a second call in the same process does nothing."""
    global _armed_in
    if _armed_in == os.getpid():
        return
    _armed_in = os.getpid()
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):  # ProcessLookupError (gone), ENOSYS, no pidfd_open
        pidfd = os.pidfd_open(parent)
    # After the pidfd is open: a parent that died before it (and whose pid may be reused) shows here, as we
    # have been reparented (to init or a subreaper).
    if os.getppid() != parent:
        _die()
    threading.Thread(target=_watch, args=(parent, pidfd), name="rollstream-orphan-guard", daemon=True).start()


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _after_fork_in_child() -> None:
    if _forking_pid is not None:
        arm(_forking_pid)


def _install() -> None:
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:  # a multiprocessing child importing us afresh (spawn)
        arm(parent.pid)
    elif getattr(multiprocessing.current_process(), "_inheriting", False):
        # A spawned child still importing its parent's main module (before multiprocessing names the
        # parent): the process that spawned it is its parent now.
        arm(os.getppid())


_install()
