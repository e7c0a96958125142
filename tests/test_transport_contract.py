"""The transport contract: every test runs on both ``memory`` and ``redis`` (the real redis-server).

Waiting for time to pass (idle entries) polls ``stats`` with a deadline; nothing sleeps a fixed time.
The SIGKILL test needs a real process and runs on Redis only; ``crash_consumer`` below is that process.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
from polling import wait_until

from pipeline.records import (
    DeadLetter,
    PromptTask,
    RecordError,
    Trajectory,
    decode,
    encode,
    pack_f32,
    pack_i32,
)
from pipeline.transport import DEFAULT_REDIS_URL, MemoryTransport, Transport, TransportError, connect
from pipeline.transport.base import DEAD_EDGE, Delivery, parse_id

pytestmark = pytest.mark.contract

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, TRAJECTORIES, WEIGHTS = "prompts", "trajectories", "weights"


# ---------------------------------------------------------------- records used as payloads


def prompt(i: int) -> PromptTask:
    return PromptTask(
        prompt_id=f"e0:{i}",
        generation_batch=0,
        num_generations=2,
        messages=[{"role": "user", "content": f"what is {i} + {i}?"}],
        data_dict={"solution": str(2 * i)},
    )


def rollout(task: PromptTask, request: int = 0) -> Trajectory:
    """A deterministic stand-in for the rollout stage: one trajectory per prompt."""
    n = int(task.prompt_id.split(":")[1])
    return Trajectory(
        prompt_id=task.prompt_id,
        attempt=task.attempt,
        request_id=f"{task.group_id}/{request}",
        generation_batch=task.generation_batch,
        prompt_ids=pack_i32(range(n, n + 8)),
        completion_ids=pack_i32(range(16)),
        logprobs=pack_f32([-0.5] * 16),
        completion=str(2 * n),
        policy_version=0,
        max_policy_version=0,
    )


def prompt_ids(deliveries: list[Delivery]) -> list[str]:
    return [decode(d.payload).prompt_id for d in deliveries]


# ---------------------------------------------------------------- fixtures


class Opener:
    """Opens transports of one kind that share one fresh ``run``; closes them (and deletes Redis keys) after."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind, self.url = kind, url
        self.run = f"test-{uuid.uuid4().hex[:12]}"
        self.opened: list[Transport] = []

    async def __call__(self, **options) -> Transport:
        transport = await connect(self.kind, run=self.run, url=self.url, **options)
        self.opened.append(transport)
        return transport

    async def cleanup(self) -> None:
        if self.opened and self.kind == "redis":
            await self.opened[0].delete_run()
        for transport in self.opened:
            await transport.close()


@pytest.fixture(params=["memory", "redis"])
async def open_transport(request):
    kind = request.param
    opener = Opener(kind, request.getfixturevalue("redis_url") if kind == "redis" else DEFAULT_REDIS_URL)
    yield opener
    await opener.cleanup()


@pytest.fixture
async def open_redis(redis_url):
    opener = Opener("redis", redis_url)
    yield opener
    await opener.cleanup()


@pytest.fixture
async def transport(open_transport) -> Transport:
    return await open_transport()


async def wait_idle(transport: Transport, edge: str, group: str, min_idle_ms: int) -> None:
    """Until the oldest pending entry of ``group`` has been idle ``min_idle_ms``, i.e. is reclaimable."""

    async def idle_enough() -> bool:
        return (await transport.stats(edge, group)).oldest_pending_ms >= min_idle_ms

    await wait_until(idle_enough, f"{edge}/{group} pending entries idle {min_idle_ms} ms")


# ---------------------------------------------------------------- produce / consume / ack


async def test_connect_gives_a_transport(transport):
    assert isinstance(transport, Transport)
    assert transport.max_deliveries == 5


