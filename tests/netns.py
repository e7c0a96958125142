"""Two hosts on one machine, for the multi-host tests: two network namespaces joined by a veth pair, each
with a private directory the other cannot see, and a redis-server both reach over the link.

::

    this namespace (the test)          host "a" (learner side)              host "b" (rollout side)
      10.213.X.6 ── veth ── 10.213.X.5    redis-server    10.213.X.1 ── veth ── 10.213.X.2

Redis runs on host "a" (as it often does: on the learner's machine), bound to a's two addresses: the test
talks to it over its own link (``test_url``), the workers over the a-b link (``url``), so a learner's
connection to Redis has a's address on the a-b link as its local address, the one host b can route to.
Each host's worker processes run under ``ip netns exec`` in a mount namespace of their own, where the other
host's private directory is covered by an empty tmpfs: a path one host writes does not exist on the other,
as with two machines that share no filesystem (the repository, the venv and the model cache stay visible:
the same software image on both).

Everything is started by PID, in its own session, and torn down even when the test fails: processes by
process group, then whatever is still inside a namespace (``ip netns pids``), then the namespaces (which
takes their veths along). Where namespaces cannot be made (not root, no ``ip``, a sandbox), the fixture
skips with the reason.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Workers

HOSTS = ("a", "b")
REDIS_PORT = 6379  # a fresh namespace: nothing else listens there
START_TIMEOUT_S = 20.0


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _setns(fd: int) -> None:
    import ctypes

    clone_newnet = 0x40000000
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, clone_newnet) != 0:
        raise OSError(ctypes.get_errno(), "setns(CLONE_NEWNET)")


def why_not() -> str | None:
    """Why network namespaces cannot be made here; None when they can."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if shutil.which("redis-server") is None:
        return "no redis-server"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    probe = f"rsprobe{uuid.uuid4().hex[:8]}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"cannot make a network namespace: {exc}"
    _ip("netns", "del", probe)
    return None


