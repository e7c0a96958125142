"""A Redis Sentinel set on loopback for the failover tests: a primary (ops/redis.conf), replicas
(ops/sentinel/replica.conf) and sentinels (ops/sentinel/sentinel.conf), each a real process on a free port
with a copy of its config in a tmp dir (Sentinel rewrites the configs on a failover), stopped by PID."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import redis
from procs import ROOT, free_port, start_redis_server

MASTER = "rollstream"  # the name ops/sentinel/sentinel.conf monitors


def client(port: int, **options) -> redis.Redis:
    """``options``: TLS and credentials for a node that wants them (ssl=True, ssl_ca_certs=..., username=...)."""
    return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True, **options)


def answers(port: int, **options) -> bool:
    try:
        with client(port, **options) as c:
            return bool(c.ping())
    except redis.RedisError:
        return False


class Node:
    """One redis-server (data node or sentinel) on its own port, dir and config copy."""

    def __init__(self, directory: Path, conf: str, port: int, *args: str, client_options: dict | None = None) -> None:
        self.directory, self.conf, self.port, self.args = directory, conf, port, args
        self.client_options = client_options or {}  # how to PING it (TLS, a user)
        self.port_flag = "--tls-port" if self.client_options.get("ssl") else "--port"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "node.conf"
        conf.write_text(self.conf)
        self.process = start_redis_server(
            [str(conf), *self.args, self.port_flag, str(self.port)], self.directory, self.directory / "node.log",
            lambda: answers(self.port, **self.client_options), timeout_s,
        )

    def log(self) -> str:
        path = self.directory / "node.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)


class SentinelSet:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels (quorum 2), failing over after
    ``down_after_ms`` of silence. ``url`` is the redis+sentinel:// url the workers use."""

    def __init__(self, directory: Path, replicas: int = 2, sentinels: int = 3, down_after_ms: int = 1000) -> None:
        ops = ROOT / "ops"
        self.primary = Node(directory / "primary", (ops / "redis.conf").read_text(), free_port())
        replica_conf = (ops / "sentinel" / "replica.conf").read_text()
        self.replicas = [
            Node(directory / f"replica{i}", replica_conf, free_port(), "--replicaof", "127.0.0.1",
                 str(self.primary.port))
            for i in range(replicas)
        ]
        template = (ops / "sentinel" / "sentinel.conf").read_text()
        template = re.sub(r"(?m)^sentinel monitor (\S+) \S+ \d+ (\d+)$",
                          rf"sentinel monitor \1 127.0.0.1 {self.primary.port} \2", template)
        template = re.sub(r"(?m)^sentinel down-after-milliseconds (\S+) \d+$",
                          rf"sentinel down-after-milliseconds \1 {down_after_ms}", template)
        template = re.sub(r"(?m)^sentinel failover-timeout (\S+) \d+$", r"sentinel failover-timeout \1 10000", template)
        assert f"127.0.0.1 {self.primary.port} 2" in template and f" {down_after_ms}" in template, template
        self.sentinels = [Node(directory / f"sentinel{i}", template, free_port(), "--sentinel") for i in range(sentinels)]

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels) + f"/{MASTER}/0"

    def nodes(self) -> list[Node]:
        return [self.primary, *self.replicas, *self.sentinels]

    def start(self, timeout_s: float = 30.0) -> None:
        for node in self.nodes():
            node.start()
        # Ready: the replicas in sync, and every sentinel knows the replicas and the other sentinels (hello
        # messages every 2 s), without which there is no quorum to fail over.
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel set did not form:\n" + self.sentinels[0].log())
            time.sleep(0.1)

    def ready(self) -> bool:
        with client(self.primary.port) as c:
            info = c.info("replication")
        online = [v for k, v in info.items() if k.startswith("slave") and v.get("state") == "online"]
        if len(online) != len(self.replicas):
            return False
        for sentinel in self.sentinels:
            with client(sentinel.port) as c:
                master = c.execute_command("SENTINEL", "MASTER", MASTER)
            if int(master["num-slaves"]) != len(self.replicas):
                return False
            if int(master["num-other-sentinels"]) != len(self.sentinels) - 1:
                return False
        return True

    def replicated(self) -> bool:
        """Every replica has applied all the primary wrote so far: a failover now loses nothing
        (SENTINEL FAILOVER promotes a replica without waiting for it to catch up)."""
        with client(self.primary.port) as c:
            offset = c.info("replication")["master_repl_offset"]
        for replica in self.replicas:
            with client(replica.port) as c:
                if c.info("replication").get("slave_repl_offset", -1) < offset:
                    return False
        return True

    def primary_port(self) -> int | None:
        """The port every sentinel names as primary, once they agree and it answers as one; else None."""
        ports = set()
        try:
            for sentinel in self.sentinels:
                with client(sentinel.port) as c:
                    ports.add(int(c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)[1]))
            if len(ports) != 1:
                return None
            port = ports.pop()
            with client(port) as c:
                return port if c.info("replication")["role"] == "master" else None
        except redis.RedisError:
            return None

    def stop(self) -> None:
        for node in self.nodes():
            node.kill()