async def test_produce_consume_ack(transport):
    ids = await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(5)])
    assert all(re.fullmatch(r"\d+-\d+", entry_id) for entry_id in ids)
    assert [parse_id(i) for i in ids] == sorted(parse_id(i) for i in set(ids))  # unique and increasing

    first = await transport.consume(PROMPTS, "rollout", "w1", 3, 0)
    assert [d.id for d in first] == ids[:3]
    assert prompt_ids(first) == ["e0:0", "e0:1", "e0:2"]
    assert {(d.edge, d.deliveries) for d in first} == {(PROMPTS, 1)}
    # The group shares the work: another consumer gets only the rest.
    rest = await transport.consume(PROMPTS, "rollout", "w2", 10, 0)
    assert [d.id for d in rest] == ids[3:]
    assert await transport.consume(PROMPTS, "rollout", "w1", 10, 0) == []

    await transport.ack(PROMPTS, "rollout", [d.id for d in first + rest])
    stats = await transport.stats(PROMPTS, "rollout")
    assert (stats.length, stats.pending, stats.lag) == (5, 0, 0)
    # Another group starts at the stream start and sees everything.
    assert [d.id for d in await transport.consume(PROMPTS, "audit", "a", 10, 0)] == ids


async def test_consume_waits_for_the_first_entry(transport):
    started = time.monotonic()
    assert await transport.consume(PROMPTS, "rollout", "w1", 10, 50) == []
    assert time.monotonic() - started < 2

    waiting = asyncio.create_task(transport.consume(PROMPTS, "rollout", "w1", 10, 5_000))
    done, _ = await asyncio.wait({waiting}, timeout=0.05)
    assert not done  # nothing to deliver: it waits
    [entry_id] = await transport.produce(PROMPTS, [encode(prompt(7))])
    got = await asyncio.wait_for(waiting, 4)
    assert [d.id for d in got] == [entry_id]


async def test_ack_appends_outputs_and_acks_inputs_together(transport):
    await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(3)])
    batch = await transport.consume(PROMPTS, "rollout", "w1", 10, 0)
    outputs = [encode(rollout(decode(d.payload), r)) for d in batch for r in range(2)]
    await transport.ack(PROMPTS, "rollout", [d.id for d in batch], {TRAJECTORIES: outputs, "feedback": []})

    assert (await transport.stats(PROMPTS, "rollout")).pending == 0
    produced = await transport.consume(TRAJECTORIES, "reward", "r1", 100, 0)
    assert [d.payload for d in produced] == outputs
    assert (await transport.stats("feedback")).length == 0

    # outputs without inputs to ack (a held input) still go out
    await transport.ack(TRAJECTORIES, "reward", [], {"scored": [b"x"]})
    assert (await transport.stats("scored")).length == 1


# ---------------------------------------------------------------- redelivery


async def test_unacked_entries_are_reclaimed_after_min_idle(transport):
    ids = await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(3)])
    held = await transport.consume(PROMPTS, "rollout", "dies", 10, 0)
    await transport.ack(PROMPTS, "rollout", [held[0].id])
    # Not idle long enough yet: nothing to take over.
    assert await transport.reclaim(PROMPTS, "rollout", "heir", 60_000, 10) == []

    await wait_idle(transport, PROMPTS, "rollout", 50)
    reclaimed = await transport.reclaim(PROMPTS, "rollout", "heir", 50, 10)
    assert [d.id for d in reclaimed] == ids[1:]
    assert [d.deliveries for d in reclaimed] == [2, 2]
    assert prompt_ids(reclaimed) == ["e0:1", "e0:2"]
    stats = await transport.stats(PROMPTS, "rollout")
    assert stats.consumers == {"heir": 2}
    assert stats.oldest_pending_ms < 50  # the claim restarted the idle clock

    await transport.ack(PROMPTS, "rollout", [d.id for d in reclaimed])
    assert (await transport.stats(PROMPTS, "rollout")).pending == 0
    assert await transport.reclaim(PROMPTS, "rollout", "heir", 0, 10) == []


async def test_touch_keeps_a_live_holder_from_being_reclaimed(transport):
    min_idle_ms = 150
    [entry_id] = await transport.produce(PROMPTS, [encode(prompt(1))])
    await transport.consume(PROMPTS, "rollout", "slow", 10, 0)
    await wait_idle(transport, PROMPTS, "rollout", min_idle_ms)

    await transport.touch(PROMPTS, "rollout", "other", [entry_id])  # not its holder: no effect
    assert (await transport.stats(PROMPTS, "rollout")).oldest_pending_ms >= min_idle_ms
    await transport.touch(PROMPTS, "rollout", "slow", [entry_id])
    assert await transport.reclaim(PROMPTS, "rollout", "other", min_idle_ms, 10) == []
    stats = await transport.stats(PROMPTS, "rollout")
    assert stats.consumers == {"slow": 1}

    # Without another touch it becomes reclaimable again, and the touches did not count as deliveries.
    await wait_idle(transport, PROMPTS, "rollout", min_idle_ms)
    reclaimed = await transport.reclaim(PROMPTS, "rollout", "other", min_idle_ms, 10)
    assert [(d.id, d.deliveries) for d in reclaimed] == [(entry_id, 2)]


