"""Real processes for the reliability tests: a test-owned redis-server (ops/redis.conf: AOF, everysec) on a
free port, and the Procfile's stage workers as subprocesses (``rollstream worker STAGE``), each in its own
session so a SIGKILL takes exactly that worker. Everything is stopped by PID."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REDIS_CONF = ROOT / "ops" / "redis.conf"
PLUGINS = Path(__file__).resolve().parent / "plugins"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(args: list[str], directory: Path, log_path: Path, answers: Callable[[], bool],
                       timeout_s: float) -> subprocess.Popen:
    """``redis-server *args --dir directory`` in a session of its own, its output to ``log_path``; returns once
    ``answers()`` (its PING answers), or raises with the log's tail if it exits or the time passes."""
    directory.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:
        process = subprocess.Popen(["redis-server", *args, "--dir", str(directory)], stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not answers():  # poll with a deadline: it loads its files (the AOF) and binds its port before answering
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not start: {log_path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    return process


class RedisServer:
    """``redis-server ops/redis.conf --port P --dir D``: the shipped settings, on a port and dir of our own."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> None:
        self.process = start_redis_server(
            [str(REDIS_CONF), "--port", str(self.port)], self.directory, self.directory / "redis.log",
            lambda: _answers(self.port), timeout_s,
        )

    def kill(self) -> None:
        """SIGKILL: no shutdown save, exactly what a crash leaves behind (the AOF as written so far)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()
        self.restarts += 1

    def stop(self) -> None:
        self.kill()


@dataclass
class WorkerProcess:
    stage: str
    index: int
    process: asyncio.subprocess.Process
    worker_id: str  # its consumer name in the stream groups
    started: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.index}"


async def spawn_logged(argv: list[str], log: Path) -> asyncio.subprocess.Process:
    """Start ``argv`` in the repository root, its output appended to ``log``: a file, not a pipe, so a chatty
    process never blocks on a full pipe; in its own session, so a kill takes whatever it started too."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        return await asyncio.create_subprocess_exec(
            *argv,
            cwd=ROOT,
            stdout=fd,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        os.close(fd)


async def rollstream_cli(*args: str, timeout_s: float = 120) -> tuple[int, str]:
    """Run the ``rollstream`` CLI (``python -m rollstream.cli``) to its end; its exit code and output."""
    done = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "rollstream.cli", *args], check=False, cwd=ROOT,
        capture_output=True, text=True, timeout=timeout_s,
    )
    return done.returncode, done.stdout + done.stderr


async def kill_spawned(processes: Iterable[asyncio.subprocess.Process]) -> None:
    """SIGKILL each of ``spawn_logged``'s processes still running (its whole session), and reap it."""
    for process in processes:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), timeout=60)


class Workers:
    """The Procfile's workers over one config, started, killed, restarted and reaped by PID."""

    def __init__(self, config: str, settings: list[str], log_dir: Path) -> None:
        self.command = [sys.executable, "-m", "rollstream.cli", "worker"]
        self.config = config
        self.settings = settings
        self.log_dir = log_dir
        self.running: dict[str, WorkerProcess] = {}
        self.exited: list[tuple[str, int]] = []  # (name, exit code) of every process that ended
        log_dir.mkdir(parents=True, exist_ok=True)

    async def start(self, stage: str, index: int = 0) -> WorkerProcess:
        name = f"{stage}-{index}"
        worker_id = f"{name}-{len(self.exited)}"  # a new consumer name per start, as a new pid would give
        argv = [*self.command, stage, "-c", self.config, "--worker-id", worker_id]
        for setting in self.settings:
            argv += ["--set", setting]
        process = await spawn_logged(argv, self.log_dir / f"{name}.log")
        worker = self.running[name] = WorkerProcess(stage, index, process, worker_id)
        return worker

    async def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 60) -> int:
        """SIGKILL takes the worker's whole process group (a rollout's engine core dies with it); any other
        signal goes to the worker process alone, as systemd's KillMode=mixed or Kubernetes send SIGTERM: the
        worker drains and then shuts its engine down itself."""
        worker = self.running.pop(name)
        if worker.process.returncode is None:
            if sig == signal.SIGKILL:
                os.killpg(worker.process.pid, sig)
            else:
                worker.process.send_signal(sig)
        code = await asyncio.wait_for(worker.process.wait(), timeout_s)
        self.exited.append((name, code))
        return code

    async def wait(self, name: str, timeout_s: float) -> int:
        worker = self.running.pop(name)
        code = await asyncio.wait_for(worker.process.wait(), timeout_s)
        self.exited.append((name, code))
        return code

    def children(self, name: str) -> list[int]:
        """PIDs of a worker's child processes (the vLLM engine core of a rollout worker), from /proc;
        multiprocessing's resource tracker left out."""
        pid = self.running[name].process.pid
        found = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
                if b"resource_tracker" not in cmdline:
                    found.append(int(child))
        return found

    def failed(self) -> list[str]:
        """Workers that ended on their own with a non-zero code (not by our kill)."""
        return [w.name for w in self.running.values() if w.process.returncode not in (None, 0)]

    def log(self, name: str, tail: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-tail:] if path.exists() else ""

    async def stop_all(self) -> None:
        for name in list(self.running):
            await self.kill(name)


@asynccontextmanager
async def openenv_app(app: str, env: dict[str, str] | None = None) -> AsyncIterator[str]:
    """An openenv-core app of tests/plugins (``module:app``) under uvicorn on a loopback port, healthy (its
    /health answers); yields its URL, and stops it by PID."""
    import httpx
    from polling import wait_until

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        cwd=PLUGINS, env=env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            assert proc.returncode is None, "the OpenEnv server exited"
            return False

    try:
        await wait_until(healthy, what="the OpenEnv server's /health", timeout_s=60)
        yield url
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)
