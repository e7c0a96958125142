"""One Redis hop (produce -> consume -> ack) against the raw ceiling, measured in the same run.

- ``raw``: pipelined XADD of the same bytes with redis-py, nothing else: what the server and client
  can move at all.
- ``hop``: ``RedisTransport`` with one producer (batched produce) and one consumer group member
  (batched consume + ack) running together; records/s until the last record is acked.
- ``latency``: one record per produce at a paced, fixed offered load; produce -> received by the
  (blocking) consumer, p50/p99.

Records are realistic ~1 KB ``Trajectory``s (packed token ids and logprobs). Prints JSON; writes it too
with ``--json-out`` (e.g. bench/results/transport.json). Needs redis-server at ``--url``.

    .venv/bin/python bench/transport.py [--records 20000] [--batch 256] [--json-out bench/results/transport.json]

``--replica``: the cost of ``transport.min_replicas_acked = 1`` (WAIT for a replica after every produce
and ack). The bench starts its own primary (ops/redis.conf) and replica (ops/sentinel/replica.conf) on
loopback ports in a temp dir and runs ``hop`` and ``latency`` with and without WAIT on that pair,
interleaved; ``ratio_wait_vs_none`` is the hop records/s with WAIT over without.

    .venv/bin/python bench/transport.py --replica --records 5000 --json-out bench/results/transport_wait.json
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_json import emit
from pipeline.records import Trajectory, encode, pack_f32, pack_i32
from pipeline.transport import DEFAULT_REDIS_URL, connect
from pipeline.transport.redis import FIELD, RedisTransport

EDGE, GROUP = "trajectories", "reward"


def payload(i: int) -> bytes:
    """A ~1 KB trajectory: 40 prompt tokens, 80 completion tokens with their logprobs."""
    return encode(
        Trajectory(
            prompt_id=f"e0:{i}",
            attempt=0,
            request_id=f"e0:{i}/0/0",
            generation_batch=i // 64,
            prompt_ids=pack_i32(range(1000 + i % 97, 1040 + i % 97)),
            completion_ids=pack_i32([(i * 31 + t) % 32000 for t in range(80)]),
            logprobs=pack_f32([-0.01 * (t % 50) for t in range(80)]),
            messages=[{"role": "user", "content": "What is 17 + 25?"}],
            completion="17 + 25 = 42",
            policy_version=3,
            max_policy_version=3,
        )
    )


async def raw_ceiling(transport: RedisTransport, payloads: list[bytes], batch: int) -> float:
    """records/s of pipelined XADD alone (the same client library, the same bytes, the same batches)."""
    client = transport._client  # the bench measures the library underneath on purpose
    key = transport.key("raw-ceiling")
    started = time.perf_counter()
    for start in range(0, len(payloads), batch):
        async with client.pipeline(transaction=False) as pipe:
            for data in payloads[start : start + batch]:
                pipe.xadd(key, {FIELD: data})
            await pipe.execute()
    elapsed = time.perf_counter() - started
    await client.delete(key)
    return len(payloads) / elapsed


async def one_hop(transport: RedisTransport, payloads: list[bytes], batch: int, edge: str) -> float:
    """records/s from the first produce to the last ack, producer and consumer running concurrently."""
    total = len(payloads)

    async def producer() -> None:
        for start in range(0, total, batch):
            await transport.produce(edge, payloads[start : start + batch])

    async def consumer() -> None:
        acked = 0
        while acked < total:
            deliveries = await transport.consume(edge, GROUP, "bench", batch, 1_000)
            await transport.ack(edge, GROUP, [d.id for d in deliveries])
            acked += len(deliveries)

    await transport.consume(edge, GROUP, "bench", 1, 0)  # create the group outside the timed part
    started = time.perf_counter()
    await asyncio.gather(producer(), consumer())
    return total / (time.perf_counter() - started)


async def hop_latency(transport: RedisTransport, rate: float, seconds: float, edge: str) -> dict[str, float]:
    """Produce one record at a time at ``rate``/s; latency from just before produce to its receipt."""
    count = int(rate * seconds)
    data = payload(0)
    sent_at: list[float] = []
    latencies: list[float] = []
    await transport.consume(edge, GROUP, "bench", 1, 0)

    async def producer() -> None:
        start = time.perf_counter()
        for i in range(count):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # pacing the offered load, not waiting for a result
            sent_at.append(time.perf_counter())
            await transport.produce(edge, [data])

    async def consumer() -> None:
        while len(latencies) < count:
            deliveries = await transport.consume(edge, GROUP, "bench", 500, 1_000)
            received = time.perf_counter()
            # One producer and one consumer: the n-th record received is the n-th sent.
            first = len(latencies)
            latencies.extend([received - sent_at[first + k] for k in range(len(deliveries))])
            await transport.ack(edge, GROUP, [d.id for d in deliveries])

    await asyncio.gather(producer(), consumer())
    ordered = sorted(latencies)
    return {
        "offered_rate": rate,
        "records": count,
        "p50_ms": round(1000 * ordered[len(ordered) // 2], 3),
        "p99_ms": round(1000 * ordered[int(len(ordered) * 0.99) - 1], 3),
        "max_ms": round(1000 * ordered[-1], 3),
        "mean_ms": round(1000 * statistics.fmean(ordered), 3),
    }


async def measure(args: argparse.Namespace) -> dict:
    # The default maxlen (10,000): producers trim acked entries during the hop runs, as in production.
    transport = await connect("redis", run=f"bench-{uuid.uuid4().hex[:8]}", url=args.url)
    assert isinstance(transport, RedisTransport)
    payloads = [payload(i) for i in range(args.records)]
    try:
        # Warm up connections, scripts and the server's allocator before anything is timed.
        warm = payloads[: min(2_000, len(payloads))]
        await raw_ceiling(transport, warm, args.batch)
        await one_hop(transport, warm, args.batch, "warmup")

        raw_rates, hop_rates = [], []
        for repeat in range(args.repeats):  # interleaved, so drift affects both alike
            raw_rates.append(await raw_ceiling(transport, payloads, args.batch))
            hop_rates.append(await one_hop(transport, payloads, args.batch, f"{EDGE}-{repeat}"))
        latency = await hop_latency(transport, args.rate, args.seconds, "latency")
    finally:
        await transport.delete_run()
        await transport.close()
    raw, hop = statistics.median(raw_rates), statistics.median(hop_rates)
    return {
        "bench": "transport",
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
        "record_bytes": round(statistics.fmean(len(p) for p in payloads)),
        "records": args.records,
        "batch": args.batch,
        "repeats": args.repeats,
        "raw_xadd_records_per_s": round(raw),
        "hop_records_per_s": round(hop),
        "ratio": round(hop / raw, 3),
        "latency": latency,
        "goals": {
            "ratio_at_least_0.30": hop / raw >= 0.30,
            "p99_below_5_ms": latency["p99_ms"] < 5.0,
        },
    }


SMALL_BATCH = 8


async def produce_call_ms(transport: RedisTransport, data: bytes, edge: str, calls: int = 300) -> dict[str, float]:
    """How long one produce() of one record takes, end to end (with WAIT: until a replica holds it)."""
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        await transport.produce(edge, [data])
        took.append(time.perf_counter() - started)
    took.sort()
    return {"p50_ms": round(1000 * took[len(took) // 2], 3), "p99_ms": round(1000 * took[int(len(took) * 0.99) - 1], 3)}


@contextmanager
def primary_and_replica():
    """A primary and one replica (the shipped configs) on free loopback ports; yields the primary's url."""
    root = Path(__file__).resolve().parents[1]
    processes = []
    with tempfile.TemporaryDirectory(prefix="bench-replica-") as scratch:
        try:
            primary = _free_port()
            for name, conf, extra in (
                ("primary", root / "ops" / "redis.conf", []),
                ("replica", root / "ops" / "sentinel" / "replica.conf", ["--replicaof", "127.0.0.1", str(primary)]),
            ):
                directory = Path(scratch) / name
                directory.mkdir()
                copy = directory / "node.conf"  # a replica's config may be rewritten: never the shipped file
                copy.write_text(conf.read_text())
                port = primary if name == "primary" else _free_port()
                processes.append(subprocess.Popen(
                    ["redis-server", str(copy), "--port", str(port), "--dir", str(directory), *extra],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                ))
            deadline = time.monotonic() + 20
            while b"state=online" not in _info_replication(primary):  # the replica in sync, with a deadline
                if time.monotonic() > deadline:
                    raise RuntimeError("the replica did not come online within 20 s")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{primary}/0"
        finally:
            for process in processes:
                process.kill()
                process.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _info_replication(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"INFO replication\r\n")
            time.sleep(0.01)  # the reply is a few hundred bytes; read what arrived
            return s.recv(65536)
    except OSError:
        return b""