async def test_poison_goes_to_the_dead_edge_while_good_records_keep_flowing(open_transport):
    transport = await open_transport(max_deliveries=3)
    poison = b"\xc1 not msgpack"
    next_prompt = 0
    poison_id = ""
    poison_deliveries: list[int] = []

    async def produce_good(count: int) -> None:
        nonlocal next_prompt
        await transport.produce(PROMPTS, [encode(prompt(next_prompt + i)) for i in range(count)])
        next_prompt += count

    async def handle(batch: list[Delivery]) -> None:
        """A consumer that crashes on poison: it never acks it (nor dead-letters it itself)."""
        good = []
        for delivery in batch:
            try:
                good.append((delivery.id, rollout(decode(delivery.payload))))
            except RecordError:
                poison_deliveries.append(delivery.deliveries)
        if good:
            outputs = {TRAJECTORIES: [encode(trajectory) for _, trajectory in good]}
            await transport.ack(PROMPTS, "rollout", [entry_id for entry_id, _ in good], outputs)

    await produce_good(1)
    [poison_id] = await transport.produce(PROMPTS, [poison])
    await produce_good(1)
    await handle(await transport.consume(PROMPTS, "rollout", "w1", 10, 0))
    for _ in range(3):  # deliveries 2 and 3 come back; the 4th claim dead-letters it instead
        await produce_good(2)
        await handle(await transport.consume(PROMPTS, "rollout", "w1", 10, 0))
        await wait_idle(transport, PROMPTS, "rollout", 30)
        await handle(await transport.reclaim(PROMPTS, "rollout", "w2", 30, 10))

    assert poison_deliveries == [1, 2, 3]
    assert (await transport.stats(PROMPTS, "rollout")).pending == 0
    trajectories = await transport.consume(TRAJECTORIES, "reward", "r", 100, 0)
    assert sorted(decode(d.payload).prompt_id for d in trajectories) == sorted(
        f"e0:{i}" for i in range(next_prompt)
    )
    [dead] = await transport.consume(DEAD_EDGE, "inspect", "i", 10, 0)
    letter = decode(dead.payload)
    assert isinstance(letter, DeadLetter)
    assert (letter.edge, letter.entry_id, letter.payload) == (PROMPTS, poison_id, poison)
    assert (letter.stage, letter.worker, letter.deliveries) == ("rollout", "w2", 3)
    assert "max_deliveries=3" in letter.error


async def test_dead_letter_moves_one_entry_with_its_error_and_origin(transport):
    [bad_id, good_id] = await transport.produce(PROMPTS, [b"\xc1garbage", encode(prompt(1))])
    bad, good = await transport.consume(PROMPTS, "rollout", "w1", 10, 0)
    with pytest.raises(RecordError) as failure:
        decode(bad.payload)
    await transport.dead_letter(PROMPTS, "rollout", bad, str(failure.value), "rollout/w1")

    stats = await transport.stats(PROMPTS, "rollout")
    assert (stats.pending, stats.consumers) == (1, {"w1": 1})  # only the good one is still held
    [dead] = await transport.read(DEAD_EDGE, "0", 10, 0)
    letter = decode(dead.payload)
    assert (letter.edge, letter.entry_id, letter.payload, letter.deliveries) == (
        PROMPTS,
        bad_id,
        b"\xc1garbage",
        1,
    )
    assert (letter.stage, letter.worker) == ("rollout", "w1")
    assert letter.error == str(failure.value) and "undecodable" in letter.error
    assert good.id == good_id


# ---------------------------------------------------------------- fan-out