def _free_subnet() -> int:
    """A third octet X such that 10.213.X.0/29 is on no interface of this namespace (the test's link)."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    for x in random.sample(range(256), 256):
        if f"10.213.{x}." not in used:
            return x
    raise RuntimeError("no free 10.213.X.0/29 subnet for the test's namespaces")


class TwoHosts:
    """The namespaces, their addresses, the redis-server on host a, and the workers started on each host."""

    def __init__(self, root: Path) -> None:
        tag = uuid.uuid4().hex[:6]
        self.root = root
        self.ns = {host: f"rs{tag}{host}" for host in HOSTS}
        self._links = {"ab": (f"rs{tag}a", f"rs{tag}b"), "test": (f"rs{tag}t", f"rs{tag}r")}
        x = _free_subnet()
        net = ipaddress.ip_network(f"10.213.{x}.0/29")
        hosts = list(net.hosts())  # .1 .. .6
        self.address = {"a": str(hosts[0]), "b": str(hosts[1])}  # the a-b link (a /30 each)
        self._test_pair = (str(hosts[4]), str(hosts[5]))  # a's side, this namespace's side
        self.private = {host: root / f"host-{host}" for host in HOSTS}
        self.redis: subprocess.Popen | None = None
        self.workers: dict[str, Workers] = {}
        self._made: list[str] = []

    # ------------------------------------------------------------------ setup

    def create(self) -> None:
        for host in HOSTS:
            _ip("netns", "add", self.ns[host])
            self._made.append(self.ns[host])
            _ip("-n", self.ns[host], "link", "set", "lo", "up")
            self.private[host].mkdir(parents=True, exist_ok=True)
        a_end, b_end = self._links["ab"]
        _ip("link", "add", a_end, "type", "veth", "peer", "name", b_end)
        _ip("link", "set", a_end, "netns", self.ns["a"])
        _ip("link", "set", b_end, "netns", self.ns["b"])
        for host, end in (("a", a_end), ("b", b_end)):
            _ip("-n", self.ns[host], "addr", "add", f"{self.address[host]}/30", "dev", end)
            _ip("-n", self.ns[host], "link", "set", end, "up")
        a_side, here = self._links["test"]
        _ip("link", "add", here, "type", "veth", "peer", "name", a_side)
        self._made.append(here)
        _ip("link", "set", a_side, "netns", self.ns["a"])
        _ip("-n", self.ns["a"], "addr", "add", f"{self._test_pair[0]}/30", "dev", a_side)
        _ip("-n", self.ns["a"], "link", "set", a_side, "up")
        _ip("addr", "add", f"{self._test_pair[1]}/30", "dev", here)
        _ip("link", "set", here, "up")

    def start_redis(self) -> None:
        directory = self.root / "redis"
        directory.mkdir(parents=True, exist_ok=True)
        log = (directory / "redis.log").open("a")
        self.redis = subprocess.Popen(
            [
                *self.prefix("a"),
                "redis-server",
                "--bind",
                self.address["a"],
                self._test_pair[0],
                "127.0.0.1",
                "--port",
                str(REDIS_PORT),
                "--dir",
                str(directory),
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._redis_answers():  # poll with a deadline
            if self.redis.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"redis-server did not start: {(directory / 'redis.log').read_text()[-2000:]}"
                )
            time.sleep(0.05)

    def _redis_answers(self) -> bool:
        import socket

        try:
            with socket.create_connection((self._test_pair[0], REDIS_PORT), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    # ------------------------------------------------------------------ use

    @property
    def url(self) -> str:
        """Redis as the workers on either host reach it (over the a-b link)."""
        return f"redis://{self.address['a']}:{REDIS_PORT}/0"

    @property
    def test_url(self) -> str:
        """Redis as this test process reaches it (over its own link to host a)."""
        return f"redis://{self._test_pair[0]}:{REDIS_PORT}/0"

    def prefix(self, host: str) -> list[str]:
        """argv prefix that runs a command on ``host``: its network namespace, and a mount namespace where
        the other hosts' private directories are empty."""
        hide = " && ".join(f"mount -t tmpfs rollstream-hidden {self.private[h]}" for h in HOSTS if h != host)
        return ["ip", "netns", "exec", self.ns[host], "sh", "-c", f'{hide} && exec "$@"', "sh"]

    def workers_on(self, host: str, config: str, settings: list[str]) -> Workers:
        """A ``Workers`` (tests/procs.py) whose processes run on ``host``."""
        workers = Workers(config, settings, self.root / f"logs-{host}")
        workers.command = [*self.prefix(host), sys.executable, "-m", "rollstream.cli", "worker"]
        self.workers[host] = workers
        return workers

    def link_end(self, host: str) -> str:
        """``host``'s end of the a-b link (its network card towards the other host)."""
        return self._links["ab"][HOSTS.index(host)]

    def tx_bytes(self, host: str) -> int:
        """Bytes ``host`` has sent on the a-b link so far (its veth's counter, read inside its namespace)."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.ns[host], "cat", f"/sys/class/net/{self.link_end(host)}/statistics/tx_bytes"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        return int(done.stdout)

    def limit_rate(self, host: str, rate: str = "1gbit") -> None:
        """Shape what ``host`` sends on the a-b link to ``rate`` (a token bucket, ``tc qdisc ... tbf``): the
        model of a network card of that speed."""
        if shutil.which("tc") is None:
            raise RuntimeError("no `tc` command: apt-get install -y iproute2")
        done = subprocess.run(
            ["tc", "-n", self.ns[host], "qdisc", "replace", "dev", self.link_end(host), "root", "tbf", "rate", rate,
             "burst", "256kb", "latency", "50ms"],
            capture_output=True, text=True, timeout=30, check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"tc qdisc tbf on {self.link_end(host)}: {done.stderr.strip()}")

    @contextlib.contextmanager
    def inside(self, host: str) -> Iterator[None]:
        """Run the calling thread in ``host``'s network namespace for the block (setns(2), per thread):
        processes and threads started inside it live there; sockets made inside it stay there."""
        with open(f"/var/run/netns/{self.ns[host]}") as target, open("/proc/thread-self/ns/net") as home:
            _setns(target.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        for workers in self.workers.values():
            for worker in workers.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(worker.process.pid, signal.SIGKILL)
        if self.redis is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.redis.pid, signal.SIGKILL)
            self.redis.wait(timeout=30)
        for ns in self._made:
            if not ns.startswith("rs") or ns not in self.ns.values():
                continue
            # Anything still inside (a process that left its group): by PID, then the namespace.
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout
            for pid in pids.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", ns)
        here = self._links["test"][1]
        with contextlib.suppress(RuntimeError):  # gone already with its peer in host a's namespace
            _ip("link", "del", here)


def _made_hosts(tmp_path: Path, redis: bool) -> Iterator[TwoHosts]:
    reason = why_not()
    if reason is not None:
        pytest.skip(f"two-host tests need network namespaces: {reason}")
    hosts = TwoHosts(tmp_path)
    try:
        hosts.create()
        if redis:
            hosts.start_redis()
        yield hosts
    finally:
        hosts.teardown()


@pytest.fixture(name="two_hosts")
def two_hosts_fixture(tmp_path) -> Iterator[TwoHosts]:
    yield from _made_hosts(tmp_path, redis=True)


@pytest.fixture(name="two_namespaces")
def two_namespaces_fixture(tmp_path) -> Iterator[TwoHosts]:
    """The two hosts' namespaces and their link, without a redis-server (tests that move bytes only)."""
    yield from _made_hosts(tmp_path, redis=False)