async def measure_wait(args: argparse.Namespace) -> dict:
    """hop records/s and latency with and without WAIT for one replica, on one primary+replica pair."""
    payloads = [payload(i) for i in range(args.records)]
    with primary_and_replica() as url:
        run = f"bench-{uuid.uuid4().hex[:8]}"
        plain = await connect("redis", run=run, url=url)
        waiting = await connect("redis", run=run, url=url, min_replicas_acked=1)
        assert isinstance(plain, RedisTransport) and isinstance(waiting, RedisTransport)
        try:
            warm = payloads[: min(2_000, len(payloads))]
            await one_hop(plain, warm, args.batch, "warmup")
            await one_hop(waiting, warm, args.batch, "warmup-wait")
            rates: dict[str, list[float]] = {"none": [], "wait": []}
            for repeat in range(args.repeats):  # interleaved, so drift affects both alike
                rates["none"].append(await one_hop(plain, payloads, args.batch, f"{EDGE}-{repeat}"))
                rates["wait"].append(await one_hop(waiting, payloads, args.batch, f"{EDGE}-wait-{repeat}"))
            # Small batches (a worker acks what one handle call finished): the WAIT round trip is not amortized.
            small = payloads[: min(1_000, len(payloads))]
            small_rates = {
                "none": await one_hop(plain, small, SMALL_BATCH, "small"),
                "wait": await one_hop(waiting, small, SMALL_BATCH, "small-wait"),
            }
            latency = {
                "none": await hop_latency(plain, args.rate, args.seconds, "latency"),
                "wait": await hop_latency(waiting, args.rate, args.seconds, "latency-wait"),
            }
            produce_ms = {
                "none": await produce_call_ms(plain, payloads[0], "calls"),
                "wait": await produce_call_ms(waiting, payloads[0], "calls-wait"),
            }
            short = waiting.replica_waits_short
        finally:
            await plain.delete_run()
            await plain.close()
            await waiting.close()
    none, wait = statistics.median(rates["none"]), statistics.median(rates["wait"])
    return {
        "bench": "transport_wait",
        "command": "python bench/transport.py --replica "
        + f"--records {args.records} --repeats {args.repeats} --rate {args.rate:g} --seconds {args.seconds:g} "
        + "--json-out bench/results/transport_wait.json",
        "machine": {"python": platform.python_version(), "cpus": _cpus()},
        "setup": "primary ops/redis.conf + one replica ops/sentinel/replica.conf, loopback, appendfsync always",
        "record_bytes": round(statistics.fmean(len(p) for p in payloads)),
        "records": args.records,
        "batch": args.batch,
        "repeats": args.repeats,
        "hop_records_per_s": {"none": round(none), "wait_1_replica": round(wait)},
        "hop_records_per_s_each": {k: [round(r) for r in v] for k, v in rates.items()},
        "ratio_wait_vs_none": round(wait / none, 3),
        f"hop_records_per_s_batch_{SMALL_BATCH}": {k: round(v) for k, v in small_rates.items()},
        f"ratio_wait_vs_none_batch_{SMALL_BATCH}": round(small_rates["wait"] / small_rates["none"], 3),
        "produce_one_record_call_ms": produce_ms,
        "latency_produce_to_receipt": latency,
        "replica_waits_short": short,
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=256, help="records per produce and per consume")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rate", type=float, default=1_000.0, help="offered load of the latency run, records/s"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="length of the latency run")
    parser.add_argument(
        "--json-out", type=Path, help="also write the JSON here (e.g. bench/results/transport.json)"
    )
    parser.add_argument(
        "--replica", action="store_true",
        help="start a primary+replica pair and measure with and without WAIT (transport.min_replicas_acked=1)",
    )
    args = parser.parse_args()
    result = asyncio.run(measure_wait(args) if args.replica else measure(args))
    emit(result, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