async def test_fanout_every_reader_sees_every_entry(transport):
    assert await transport.last_id(WEIGHTS) == "0"
    assert await transport.read(WEIGHTS, "0", 10, 0) == []
    ids = await transport.produce(WEIGHTS, [f"v{i}".encode() for i in range(3)])
    assert await transport.last_id(WEIGHTS) == ids[-1]

    for _reader in ("rollout", "feeder"):  # each reader keeps its own cursor; reads consume nothing
        cursor, seen = "0", []
        while batch := await transport.read(WEIGHTS, cursor, 2, 0):
            seen += batch
            cursor = batch[-1].id
        assert [d.id for d in seen] == ids
        assert [d.payload for d in seen] == [b"v0", b"v1", b"v2"]
    assert [d.id for d in await transport.read(WEIGHTS, ids[0], 10, 0)] == ids[1:]

    # A blocked reader wakes up for the next entry.
    waiting = asyncio.create_task(transport.read(WEIGHTS, ids[-1], 10, 5_000))
    [new_id] = await transport.produce(WEIGHTS, [b"v3"])
    assert [d.id for d in await asyncio.wait_for(waiting, 4)] == [new_id]


async def test_fanout_dollar_means_only_entries_after_the_call(transport):
    old = await transport.produce(WEIGHTS, [b"old"])
    reader = asyncio.create_task(transport.read(WEIGHTS, "$", 10, 3_000))
    produced: list[str] = []
    # The read may reach the server after a produce; keep producing until it sees one.
    while not reader.done():
        produced += await transport.produce(WEIGHTS, [b"new"])
        await asyncio.wait({reader}, timeout=0.02)
    got = reader.result()
    assert got and got[0].id in produced and old[0] not in [d.id for d in got]


# ---------------------------------------------------------------- stats and trimming


async def test_stats_length_pending_lag_and_oldest(transport):
    assert (await transport.stats("nowhere", "g")).length == 0
    await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(5)])
    assert (await transport.stats(PROMPTS)).length == 5
    not_started = await transport.stats(PROMPTS, "rollout")
    assert (not_started.length, not_started.pending, not_started.lag) == (5, 0, 5)

    w1 = await transport.consume(PROMPTS, "rollout", "w1", 2, 0)
    await transport.consume(PROMPTS, "rollout", "w2", 1, 0)
    stats = await transport.stats(PROMPTS, "rollout")
    assert (stats.length, stats.pending, stats.lag) == (5, 3, 2)
    assert stats.consumers == {"w1": 2, "w2": 1}

    await transport.ack(PROMPTS, "rollout", [w1[0].id])
    await wait_idle(transport, PROMPTS, "rollout", 20)  # the oldest pending age grows while nobody acks
    stats = await transport.stats(PROMPTS, "rollout")
    assert (stats.pending, stats.lag, stats.consumers) == (2, 2, {"w1": 1, "w2": 1})
    assert stats.oldest_pending_ms >= 20


async def test_trim_acked_never_drops_unacked_entries(transport):
    ids = await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(6)])
    assert await transport.trim_acked(PROMPTS) == 0  # no group yet: a consumer may still come
    assert await transport.trim_acked("nowhere") == 0

    g1 = await transport.consume(PROMPTS, "g1", "c", 4, 0)
    await transport.ack(PROMPTS, "g1", [g1[0].id, g1[1].id])  # g1 still holds ids[2], ids[3]
    g2 = await transport.consume(PROMPTS, "g2", "c", 1, 0)
    await transport.ack(PROMPTS, "g2", [g2[0].id])  # g2 has not seen ids[1:] yet
    assert await transport.trim_acked(PROMPTS) == 1  # only ids[0] is acked by both
    assert (await transport.stats(PROMPTS)).length == 5

    rest = await transport.consume(PROMPTS, "g2", "c", 10, 0)
    assert [d.id for d in rest] == ids[1:]  # nothing g2 had not seen was lost
    await transport.ack(PROMPTS, "g2", [d.id for d in rest])
    assert await transport.trim_acked(PROMPTS) == 1  # ids[1]; g1's pending ids[2] bounds it

    await transport.ack(PROMPTS, "g1", [g1[2].id, g1[3].id])
    assert await transport.trim_acked(PROMPTS) == 2  # ids[4:] were never delivered to g1
    assert (await transport.stats(PROMPTS)).length == 2
    assert [d.id for d in await transport.consume(PROMPTS, "g1", "c", 10, 0)] == ids[4:]


