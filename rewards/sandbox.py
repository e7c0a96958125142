"""Run an untrusted Python program in a subprocess that cannot hurt the worker.

Layers, outermost first:

- a fresh temp dir as cwd (removed afterwards), an empty environment, ``python -I`` (no PYTHON* vars,
  no user site-packages), its own session so a timeout kills every process it started;
- a network namespace with no interfaces (``unshare --net --map-root-user``) where the kernel allows
  unprivileged user namespaces; everywhere, sockets are refused by policy (below);
- resource limits set by the guard before the program runs: CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS), written file size (RLIMIT_FSIZE), no new processes (RLIMIT_NPROC), few open files;
- an audit hook (PEP 578) that refuses sockets, subprocesses/fork/exec, ctypes (and importing the C
  modules behind them), reads of /proc and
  /sys (another process's environment), and any write, delete or rename outside the temp dir;
- the parent's wall-clock timeout and output cap: over either, the whole process group is killed.

The audit hook is a policy, not a security boundary on its own (C extensions can bypass it); the
rlimits and the namespace are the kernel-enforced part. Treat it as protection against runaway and
careless model output, not against a determined attacker with a kernel exploit.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# The guard runs first in the sandboxed interpreter: limits, then the audit hook, then the program.
# argv: guard.py <cpu_s> <memory_bytes> <file_bytes>; the program is ./main.py in the temp dir.
_GUARD = r'''
import os, resource, runpy, sys

cpu_s, memory, file_bytes = (int(a) for a in sys.argv[1:4])
for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory),
                     (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NPROC, 1),
                     (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))

ROOT = os.path.realpath(os.getcwd())
WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
          "os.forkpty", "pty.", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill", "os.putenv")
PATH_EVENTS = {"os.remove": 0, "os.rmdir": 0, "os.rename": 0, "os.replace": 0, "os.mkdir": 0,
               "os.chmod": 0, "os.chown": 0, "os.link": 1, "os.symlink": 1, "os.truncate": 0,
               "os.utime": 0, "shutil.rmtree": 0}

def inside(path):
    if isinstance(path, int):  # a file descriptor we already hold
        return True
    path = os.path.realpath(os.fsdecode(path))
    return path == ROOT or path.startswith(ROOT + os.sep)

def refuse(what):
    raise PermissionError(f"sandbox: {what} is not allowed")

NO_IMPORT = {"_posixsubprocess", "_ctypes", "_xxsubinterpreters", "_interpreters"}  # fork/exec, raw memory

def hook(event, args):
    if event.startswith(DENIED):
        refuse(event)
    if event == "import" and args[0] in NO_IMPORT:
        refuse(f"importing {args[0]}")
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance(path, int):
            return
        text = os.fsdecode(path)
        if text.startswith(("/proc", "/sys")) and not text.startswith("/proc/self/fd"):
            refuse(f"reading {text}")
        writing = (isinstance(mode, str) and any(m in mode for m in "wax+")) or bool(flags & WRITE)
        if writing and not inside(path):
            refuse(f"writing {text}")
    elif event in PATH_EVENTS:
        for path in args[: PATH_EVENTS[event] + 1]:
            if path is not None and not inside(path):
                refuse(f"{event} on {os.fsdecode(path)}")

sys.addaudithook(hook)
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
'''


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    max_output_bytes: int = 65536
    max_file_bytes: int = 1 << 20


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What happened. ``reason`` is one low-cardinality word ("" = exit 0), ``detail`` says more."""

    stdout: str
    stderr: str
    exit_code: int | None
    reason: str = ""
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """``unshare --net --map-root-user --`` when this kernel lets us make a network namespace, else ()."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        probe = subprocess.run([unshare, "--net", "--map-root-user", "--", "true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (unshare, "--net", "--map-root-user", "--") if probe.returncode == 0 else ()


def _classify(exit_code: int | None, stderr: str) -> tuple[str, str]:
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if exit_code == 0:
        return "", ""
    if "sandbox:" in stderr:
        return "refused", last
    if "MemoryError" in stderr or exit_code == -signal.SIGSEGV:
        return "memory", last or "out of memory"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_time", f"killed by signal {-exit_code}"
    if exit_code == -signal.SIGXFSZ or "File too large" in stderr:
        return "file_size", last
    if "BlockingIOError" in stderr or "Resource temporarily unavailable" in stderr:
        return "refused", last  # fork/threads over RLIMIT_NPROC
    return "exit", f"exit {exit_code}: {last}"


async def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` under the sandbox with ``stdin``; never raises for anything the program does."""
    workdir = tempfile.mkdtemp(prefix="rollstream-sandbox-")
    try:
        Path(workdir, "main.py").write_text(code)  # a few KiB on a tmpfs-like dir: not worth a thread
        # A backstop one second past the wall clock: the wall timeout is the rule (and its reason), the
        # CPU limit only catches a parent too busy to fire its timer on time.
        cpu_s = math.ceil(limits.timeout_s) + 1
        argv = [
            *network_namespace_prefix(),
            sys.executable,
            "-I",
            "-c",
            _GUARD,
            str(cpu_s),
            str(limits.memory_mb << 20),
            str(limits.max_file_bytes),
        ]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workdir,
            env={},
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # one process group: a timeout kills everything it started
        )
        try:
            out, err, over = await asyncio.wait_for(
                _communicate(proc, stdin.encode(), limits.max_output_bytes), timeout=limits.timeout_s
            )
        except TimeoutError:
            await _kill(proc)
            return SandboxResult("", "", proc.returncode, "timeout", f"over {limits.timeout_s} s wall clock")
        if over:
            await _kill(proc)
            return SandboxResult("", "", proc.returncode, "output_limit", f"over {limits.max_output_bytes} bytes")
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        reason, detail = _classify(proc.returncode, stderr)
        return SandboxResult(stdout, stderr, proc.returncode, reason, detail)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _communicate(proc: asyncio.subprocess.Process, data: bytes, cap: int) -> tuple[bytes, bytes, bool]:
    """Feed stdin, read both pipes up to ``cap`` bytes in all; True when the program wrote more."""
    out, err = bytearray(), bytearray()
    stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr
    assert stdin is not None and stdout is not None and stderr is not None, "started with three pipes"

    async def feed() -> None:
        try:
            stdin.write(data)
            await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program exited without reading its input
        finally:
            stdin.close()

    async def pump(stream: asyncio.StreamReader, buf: bytearray) -> bool:
        while chunk := await stream.read(65536):
            buf += chunk
            if len(out) + len(err) > cap:
                return True
        return False

    feeding = asyncio.create_task(feed())
    pumps = [asyncio.create_task(pump(stdout, out)), asyncio.create_task(pump(stderr, err))]
    try:
        over = False
        for next_done in asyncio.as_completed(pumps):
            if await next_done:
                over = True
                break
        if not over:
            await feeding
            await proc.wait()
        return bytes(out), bytes(err), over
    finally:  # a timeout (cancellation) or the cap: stop feeding and reading; the caller kills it
        for task in [*pumps, feeding]:
            task.cancel()


async def _kill(proc: asyncio.subprocess.Process) -> None:
    """Kill the program's whole process group and reap it.

    Reading the pipes to EOF is part of reaping: a flood left unread fills the stream buffer, asyncio
    pauses the pipe, never sees it close, and ``wait()`` (which waits for the pipes too) never returns.
    After SIGKILL at most a pipe's capacity is left to read."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    await asyncio.wait_for(proc.communicate(), timeout=10)
