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
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
import uuid
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
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    emit(result, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
