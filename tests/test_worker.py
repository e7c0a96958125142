"""The worker runtime on the memory transport: flow, retries, dead letters, holds, drain, burst."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.records import DeadLetter, Feedback, decode, encode
from pipeline.stage import Handled, Stage
from pipeline.transport.memory import MemoryTransport
from pipeline.worker import Worker, run_together


def fb(i: int, outcome: str = "trained") -> Feedback:
    return Feedback(prompt_id=str(i), attempt=0, generation_batch=0, outcome=outcome)


class Doubler(Stage):
    """in -> out, failing ``fail_times`` times on prompt_id "3" (and forever on "13")."""

    name = "doubler"
    consumes = ("in",)
    concurrency = 4

    def __init__(self, fail_times: int = 0) -> None:
        self.fail_times = fail_times
        self.calls: dict[str, int] = {}

    async def handle(self, record, ctx):
        assert (ctx.run, ctx.stage, ctx.worker.startswith("doubler")) == ("t", "doubler", True)
        self.calls[record.prompt_id] = self.calls.get(record.prompt_id, 0) + 1
        if record.prompt_id == "13" or (record.prompt_id == "3" and self.calls["3"] <= self.fail_times):
            raise RuntimeError(f"boom on {record.prompt_id}")
        return Handled(outputs=[("out", fb(int(record.prompt_id) * 2))])


async def drain_edge(transport, edge, group="check"):
    out = []
    while batch := await transport.consume(edge, group, "c", 100, 10):
        out += batch
        await transport.ack(edge, group, [d.id for d in batch])
    return out


def worker(stage, transport, **kw):
    kw.setdefault("burst", True)
    return Worker(stage, transport, run="t", block_ms=20, min_idle_ms=60_000, retry_backoff_s=0.001, **kw)


async def test_records_flow_and_everything_is_acked():
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(i)) for i in range(10)])
    assert await worker(Doubler(), transport).serve() == 0
    outs = sorted(int(decode(d.payload).prompt_id) for d in await drain_edge(transport, "out"))
    assert outs == [2 * i for i in range(10)]
    stats = await transport.stats("in", "doubler")
    assert stats.pending == 0 and stats.lag == 0


async def test_retries_then_dead_letters_while_good_records_flow():
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(i)) for i in (1, 3, 13, 5)])
    stage = Doubler(fail_times=2)
    await worker(stage, transport, max_retries=2).serve()
    assert stage.calls["3"] == 3  # two failures, then success
    assert stage.calls["13"] == 3  # 1 + max_retries attempts, then dead-lettered
    outs = sorted(int(decode(d.payload).prompt_id) for d in await drain_edge(transport, "out"))
    assert outs == [2, 6, 10]
    dead = [decode(d.payload) for d in await drain_edge(transport, "dead")]
    assert len(dead) == 1 and isinstance(dead[0], DeadLetter)
    assert "boom on 13" in dead[0].error and dead[0].edge == "in"
    assert decode(dead[0].payload).prompt_id == "13"  # the original payload is kept


async def test_undecodable_payload_is_dead_lettered_at_once():
    transport = MemoryTransport()
    await transport.produce("in", [b"\xffnot msgpack", encode(fb(2))])
    stage = Doubler()
    await worker(stage, transport).serve()
    assert stage.calls == {"2": 1}
    dead = [decode(d.payload) for d in await drain_edge(transport, "dead")]
    assert len(dead) == 1 and dead[0].payload == b"\xffnot msgpack" and "undecodable" in dead[0].error


class Collector(Stage):
    """Holds inputs until three arrived, then emits their sum and releases them."""

    name = "collector"
    consumes = ("in",)

    def __init__(self) -> None:
        self.held: list = []

    async def handle(self, record, ctx):
        self.held.append(record)
        if len(self.held) < 3:
            return Handled(hold=True)
        total = sum(int(r.prompt_id) for r in self.held)
        released = [r.record_id for r in self.held]
        self.held = []
        return Handled(outputs=[("out", fb(total))], release=released)


async def test_held_inputs_stay_pending_until_released():
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(i)) for i in (1, 2, 3, 4, 5)])
    w = worker(Collector(), transport, burst=False)
    task = asyncio.create_task(w.serve())
    # wait (with a deadline) until the first sum is out and two inputs are held
    async with asyncio.timeout(10):
        while not (await transport.stats("out")).length or (await transport.stats("in", "collector")).pending != 2:
            await asyncio.sleep(0.01)
    w.request_stop("test")  # a plain stop keeps held inputs pending for a successor
    await task
    assert (await transport.stats("in", "collector")).pending == 2
    outs = [decode(d.payload).prompt_id for d in await drain_edge(transport, "out")]
    assert outs == ["6"]


async def test_finished_run_releases_held_inputs():
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(i)) for i in (1, 2)])
    w = worker(Collector(), transport, burst=False)
    task = asyncio.create_task(w.serve())
    async with asyncio.timeout(10):
        while (await transport.stats("in", "collector")).pending != 2:
            await asyncio.sleep(0.01)
    w.request_stop("done", run_finished=True)
    await task
    assert (await transport.stats("in", "collector")).pending == 0


class DrainingCollector(Collector):
    """On a plain stop, flushes what it holds (as the learner checkpoints what it trained) and acks it."""

    drains = 0

    async def drain(self, ctx):
        self.drains += 1
        first = self.held[0]
        return Handled(outputs=[("out", fb(int(first.prompt_id)))], release=[first.record_id])


async def test_a_plain_stop_runs_the_stage_drain_hook_and_acks_what_it_releases():
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(i)) for i in (1, 2)])
    stage = DrainingCollector()
    w = worker(stage, transport, burst=False)
    task = asyncio.create_task(w.serve())
    async with asyncio.timeout(10):
        while (await transport.stats("in", "collector")).pending != 2:
            await asyncio.sleep(0.01)  # polling the held inputs, with a deadline
    w.request_stop("SIGTERM")
    assert await task == 0 and stage.drains == 1
    assert (await transport.stats("in", "collector")).pending == 1  # released by drain: acked; the other held
    assert [decode(d.payload).prompt_id for d in await drain_edge(transport, "out")] == ["1"]
    # The run's end acks everything held instead: no drain then.
    finished = DrainingCollector()
    await transport.produce("in", [encode(fb(7))])
    w = worker(finished, transport, burst=False)
    task = asyncio.create_task(w.serve())
    async with asyncio.timeout(10):
        while not finished.held:
            await asyncio.sleep(0.01)  # polling the stage, with a deadline
    w.request_stop("done", run_finished=True)
    assert await task == 0 and finished.drains == 0
    assert (await transport.stats("in", "collector")).pending == 1  # the first worker's, left for a successor


class Slow(Stage):
    name = "slow"
    consumes = ("in",)

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, record, ctx):
        self.entered.set()
        await self.release.wait()
        return Handled(outputs=[("out", record)])


async def test_stop_drains_in_flight_work_and_acks_it():
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(1))])
    stage = Slow()
    w = worker(stage, transport, burst=False)
    task = asyncio.create_task(w.serve())
    await asyncio.wait_for(stage.entered.wait(), 10)
    w.request_stop("SIGTERM")
    stage.release.set()
    assert await asyncio.wait_for(task, 10) == 0
    assert (await transport.stats("in", "slow")).pending == 0
    assert len(await drain_edge(transport, "out")) == 1


class TwoInputs(Stage):
    """One slot, two input edges (as the advantage stage: its records and the dead letters)."""

    name = "two"
    consumes = ("in", "side")

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def handle(self, record, ctx):
        self.seen.append(record.prompt_id)
        return Handled()


async def test_a_read_blocked_on_a_quiet_input_edge_never_starves_the_busy_one():
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(i)) for i in range(20)])
    stage = TwoInputs()
    # Reads block 3 s: were a slot held through a blocked read of "side", "in" would move one record per
    # 3 s and miss the deadline below by far.
    w = Worker(stage, transport, run="t", block_ms=3000, min_idle_ms=60_000)
    serving = asyncio.create_task(w.serve())
    try:
        async with asyncio.timeout(15):
            while len(stage.seen) < 20:
                await asyncio.sleep(0.01)  # polling the stage's progress, with a deadline
            await transport.produce("side", [encode(fb(99))])
            while "99" not in stage.seen:
                await asyncio.sleep(0.01)
        for edge in ("in", "side"):
            assert (await transport.stats(edge, "two")).pending == 0
    finally:
        serving.cancel()
    assert sorted(stage.seen, key=int) == [str(i) for i in range(20)] + ["99"]


class Source(Stage):
    name = "source"

    async def source(self, ctx):
        for i in range(3):
            yield [("in", fb(i))]


class Finisher(Doubler):
    async def handle(self, record, ctx):
        out = await super().handle(record, ctx)
        if record.prompt_id == "2":
            ctx.request_stop("saw the last record", run_finished=True)
        return out


async def test_run_together_stops_everyone_when_main_finishes():
    transport = MemoryTransport()
    source = worker(Source(), transport, burst=False)
    main = worker(Finisher(), transport, burst=False)
    assert await asyncio.wait_for(run_together([source, main], main=main), 20) == 0
    assert len(await drain_edge(transport, "out")) == 3


async def test_a_failing_worker_fails_the_run():
    class Broken(Stage):
        name = "broken"

        async def source(self, ctx):
            raise RuntimeError("cannot start")
            yield []  # pragma: no cover

    transport = MemoryTransport()
    other = worker(Doubler(), transport, burst=False)
    with pytest.raises(BaseException, match="cannot start"):
        await asyncio.wait_for(run_together([worker(Broken(), transport, burst=False), other]), 20)


async def test_a_fatal_stage_error_fails_the_worker_at_once_without_dead_lettering():
    from pipeline.stage import FatalStageError

    class Fatal(Stage):
        name = "fatal"
        consumes = ("in",)

        def __init__(self):
            self.calls = 0

        async def handle(self, record, ctx):
            self.calls += 1
            raise FatalStageError("cannot go on")

    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(1))])
    stage = Fatal()
    with pytest.raises(FatalStageError, match="cannot go on"):
        await asyncio.wait_for(worker(stage, transport).serve(), 20)
    assert stage.calls == 1  # no retries
    assert (await transport.stats("dead")).length == 0
    assert (await transport.stats("in", "fatal")).pending == 1  # left for a restarted worker


async def test_metrics_and_healthz_are_served_on_localhost():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    transport = MemoryTransport()
    await transport.produce("in", [encode(fb(i)) for i in range(3)])
    stage = Slow()
    stage.release.set()
    w = worker(stage, transport, burst=False, metrics_port=port)
    task = asyncio.create_task(w.serve())
    await asyncio.wait_for(stage.entered.wait(), 10)

    async def get(path):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return data.decode()

    health = await get("/healthz")
    assert health.startswith("HTTP/1.1 200")
    async with asyncio.timeout(10):  # wait until the three records are acked
        while (await transport.stats("in", "slow")).lag or (await transport.stats("in", "slow")).pending:
            await asyncio.sleep(0.01)
    body = await get("/metrics")
    assert 'rollstream_records_acked_total{edge="in",run="t",stage="slow"' in body
    assert "rollstream_worker_up" in body
    assert 'rollstream_queue_depth{edge="in",run="t"} 3.0' in body
    w.request_stop("test")
    await task


class Leaser(Stage):
    """A stage that uses weights version ``version`` (as the rollout leases its oldest in use)."""

    name = "leaser"
    consumes = ("in",)

    def __init__(self) -> None:
        self.version = 3

    def leases(self):
        return {"weights": self.version}

    async def handle(self, record, ctx):
        return Handled()


class VersionFollower(Leaser):
    """Moves to the version a record names and says so downstream (as the rollout finishing a group)."""

    async def handle(self, record, ctx):
        self.version = int(record.prompt_id)
        return Handled(outputs=[("out", record)])


async def test_a_lease_that_moved_is_written_before_the_outputs_that_follow_it():
    # The learner cleans up snapshots when the groups a rollout just finished reach it: the rollout's
    # lease must have moved by then, not a heartbeat (1 s) later.
    transport = MemoryTransport()
    stage = VersionFollower()
    w = Worker(stage, transport, run="t", block_ms=20, min_idle_ms=60_000)
    serving = asyncio.create_task(w.serve())
    try:
        for version in (4, 7):
            await transport.produce("in", [encode(fb(version))])
            while not (out := await transport.consume("out", "check", "c", 1, 20)):
                pass
            await transport.ack("out", "check", [d.id for d in out])
            assert await transport.leases("weights") == {w.worker_id: version}
    finally:
        w.request_stop("test")
        assert await asyncio.wait_for(serving, 30) == 0


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_the_heartbeat_leases_what_the_stage_uses_and_a_clean_exit_releases_it(kind, request):
    import time
    import uuid

    from pipeline.transport import connect

    url = request.getfixturevalue("redis_url") if kind == "redis" else ""
    transport = await connect(kind, run=f"t-lease-{uuid.uuid4().hex[:8]}", url=url or "redis://unused")
    stage = Leaser()
    w = Worker(stage, transport, run="t", block_ms=20, min_idle_ms=60_000)
    assert w.lease_ttl_ms == 60_000  # as long as a dead worker's pending entries wait to be reclaimed
    serving = asyncio.create_task(w.serve())

    async def leased(expected):
        deadline = time.monotonic() + 10
        while await transport.leases("weights") != expected:
            assert time.monotonic() < deadline, f"lease never became {expected}"
            await asyncio.sleep(0.02)  # poll interval

    try:
        await leased({w.worker_id: 3})
        stage.version = 5  # the heartbeat renews the lease with what the stage uses now
        await leased({w.worker_id: 5})
        w.request_stop("test")
        assert await asyncio.wait_for(serving, 30) == 0
        assert await transport.leases("weights") == {}
    finally:
        serving.cancel()
        if kind == "redis":
            await transport.delete_run()
        await transport.close()