async def test_producers_trim_acked_entries_once_an_edge_exceeds_maxlen(open_transport):
    transport = await open_transport(maxlen=10)
    await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(10)])
    batch = await transport.consume(PROMPTS, "g", "c", 10, 0)
    await transport.ack(PROMPTS, "g", [d.id for d in batch[:6]])
    new = await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(10, 15)])
    # The 6 acked entries went; the 4 pending and 5 undelivered ones stay.
    assert (await transport.stats(PROMPTS)).length == 9
    await transport.ack(PROMPTS, "g", [d.id for d in batch[6:]])
    assert [d.id for d in await transport.consume(PROMPTS, "g", "c", 10, 0)] == new


# ---------------------------------------------------------------- memory-only: bounded edges


async def test_memory_produce_waits_while_the_edge_is_full_of_unacked_entries():
    transport = MemoryTransport(maxlen=3)
    first = await transport.produce(PROMPTS, [encode(prompt(i)) for i in range(3)])
    blocked = asyncio.create_task(transport.produce(PROMPTS, [encode(prompt(3))]))
    done, _ = await asyncio.wait({blocked}, timeout=0.05)
    assert not done  # full, and nothing is acked: wait, never drop

    [held] = await transport.consume(PROMPTS, "g", "c", 1, 0)
    done, _ = await asyncio.wait({blocked}, timeout=0.05)
    assert not done  # delivered is not acked
    await transport.ack(PROMPTS, "g", [held.id])
    [fourth] = await asyncio.wait_for(blocked, 2)

    stats = await transport.stats(PROMPTS, "g")
    assert (stats.length, stats.lag) == (3, 3)  # the acked entry made room
    assert [d.id for d in await transport.consume(PROMPTS, "g", "c", 10, 0)] == first[1:] + [fourth]


async def test_memory_ack_with_outputs_waits_for_room_before_acking():
    transport = MemoryTransport(maxlen=2)
    await transport.produce(TRAJECTORIES, [b"t0", b"t1"])
    await transport.produce(PROMPTS, [encode(prompt(0))])
    [task] = await transport.consume(PROMPTS, "rollout", "w", 1, 0)
    committing = asyncio.create_task(transport.ack(PROMPTS, "rollout", [task.id], {TRAJECTORIES: [b"t2"]}))
    done, _ = await asyncio.wait({committing}, timeout=0.05)
    assert not done
    assert (await transport.stats(PROMPTS, "rollout")).pending == 1  # neither half happened

    downstream = await transport.consume(TRAJECTORIES, "reward", "r", 10, 0)
    await transport.ack(TRAJECTORIES, "reward", [d.id for d in downstream])
    await asyncio.wait_for(committing, 2)
    assert (await transport.stats(PROMPTS, "rollout")).pending == 0
    assert [d.payload for d in await transport.consume(TRAJECTORIES, "reward", "r", 10, 0)] == [b"t2"]


# ---------------------------------------------------------------- redis-only


async def test_unreachable_redis_is_one_clear_line():
    with pytest.raises(TransportError) as failure:
        await connect("redis", run="x", url="redis://me:s3cret@127.0.0.1:1/0", connect_timeout=0.5)
    message = str(failure.value)
    assert "redis://me:***@127.0.0.1:1/0" in message and "redis-server --daemonize yes" in message
    assert "s3cret" not in message and "\n" not in message
    with pytest.raises(TransportError, match="unknown transport kind 'kafka'"):
        await connect("kafka", run="x")


