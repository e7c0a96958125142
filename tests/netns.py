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
import json
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
from procs import Workers, rollstream_cli

from pipeline.records import WeightsPublished, trajectories_in
from pipeline.run_dir import edge_tail
from pipeline.transport import connect
from stages import TRAJECTORIES, WEIGHTS

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
    """A third octet X such that 10.213.X.0/29 is on no interface of this namespace (the test's link). Each
    pytest-xdist worker draws from its own residue class, so two workers making hosts at once never pick
    the same X between one's look and its ``ip addr add``."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    candidates = range(worker % workers, 256, workers)
    for x in random.sample(candidates, len(candidates)):
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
        self._proxies: list[subprocess.Popen] = []  # delay forwarders (``delay``)
        self.workers: dict[str, Workers] = {}
        self._made: list[str] = []
        self._faults: list[tuple[str, list[str]]] = []  # (host, match) of the drop rules in place

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

    def delay(self, host: str, delay_ms: float, port: int = 16379) -> str:
        """Redis as ``host``'s workers reach it through a forwarder on its loopback that holds every chunk
        ``delay_ms`` each way (tests/delay_proxy.py; this kernel has no netem); returns that url. The forwarder
        runs in ``host``'s namespace and dies with the teardown."""
        proxy = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[host], sys.executable, str(Path(__file__).with_name("delay_proxy.py")),
             str(port), self.address["a"], str(REDIS_PORT), f"{delay_ms:g}"],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        self._proxies.append(proxy)
        if proxy.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the delay forwarder on host {host} did not start (exit {proxy.wait(timeout=10)})")
        return f"redis://127.0.0.1:{port}/0"

    # ------------------------------------------------------------------ faults (iptables inside a host)

    def _iptables(self, host: str, *args: str) -> None:
        if shutil.which("iptables") is None:
            raise RuntimeError("no `iptables` command: apt-get install -y iptables")
        done = subprocess.run(["ip", "netns", "exec", self.ns[host], "iptables", "-w", *args],
                              capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"iptables {' '.join(args)} on host {host}: {done.stderr.strip()}")

    def _drop_rules(self, host: str, extra: list[str]) -> list[list[str]]:
        end = self.link_end(host)
        return [["INPUT", "-i", end, *extra, "-j", "DROP"], ["OUTPUT", "-o", end, *extra, "-j", "DROP"]]

    def cut_off(self, host: str) -> None:
        """Drop every packet ``host`` sends or receives on the a-b link, silently (a partition: no RST, no
        ICMP, so a peer's TCP connection hangs until a timeout, as when a switch or a cable fails)."""
        for rule in self._drop_rules(host, []):
            self._iptables(host, "-I", *rule)
        self._faults.append((host, []))

    def lose(self, host: str, probability: float) -> None:
        """Drop each packet ``host`` sends or receives on the a-b link with ``probability`` (both ways)."""
        extra = ["-m", "statistic", "--mode", "random", "--probability", f"{probability:g}"]
        for rule in self._drop_rules(host, extra):
            self._iptables(host, "-I", *rule)
        self._faults.append((host, extra))

    def heal(self) -> None:
        """Remove every fault ``cut_off`` and ``lose`` put in (the link works as before)."""
        while self._faults:
            host, extra = self._faults.pop()
            for rule in self._drop_rules(host, extra):
                self._iptables(host, "-D", *rule)

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
        with contextlib.suppress(RuntimeError):  # the namespaces take their rules along anyway
            self.heal()
        for proxy in self._proxies:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proxy.pid, signal.SIGKILL)
            proxy.wait(timeout=30)
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


# ------------------------------------------------------------------------------------------------------
# A run split over the two hosts (tests/test_two_hosts.py, tests/test_partitions.py).

CONFIG = "configs/demo-redis.toml"
STEPS = 8  # 4 generation batches of 2 groups x 8 completions, 2 optimizer steps each


def run_settings(run: str, hosts: TwoHosts, host: str, *extra: str) -> list[str]:
    return [
        f"run.name={run}",
        f"run.output_dir={json.dumps(str(hosts.private[host] / 'out'))}",
        "run.metrics_port=0",
        "run.ledger=true",
        "run.log_level=warning",
        f"run.max_steps={STEPS}",
        "grpo.num_generations=8",
        "grpo.generation_batch_size=16",
        "grpo.per_device_train_batch_size=8",
        "rollout.max_model_len=256",
        "rollout.engine_threads=1",
        f"transport.url={hosts.url}",
        "transport.min_idle_ms=3000",
        *extra,
    ]


SPLIT = (("a", "learner", 0), ("a", "advantage", 0), ("b", "rollout", 0), ("b", "reward", 0), ("a", "feeder", 0))
"""(host, stage, index) of each worker, in start order: the learner side on a, the rollout side on b."""


async def start_split(hosts: TwoHosts, run: str, *extra: str,
                      placement: tuple[tuple[str, str, int], ...] = SPLIT,
                      on_host: dict[str, tuple[str, ...]] | None = None) -> tuple[Workers, Workers]:
    """The workers of one run on the two hosts, as ``placement`` says (by default ``SPLIT``); ``on_host``:
    settings for one host's workers only."""
    on_host = on_host or {}
    a = hosts.workers_on("a", CONFIG, run_settings(run, hosts, "a", *extra, *on_host.get("a", ())))
    b = hosts.workers_on("b", CONFIG, run_settings(run, hosts, "b", *extra, *on_host.get("b", ())))
    for host, stage, index in placement:
        await {"a": a, "b": b}[host].start(stage, index)
    return a, b


