"""Redis Sentinel: ``redis+sentinel://`` urls, the transport contract through a Sentinel set on loopback
(a primary, two replicas, three sentinels: tests/sentinels.py, ops/sentinel/), and a SIGKILL of the primary
under a live producer and consumer with ``min_replicas_acked = 1``: the transport follows the promoted
replica and every acknowledged record is there. The pipeline's failover case is tests/test_failover.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from contextlib import contextmanager

import pytest
import redis
from polling import wait_until
from procs import ROOT, free_port, rollstream_cli
from sentinels import Node, SentinelSet, client
from test_transport_contract import (  # noqa: F401  (the contract's tests, run here over a sentinel url)
    Opener,
    test_ack_appends_outputs_and_acks_inputs_together,
    test_dead_letter_moves_one_entry_with_its_error_and_origin,
    test_leases_renew_release_and_expire,
    test_produce_consume_ack,
    test_stats_length_pending_lag_and_oldest,
    test_touch_keeps_a_live_holder_from_being_reclaimed,
    test_unacked_entries_are_reclaimed_after_min_idle,
)

from config import ConfigError, config_from_dict
from pipeline.transport import TransportError, connect
from pipeline.transport.redis import RedisTransport
from pipeline.transport.urls import parse_sentinel_url, redact

pytestmark = pytest.mark.contract


# ---------------------------------------------------------------- the url (pure)


def test_sentinel_url_names_the_sentinels_the_master_and_the_db():
    address = parse_sentinel_url("rediss+sentinel://app:s%40cret@h1:26379,h2,[::1]:26380/rollstream/3?ssl_ca_certs=/ca.pem")
    assert address.sentinels == [("h1", 26379), ("h2", 26379), ("::1", 26380)]
    assert (address.master, address.db) == ("rollstream", 3)
    assert address.data_url == "rediss://app:s%40cret@h1:26379/3?ssl_ca_certs=/ca.pem"
    assert parse_sentinel_url("redis+sentinel://h1/m").db == 0


@pytest.mark.parametrize(
    "url, says",
    [
        ("redis+sentinel://h1:26379", "no master name"),
        ("redis+sentinel://h1:26379/", "no master name"),
        ("redis+sentinel://h1:port/m", "port that is no number"),
        ("redis+sentinel://h1,,h2/m", "empty sentinel address"),
        ("redis+sentinel://h1/m/zero", "/<master name>/<db number>"),
    ],
)
def test_a_malformed_sentinel_url_is_a_config_error_naming_the_field_and_the_form(url, says):
    with pytest.raises(ConfigError) as error:
        config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "transport": {"kind": "redis", "url": url}})
    assert says in str(error.value) and "transport.url=" in str(error.value)
    assert "redis+sentinel://[user:password@]host1:26379,host2:26379/<master name>/<db>" in str(error.value)


def test_redact_hides_the_password_of_a_sentinel_url():
    assert redact("redis+sentinel://app:hunter2@h1:26379,h2:26379/m/0") == "redis+sentinel://app:***@h1:26379,h2:26379/m/0"
    with pytest.raises(ConfigError) as error:
        config_from_dict({"transport": {"url": "redis+sentinel://app:hunter2@h1:x/m"}})
    assert "hunter2" not in str(error.value)


async def test_no_sentinel_answering_is_one_clear_line():
    with pytest.raises(TransportError) as error:
        await connect("redis", run="x", url="redis+sentinel://app:hunter2@127.0.0.1:1/rollstream/0", connect_timeout=0.5)
    message = str(error.value)
    assert "hunter2" not in message and "app:***@" in message
    assert "sentinels run at 127.0.0.1:1" in message and "'rollstream'" in message


# ---------------------------------------------------------------- the contract, through Sentinel


@pytest.fixture(scope="module")
def sentinel_set(tmp_path_factory):
    cluster = SentinelSet(tmp_path_factory.mktemp("sentinel"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


class _WaitingOpener(Opener):
    """Every transport waits for one replica (WAIT) on its writes, as the Sentinel setup recommends."""

    async def __call__(self, **options):
        return await super().__call__(**{"min_replicas_acked": 1, **options})


@pytest.fixture
async def open_transport(sentinel_set):
    opener = _WaitingOpener("redis", sentinel_set.url)
    yield opener
    await opener.cleanup()


@pytest.fixture
async def transport(open_transport):
    return await open_transport()


# ---------------------------------------------------------------- failover under load

RECORDS = 400
BATCH = 10
KILL_AFTER = 150  # records acknowledged before the primary dies


async def test_a_sigkilled_primary_is_followed_and_no_acknowledged_record_is_lost(tmp_path):
    """A producer and a consumer (ack with an output per input) run while the primary is SIGKILLed (the
    producer holds at KILL_AFTER until it is, so the rest of its records must follow the failover); the
    sentinels promote a replica, both calls follow it, and with WAIT for one replica every record the
    producer was told is stored, and every ack with its output, is on the new primary: exact counts."""
    cluster = SentinelSet(tmp_path / "sentinel", down_after_ms=1000)
    cluster.start()
    run = f"failover-{uuid.uuid4().hex[:6]}"
    transport = await connect("redis", run=run, url=cluster.url, min_replicas_acked=1, reconnect_s=60)
    assert isinstance(transport, RedisTransport)
    produced: set[str] = set()  # payloads produce() returned for: acknowledged
    processed: set[str] = set()  # inputs acked together with their output
    killed_at = recovered_at = None
    killed = asyncio.Event()
    try:
        await transport.consume("prompts", "worker", "c", 1, 0)  # the group, before anything is produced

        async def producer() -> None:
            nonlocal recovered_at
            for start in range(0, RECORDS, BATCH):
                batch = [f"r{i}" for i in range(start, start + BATCH)]
                await transport.produce("prompts", [p.encode() for p in batch])
                if killed_at is not None and recovered_at is None:
                    recovered_at = time.monotonic()
                produced.update(batch)
                if len(produced) >= KILL_AFTER:
                    # A batch takes about a millisecond: unheld, the producer could be done before the kill.
                    await killed.wait()

        async def consumer() -> None:
            while len(processed) < RECORDS:
                deliveries = await transport.consume("prompts", "worker", "c", BATCH, 200)
                # Entries delivered by the old primary and never acked stay pending on "c": take them back.
                deliveries += await transport.reclaim("prompts", "worker", "c", 500, BATCH)
                if not deliveries:
                    continue
                outputs = [b"out-" + d.payload for d in deliveries]
                await transport.ack("prompts", "worker", [d.id for d in deliveries], {"scored": outputs})
                processed.update(d.payload.decode() for d in deliveries)  # idempotent on the record

        async def chaos() -> None:
            nonlocal killed_at
            await wait_until(lambda: len(produced) >= KILL_AFTER, "records before the kill", timeout_s=60)
            old = cluster.primary.port
            cluster.primary.kill()
            killed_at = time.monotonic()
            killed.set()
            await wait_until(lambda: cluster.primary_port() not in (None, old), "a promoted replica", timeout_s=60)

        await asyncio.wait_for(asyncio.gather(producer(), consumer(), chaos()), 120)
        promoted = cluster.primary_port()
        assert promoted != cluster.primary.port and promoted in {r.port for r in cluster.replicas}

        # Read the new primary directly: what is stored there, not what this client remembers.
        direct = await connect("redis", run=run, url=f"redis://127.0.0.1:{promoted}/0")
        try:
            stored = [d.payload.decode() for d in await direct.read("prompts", "0", 10 * RECORDS, 0)]
            outputs = [d.payload.decode() for d in await direct.read("scored", "0", 10 * RECORDS, 0)]
            stats = await direct.stats("prompts", "worker")
        finally:
            await direct.close()
        assert set(stored) == produced == {f"r{i}" for i in range(RECORDS)}
        assert {o.removeprefix("out-") for o in outputs} == processed == produced
        assert stats.pending == 0 and stats.lag == 0
        figures = {
            "records": RECORDS,
            "stored_entries": len(stored),  # over RECORDS: a retried produce whose reply the kill lost
            "output_entries": len(outputs),
            "recovered_s": round(recovered_at - killed_at, 2),
            "outages": transport.outages,
            "reconnects": transport.reconnects,
            "replica_waits_short": transport.replica_waits_short,
        }
        print("FAILOVER " + json.dumps(figures))
        assert transport.reconnects >= 1
    finally:
        await transport.close()
        cluster.stop()


async def test_a_manual_failover_demotes_the_primary_and_its_readonly_replies_send_writes_to_the_new_one(tmp_path):
    """SENTINEL FAILOVER keeps the old primary alive as a replica: connections to it get READONLY, which
    must count as a lost connection (not an error of the call), and every write lands on the new primary."""
    cluster = SentinelSet(tmp_path / "sentinel", replicas=1)
    cluster.start()
    transport = await connect("redis", run="demoted", url=cluster.url, reconnect_s=60)
    try:
        await transport.produce("prompts", [b"before"])
        # Written without min_replicas_acked: only a replica that already holds it keeps it past the failover.
        await wait_until(cluster.replicated, "the replica caught up")
        old = cluster.primary.port
        with sentinels_client(cluster) as sentinel:
            assert sentinel.execute_command("SENTINEL", "FAILOVER", "rollstream")
        await wait_until(lambda: cluster.primary_port() not in (None, old), "the replica promoted", timeout_s=60)
        with sentinels_client(cluster, port=old) as demoted:  # still up: now a replica of the new primary
            await wait_until(lambda: demoted.info("replication")["role"] == "slave", "the old primary demoted")
        for i in range(20):  # pooled connections still point at the demoted node: READONLY, then followed
            await transport.produce("prompts", [f"after-{i}".encode()])
        direct = await connect("redis", run="demoted", url=f"redis://127.0.0.1:{cluster.primary_port()}/0")
        try:
            stored = [d.payload for d in await direct.read("prompts", "0", 100, 0)]
        finally:
            await direct.close()
        assert set(stored) == {b"before", *(f"after-{i}".encode() for i in range(20))}
    finally:
        await transport.close()
        cluster.stop()


async def test_too_few_replicas_waits_again_without_writing_twice_then_fails_naming_the_setting(redis_url):
    """A lone redis-server has no replica: WAIT 1 never succeeds. The record is written once, WAIT repeated
    until reconnect_s, then one TransportError that names transport.min_replicas_acked."""
    run = f"nowait-{uuid.uuid4().hex[:6]}"
    transport = await connect("redis", run=run, url=redis_url, min_replicas_acked=1, replica_wait_ms=100, reconnect_s=0.5)
    assert isinstance(transport, RedisTransport)
    try:
        with pytest.raises(TransportError) as error:
            await transport.produce("prompts", [b"once"])
        assert "only 0 of transport.min_replicas_acked=1 replicas" in str(error.value)
        assert transport.replica_waits_short >= 3  # 0.5 s of 0.1 s waits
        assert (await transport.stats("prompts")).length == 1  # written once, waited on repeatedly
    finally:
        await transport.delete_run()
        await transport.close()


@contextmanager
def sentinels_client(cluster: SentinelSet, port: int | None = None):
    client = redis.Redis(port=port or cluster.sentinels[0].port, socket_timeout=2, decode_responses=True)
    try:
        yield client
    finally:
        client.close()


async def test_rollstream_reset_and_ledger_check_go_through_the_sentinel_url(sentinel_set):
    run = f"cli-{uuid.uuid4().hex[:6]}"
    transport = await connect("redis", run=run, url=sentinel_set.url)
    try:
        await transport.produce("prompts", [b"a"])
        await transport.produce("trajectories", [b"b"])
        code, out = await rollstream_cli(
            "reset", "-c", "configs/demo-redis.toml", "--set", f"run.name={run}", "--set", f"transport.url={sentinel_set.url}"
        )
        assert code == 0 and f"run {run!r}: removed 2 streams" in out, out
        assert (await transport.stats("prompts")).length == 0
        code, out = await rollstream_cli("ledger", "check", "--redis", sentinel_set.url, "--run", run)
        assert code == 1 and "no ledger entries for this run" in out, out  # reached the run's (empty) streams
    finally:
        await transport.close()


async def test_rediss_sentinel_with_the_acl_user_and_wait(tmp_path):
    """TLS everywhere (primary, replica, sentinel: ``tls-replication``), the data nodes under ops/redis-acl.conf's
    user (so its command list must hold what Sentinel mode and WAIT send), the sentinel asked without AUTH."""
    from test_security_redis import ACL_FILE, make_certificates

    ca, cert, key = make_certificates(tmp_path)
    secret = {name: f"{name}-{uuid.uuid4().hex}" for name in ("rollstream", "replica", "sentinel", "admin")}
    tls = (f"port 0\ntls-cert-file {cert}\ntls-key-file {key}\ntls-ca-cert-file {ca}\n"
           "tls-auth-clients no\ntls-replication yes\n")
    users = (
        ACL_FILE.read_text().replace(">CHANGE-ME", f">{secret['rollstream']}")
        + f"user replica on >{secret['replica']} +psync +replconf +ping\n"
        + f"user sentinel on >{secret['sentinel']} allchannels +multi +slaveof +ping +exec +subscribe "
        "+config|rewrite +role +publish +info +client|setname +client|kill +script|kill\n"
        + f"user admin on >{secret['admin']} ~* &* +@all\n"
    )
    admin = {"ssl": True, "ssl_ca_certs": str(ca), "username": "admin", "password": secret["admin"]}
    ops = ROOT / "ops"
    primary = Node(tmp_path / "primary", (ops / "redis.conf").read_text() + tls + users, free_port(),
                   client_options=admin)
    replica = Node(
        tmp_path / "replica",
        (ops / "sentinel" / "replica.conf").read_text() + tls + users
        + f"masteruser replica\nmasterauth {secret['replica']}\n",
        free_port(), "--replicaof", "127.0.0.1", str(primary.port), client_options=admin,
    )
    sentinel_conf = re.sub(
        r"(?m)^sentinel monitor (\S+) \S+ \d+ \d+$", rf"sentinel monitor \1 127.0.0.1 {primary.port} 1",
        (ops / "sentinel" / "sentinel.conf").read_text(),
    ) + tls + f"sentinel auth-user rollstream sentinel\nsentinel auth-pass rollstream {secret['sentinel']}\n"
    sentinel = Node(tmp_path / "sentinel", sentinel_conf, free_port(), "--sentinel",
                    client_options={"ssl": True, "ssl_ca_certs": str(ca)})
    nodes = [primary, replica, sentinel]
    try:
        for node in nodes:
            node.start()

        def formed() -> bool:
            with client(primary.port, **admin) as c:
                if c.info("replication").get("slave0", {}).get("state") != "online":
                    return False
            with client(sentinel.port, ssl=True, ssl_ca_certs=str(ca)) as c:
                return int(c.execute_command("SENTINEL", "MASTER", "rollstream")["num-slaves"]) == 1

        await wait_until(formed, "the replica in sync and known to the sentinel", timeout_s=30)
        url = (f"rediss+sentinel://rollstream:{secret['rollstream']}@127.0.0.1:{sentinel.port}/rollstream/0"
               f"?ssl_ca_certs={ca}")
        transport = await connect("redis", run="tls", url=url, min_replicas_acked=1)
        try:
            await transport.produce("prompts", [b"a", b"b"])
            deliveries = await transport.consume("prompts", "rollout", "w", 10, 0)
            await transport.touch("prompts", "rollout", "w", [d.id for d in deliveries])
            await transport.ack("prompts", "rollout", [d.id for d in deliveries], {"trajectories": [b"c"]})
            await transport.lease("weights", "w", 3, 10_000)
            assert await transport.leases("weights") == {"w": 3}
            assert (await transport.stats("prompts", "rollout")).pending == 0
            assert (await transport.stats("trajectories")).length == 1
            assert secret["rollstream"] not in transport.url  # redacted
        finally:
            await transport.close()
    finally:
        for node in nodes:
            node.kill()