def crash_consumer(run: str, url: str, ack_count: int) -> None:
    """Consumer A of the SIGKILL test, in its own process: take every prompt, finish ``ack_count`` of
    them, print the ids it still holds, then hang (mid-work) until it is killed."""

    async def main() -> None:
        transport = await connect("redis", run=run, url=url)
        batch = await transport.consume(PROMPTS, "rollout", "A", 100, 2_000)
        done = batch[:ack_count]
        outputs = {TRAJECTORIES: [encode(rollout(decode(d.payload))) for d in done]}
        await transport.ack(PROMPTS, "rollout", [d.id for d in done], outputs)
        print(" ".join(d.id for d in batch[ack_count:]), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


async def test_sigkilled_consumer_work_is_reclaimed_and_seen_downstream_once(open_redis):
    transport = await open_redis()
    tasks = [prompt(i) for i in range(10)]
    await transport.produce(PROMPTS, [encode(task) for task in tasks])

    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); "
        "from test_transport_contract import crash_consumer; "
        f"crash_consumer({open_redis.run!r}, {open_redis.url!r}, 4)"
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 30)
        if not line:
            raise AssertionError(f"consumer A died early: {(await child.stderr.read()).decode()[-2000:]}")
        held = line.decode().split()
        assert len(held) == 6
        stats = await transport.stats(PROMPTS, "rollout")
        assert (stats.pending, stats.consumers) == (6, {"A": 6})
    finally:
        child.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(child.wait(), 10) == -signal.SIGKILL

    # Consumer B takes over what A held once it has been idle min_idle.
    await wait_idle(transport, PROMPTS, "rollout", 50)
    reclaimed = await transport.reclaim(PROMPTS, "rollout", "B", 50, 100)
    assert sorted(d.id for d in reclaimed) == sorted(held)
    assert {d.deliveries for d in reclaimed} == {2}
    outputs = {TRAJECTORIES: [encode(rollout(decode(d.payload))) for d in reclaimed]}
    await transport.ack(PROMPTS, "rollout", [d.id for d in reclaimed], outputs)
    assert (await transport.stats(PROMPTS, "rollout")).pending == 0

    # The downstream consumer is idempotent on record_id; it sees each trajectory exactly once.
    seen: dict[str, int] = {}
    raw = 0
    while batch := await transport.consume(TRAJECTORIES, "reward", "D", 100, 0):
        for delivery in batch:
            raw += 1
            record_id = decode(delivery.payload).record_id
            seen[record_id] = seen.get(record_id, 0) + 1
        await transport.ack(TRAJECTORIES, "reward", [d.id for d in batch])
    assert seen.keys() == {rollout(task).record_id for task in tasks}
    # A's killed half never wrote outputs (they go out only with the ack), so not even a duplicate arrived.
    assert raw == len(tasks)


# ---------------------------------------------------------------- leases


async def test_leases_renew_release_and_expire(transport):
    assert await transport.leases(WEIGHTS) == {}
    await transport.lease(WEIGHTS, "rollout-a", 3, 60_000)
    await transport.lease(WEIGHTS, "rollout-b", 5, 60_000)
    await transport.lease("other", "rollout-a", 9, 60_000)
    assert await transport.leases(WEIGHTS) == {"rollout-a": 3, "rollout-b": 5}
    await transport.lease(WEIGHTS, "rollout-a", 4, 60_000)  # renewing replaces the value
    assert await transport.leases(WEIGHTS) == {"rollout-a": 4, "rollout-b": 5}
    await transport.release(WEIGHTS, "rollout-b")
    assert await transport.leases(WEIGHTS) == {"rollout-a": 4}
    assert await transport.leases("other") == {"rollout-a": 9}

    # A holder that stops renewing (it died) loses its lease after the ttl; a renewing one keeps it.
    await transport.lease(WEIGHTS, "dies", 1, 150)
    assert (await transport.leases(WEIGHTS))["dies"] == 1

    async def expired() -> bool:
        await transport.lease(WEIGHTS, "rollout-a", 4, 150)
        return "dies" not in await transport.leases(WEIGHTS)

    await wait_until(expired, "the lease of a holder that stopped renewing to expire")
    assert await transport.leases(WEIGHTS) == {"rollout-a": 4}


async def test_a_sigkilled_workers_lease_expires(open_redis, redis_url):
    """A real process leases and is SIGKILLed: its lease is there, then gone after the ttl."""
    transport = await open_redis()
    code = (
        "import asyncio, sys\n"
        "from pipeline.transport import connect\n"
        "async def main():\n"
        f"    t = await connect('redis', run={open_redis.run!r}, url={open_redis.url!r})\n"
        "    await t.lease('weights', 'rollout-killed', 7, 400)\n"
        "    print('leased', flush=True)\n"
        "    await asyncio.Event().wait()\n"
        "asyncio.run(main())\n"
    )
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 30)
        assert line.strip() == b"leased", (await child.stderr.read()).decode()[-2000:]
        assert await transport.leases(WEIGHTS) == {"rollout-killed": 7}
    finally:
        child.send_signal(signal.SIGKILL)
        await asyncio.wait_for(child.wait(), 10)

    async def expired() -> bool:
        return await transport.leases(WEIGHTS) == {}

    await wait_until(expired, "the killed worker's lease to expire")