async def finish(hosts: dict[str, Workers], deadline: float, learner_host: str = "a") -> None:
    """The learner (on ``learner_host``) ends the run; every other worker drains on the final weights and
    exits 0."""
    names = [
        (learner_host, "learner-0"),
        *sorted((h, n) for h, w in hosts.items() for n in w.running if n != "learner-0"),
    ]
    for host, name in names:
        workers = hosts[host]
        for other_host, other in hosts.items():  # a worker that failed on its own: its log, not a timeout
            failed = other.failed()
            assert not failed, f"{failed[0]} on host {other_host} failed:\n{other.log(failed[0])}"
        try:
            code = await workers.wait(name, max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            pytest.fail(
                f"{name} on host {host} did not finish:\n{workers.log(name)}\nlearner:\n{hosts[learner_host].log('learner-0')}"
            )
        assert code == 0, f"{name} on host {host} exited {code}:\n{workers.log(name)}"


async def check_clean_run(hosts: TwoHosts, run: str, steps: int = STEPS, restarted_learner: bool = False,
                          via: str = "broadcast", learner_host: str = "a") -> None:
    """The ledger is clean; every trajectory saw one version; the engine's log-probs after every sync equal
    the learner's (TRL's sampling/sampling_logp_difference, over tokens sampled with the learner's weights).
    ``restarted_learner``: the resumed learner numbered its versions after its predecessor's (no number
    names two different weights), so the versions are not 0..n-1 but never repeat."""
    code, report = await rollstream_cli("ledger", "check", "--redis", hosts.test_url, "--run", run)
    assert code == 0, report
    transport = await connect("redis", run=run, url=hosts.test_url)
    try:
        trajectories = trajectories_in(await edge_tail(transport, TRAJECTORIES, None))
        published = [e for e in await edge_tail(transport, WEIGHTS, None) if isinstance(e, WeightsPublished)]
    finally:
        await transport.close()
    assert trajectories
    mixed = [t.request_id for t in trajectories if t.policy_version != t.max_policy_version]
    assert not mixed, f"sampled with more than one weights version: {mixed[:5]}"
    out = hosts.private[learner_host] / "out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # A row's policy_version is the learner's version after its step: its samples were drawn with the version
    # before. From version 2 on, that is weights the engine received from the learner (the sync checked
    # here, to the mean); the first generation batch's were drawn with the weights both loaded from disk
    # (checked to the worst token only: its mean once came out at 1.6e-5 in CI, unexplained; see CHANGELOG).
    worst, mean = LOGP_TOLERANCE[via]
    diffs = [(r["step"], r["policy_version"], r["sampling/sampling_logp_difference/max"],
              r["sampling/sampling_logp_difference/mean"]) for r in rows]
    synced = [d for d in diffs if d[1] >= 2]
    assert synced
    assert max(d[2] for d in diffs) < worst, f"(step, version, max, mean) over {worst}: {diffs}"
    assert max(d[3] for d in synced) < mean, f"(step, version, max, mean) over {mean}: {diffs}"
    versions = [r["policy_version"] for r in rows]
    assert versions == sorted(versions), "a version number came back"
    # A produce whose reply a cut or a failover lost is sent again (at least once: pipeline/transport/redis.py),
    # so one announcement may be stored twice, byte for byte; a version number naming two records is a reuse.
    named: dict[int, set[WeightsPublished]] = {}
    for record in published:
        named.setdefault(record.version, set()).add(record)
    assert all(len(records) == 1 for records in named.values()), f"a version names two announcements: {named}"
    announced = list(named)
    assert announced == sorted(announced), f"a version announced after a later one: {announced}"
    if restarted_learner:
        # The resumed learner's versions start where version - batches trained first jumps (numbered after
        # every version its predecessor issued). A version of the killed learner may have reached the engines
        # by broadcast and been sampled with, its announcement never sent (the kill came between the two);
        # every version from the resumed learner's first on was announced.
        restored = min((r.version for r in published if r.version != r.batches_trained), default=None)
        assert restored is not None, f"no renumbered version after the restart: {announced}"
        unannounced = {t.policy_version for t in trajectories} - {0, *announced}
        assert all(v < restored for v in unannounced), f"sampled with {unannounced}, never announced: {announced}"
        return
    # Every generation batch sampled with the version trained on the one before (max_staleness 0): each
    # version reached the rollout host over the group.
    assert sorted({t.policy_version for t in trajectories}) == list(range(steps // 2))
    if via == "broadcast":
        assert not (out / "weights").exists()  # no snapshot: every version went over the group


# Max and mean per-token |sampling - learner| log-prob difference. vLLM's LoRA path computes in another
# order than peft's: the same LoRA run on one host, adapters from files, measured max 5.6e-3, mean 2e-4 to
# 8e-4 per step; across the two hosts max 1.4e-2, mean 7e-4 to 1.5e-3 (another split of the data).
LOGP_TOLERANCE = {"broadcast": (1e-4, 1e-5), "lora": (5e-2, 5e-3)}
BROADCAST = ("rollout.weight_transport=broadcast", "grpo.max_staleness=0", "rollout.weight_sync_timeout_s=20")


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
