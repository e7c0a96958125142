"""The worker runtime: runs one stage on one transport. Small enough to read in one sitting.

Loop: consume a batch -> decode -> ``stage.handle(record)`` -> produce outputs + ack the input in one
atomic transport call. Around it: bounded concurrency, per-record retries with backoff, dead-lettering
(undecodable payloads at once, handler failures after ``max_retries``), reclaiming entries of dead
consumers, keeping held entries alive, fan-out reads, graceful drain on SIGTERM/SIGINT, ``--burst``,
``/metrics`` + ``/healthz``, and structlog JSON logs bound to run/stage/worker. With ``ledger=True``
every step also appends a ``LedgerEntry`` (inputs acked, outputs produced) in that same atomic call.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from pipeline import ledger as ledgers
from pipeline import log, metrics
from pipeline.records import RecordError, decode, encode
from pipeline.stage import Emit, FatalStageError, Handled, Stage
from pipeline.transport.base import Delivery, Transport, TransportError, ledger_edge, newest_record

# A transport call already retries a lost connection for ``transport.reconnect_s`` (each attempt bounded by
# the socket timeout): the worker's own bound on a call is that window plus this margin. A bound shorter than
# the window (it was 10 s) failed a worker cut off from Redis by a 30 s network partition while its transport
# was still waiting to reconnect, which the run survives otherwise.
IO_MARGIN_S = 30.0
# Entries one take-over claims (``Stage.takes_over_at_start``): far more than a learner ever holds; any beyond
# it are reclaimed after ``min_idle_ms`` as usual.
TAKE_OVER_MAX = 100_000


class Context:
    """What a stage sees of its worker (``pipeline.stage.StageContext``): ids for labels and logs, and stop."""

    __slots__ = ("_worker",)

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    @property
    def run(self) -> str:
        return self._worker.run_name

    @property
    def stage(self) -> str:
        return self._worker.name

    @property
    def worker(self) -> str:
        return self._worker.worker_id

    @property
    def stopping(self) -> bool:
        return self._worker.stopping

    def request_stop(self, reason: str, *, run_finished: bool = False) -> None:
        self._worker.request_stop(reason, run_finished=run_finished)

    async def newest(self, edge: str) -> Any:
        """The newest record on ``edge`` (None when empty or not a record): where a producer left off."""
        return await asyncio.wait_for(newest_record(self._worker.transport, edge), self._worker.io_timeout_s)

    async def leases(self, name: str) -> dict[str, int]:
        """Every live worker's lease under ``name`` (worker id -> value): see the stage hook ``leases``."""
        return await asyncio.wait_for(self._worker.transport.leases(name), self._worker.io_timeout_s)

    async def put_blob(self, key: str, data: bytes, ttl_s: int) -> bool:
        """Store bulk bytes once under a content key (``Transport.put_blob``); True when newly stored."""
        return await asyncio.wait_for(self._worker.transport.put_blob(key, data, ttl_s), self._worker.io_timeout_s)

    async def get_blob(self, key: str) -> bytes | None:
        return await asyncio.wait_for(self._worker.transport.get_blob(key), self._worker.io_timeout_s)


def _raise_if_cancelled() -> None:
    """A cancel that lands inside a redis-py call can be swallowed there (seen with redis-py 8.1): a loop
    honours it at its next turn, or the worker would never finish stopping."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class Worker:
    """Runs one stage. ``await Worker(...).serve()`` returns when the stage is done or asked to stop."""

    def __init__(
        self,
        stage: Stage,
        transport: Transport,
        *,
        run: str,
        worker_id: str | None = None,
        group: str | None = None,
        batch_size: int = 64,
        block_ms: int = 1000,
        min_idle_ms: int = 30_000,
        max_retries: int = 2,
        retry_backoff_s: float = 0.05,
        burst: bool = False,
        drain_timeout_s: float = 120.0,
        metrics_host: str = "127.0.0.1",
        metrics_port: int = 0,
        lease_ttl_ms: int | None = None,
        ledger: bool = False,
    ) -> None:
        self.stage = stage
        self.transport = transport
        self.run_name = run
        self.name = stage.name
        self.worker_id = worker_id or f"{stage.name}-{socket.gethostname()}-{os.getpid()}-{id(self) % 10_000}"
        self.group = group or stage.name
        self.batch_size = batch_size
        self.block_ms = block_ms
        self.min_idle_ms = min_idle_ms
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.burst = burst
        self.drain_timeout_s = drain_timeout_s
        self.metrics_host = metrics_host
        self.metrics_port = metrics_port
        # A lease outlives a few missed heartbeats (1 s apart) but not a dead worker for long: as long as
        # its pending entries take to be reclaimed, and never under 10 s.
        self.lease_ttl_ms = lease_ttl_ms or max(min_idle_ms, 10_000)
        self._leased: dict[str, int] = {}  # lease name -> the value last written; released on exit
        self.io_timeout_s = getattr(transport, "reconnect_s", 0.0) + IO_MARGIN_S
        self.ledger = ledger

        self.consumes: tuple[str, ...] = tuple(stage.consumes)
        self.subscribes: tuple[str, ...] = tuple(stage.subscribes)
        self.concurrency: int = max(1, int(stage.concurrency))
        self.log = log.get(run=run, stage=self.name, worker=self.worker_id)

        self._labels = (run, self.name, self.worker_id)
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._slots = asyncio.Semaphore(self.concurrency)
        self._in_flight: set[asyncio.Task] = set()
        self._held: dict[str, tuple[str, str]] = {}  # record_id -> (edge, entry id), unacked on purpose
        self._handling: dict[asyncio.Task, tuple[str, str]] = {}  # in handle() now -> (edge, entry id)
        self._last_beat = time.monotonic()
        self._last_progress = time.time()  # the last ack or output: /healthz and a metric say it
        self._run_finished = False
        self.exit_code = 0
        self.ctx = Context(self)

    # ------------------------------------------------------------------ control

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def request_stop(self, reason: str, *, run_finished: bool = False) -> None:
        """Drain and exit. ``run_finished``: the run is over, so inputs held for work that will never be
        needed (a partial group, a partial batch) are acked instead of left for a successor."""
        self._run_finished = self._run_finished or run_finished
        if not self._stop.is_set():
            self._stop_reason = reason
            self.log.info("stopping", reason=reason, run_finished=run_finished)
            self._stop.set()

    # ------------------------------------------------------------------ main

    async def serve(self) -> int:
        """Start the stage, run every loop, drain on stop. Returns the exit code (0 = clean)."""
        w = self._labels
        server = None
        if self.metrics_port:
            server = await metrics.serve(self.metrics_host, self.metrics_port, self.health)
        await self.stage.start(self.ctx)
        metrics.init_worker(*w, self.consumes)
        metrics.WORKER_UP.labels(*w).set(1)
        self.log.info("started", consumes=self.consumes, subscribes=self.subscribes, concurrency=self.concurrency)
        try:
            async with asyncio.TaskGroup() as tg:
                background = [tg.create_task(self._fanout_loop(edge)) for edge in self.subscribes]
                background.append(tg.create_task(self._heartbeat_loop()))
                source = self.stage.source(self.ctx)
                if source is not None:
                    background.append(tg.create_task(self._source_loop(source)))
                if self.stage.takes_over_at_start:
                    await self._take_over(tg)
                intake = [tg.create_task(self._consume_loop(tg, edge)) for edge in self.consumes]
                if self.consumes:
                    intake.append(tg.create_task(self._reclaim_loop(tg)))
                await self._stop.wait()
                # Drain: intake loops see the stop flag and return; in-flight handlers finish and ack.
                await asyncio.wait(intake) if intake else None
                unfinished: set[asyncio.Task] = set()
                if self._in_flight:
                    _done, unfinished = await asyncio.wait(set(self._in_flight), timeout=self.drain_timeout_s)
                    for task in unfinished:  # never ack what did not finish: it is redelivered later
                        task.cancel()
                for task in background:
                    task.cancel()
                if self._run_finished:
                    await self._release_all_held()
                elif not unfinished:  # a cancelled handler may still run in a thread: no last step then
                    await self._stage_drain()
        except BaseExceptionGroup as group:
            # Surface the first real error (a TransportError, a stage bug), not the TaskGroup wrapper.
            first = group.exceptions[0]
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from group
        finally:
            metrics.WORKER_UP.labels(*w).set(0)
            await self._release_leases()
            await self.stage.close()
            if server is not None:
                server.close()
        self.log.info("stopped", reason=self._stop_reason, held=len(self._held))
        return self.exit_code

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: finish in-flight work, ack, exit 0 (a second signal is not special)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, f"signal {sig.name}")

    # ------------------------------------------------------------------ loops

    async def _consume_loop(self, tg: asyncio.TaskGroup, edge: str) -> None:
        while not self._stop.is_set():
            _raise_if_cancelled()
            async with self._slots:  # fetch only what we can start handling now
                free = self._free_slots()  # counts the slot just acquired: it is not in flight yet
            # No slot is held while the read blocks: a stage with a second input edge (the advantage
            # stage's dead letters) would otherwise starve this one for block_ms at a time.
            count = min(free, self.batch_size)
            deliveries = await self.transport.consume(edge, self.group, self.worker_id, count, self.block_ms)
            if not deliveries:
                await self._idle()
                continue
            for delivery in deliveries:
                await self._slots.acquire()
                self._spawn(tg, delivery)

    async def _take_over(self, tg: asyncio.TaskGroup) -> None:
        """Claim every pending entry of the group now (``Stage.takes_over_at_start``), in one pass: nothing of
        this worker's is pending yet, and a second pass would claim its own held entries again."""
        for edge in self.consumes:
            reclaimed = await self.transport.reclaim(edge, self.group, self.worker_id, 0, TAKE_OVER_MAX)
            if reclaimed:
                self.log.info("took over a predecessor's pending entries", edge=edge, count=len(reclaimed))
            for delivery in reclaimed:
                await self._redeliver(tg, edge, delivery)

    async def _redeliver(self, tg: asyncio.TaskGroup, edge: str, delivery: Delivery) -> None:
        """Handle an entry claimed from another consumer, counted as a redelivery, once a slot is free."""
        metrics.REDELIVERIES.labels(*self._labels, edge).inc()
        await self._slots.acquire()
        self._spawn(tg, delivery)

    async def _reclaim_loop(self, tg: asyncio.TaskGroup) -> None:
        """Take over entries whose consumer died; keep our own held entries from looking dead."""
        interval = max(self.min_idle_ms / 3000, 0.05)
        while not self._stop.is_set():
            _raise_if_cancelled()
            try:
                await asyncio.wait_for(self._stop.wait(), timeout=interval)
                return
            except TimeoutError:
                pass
            # Held entries and entries still in handle() (a long rollout) must not look dead.
            by_edge: dict[str, list[str]] = defaultdict(list)
            for edge, entry_id in [*self._held.values(), *self._handling.values()]:
                by_edge[edge].append(entry_id)
            for edge, ids in by_edge.items():
                await self.transport.touch(edge, self.group, self.worker_id, ids)
            for edge in self.consumes:
                free = self._free_slots()
                if free <= 0:
                    continue
                reclaimed = await self.transport.reclaim(edge, self.group, self.worker_id, self.min_idle_ms, free)
                held_ids = {entry_id for e, entry_id in [*self._held.values(), *self._handling.values()] if e == edge}
                for delivery in reclaimed:
                    if delivery.id in held_ids:  # ours already; it only looked idle
                        continue
                    await self._redeliver(tg, edge, delivery)

    async def _fanout_loop(self, edge: str) -> None:
        cursor = "0"  # from the start: a late joiner must still see the newest weights
        while True:
            _raise_if_cancelled()
            deliveries = await self.transport.read(edge, cursor, 100, self.block_ms)
            for delivery in deliveries:
                cursor = delivery.id
                try:
                    record = decode(delivery.payload)
                except RecordError as exc:
                    self.log.warning("undecodable broadcast", edge=edge, id=delivery.id, error=str(exc))
                    continue
                outputs = await self.stage.on_broadcast(record, self.ctx)
                if outputs:
                    await self._produce(outputs)
            if deliveries:  # once per read: a stage behind on announcements sees them all before it acts
                await self._renew_leases(changed_only=True)  # e.g. the rollout now samples newer weights

    async def _source_loop(self, source: AsyncIterator[list[Emit] | Handled]) -> None:
        # A source yields a list of outputs, or a Handled whose ``release`` names held inputs to ack
        # together with its outputs (the feeder answers a held Feedback with its replacement prompt).
        async for item in source:
            if isinstance(item, Handled):
                await self._settle(*self._take_held(item.release), item.outputs)
            elif item:
                await self._produce(item)
            if self._stop.is_set():
                return
            _raise_if_cancelled()

    async def _heartbeat_loop(self) -> None:
        while True:
            _raise_if_cancelled()
            self._last_beat = time.monotonic()
            metrics.HEARTBEAT.labels(*self._labels).set(time.time())
            metrics.LAST_PROGRESS.labels(*self._labels).set(self._last_progress)
            metrics.HELD.labels(*self._labels).set(len(self._held))
            metrics.IN_FLIGHT.labels(*self._labels).set(len(self._in_flight))
            self.stage.sample_metrics()  # the stage's own gauges, same period
            await self._renew_leases()
            for edge in self.consumes:  # where work waits: depth, lag and pending of our inputs
                stats = await asyncio.wait_for(self.transport.stats(edge, self.group), self.io_timeout_s)
                metrics.QUEUE_DEPTH.labels(self.run_name, edge).set(stats.length)
                metrics.QUEUE_LAG.labels(self.run_name, edge).set(stats.lag)
                metrics.QUEUE_PENDING.labels(self.run_name, edge).set(stats.pending)
                metrics.QUEUE_OLDEST_PENDING.labels(self.run_name, edge).set(stats.oldest_pending_ms / 1000)
            await asyncio.sleep(1.0)  # a period, not a wait for something

    # ------------------------------------------------------------------ one record

    def _spawn(self, tg: asyncio.TaskGroup, delivery: Delivery) -> None:
        task = tg.create_task(self._process(delivery))
        self._in_flight.add(task)
        self._handling[task] = (delivery.edge, delivery.id)

        def done(t: asyncio.Task) -> None:
            self._in_flight.discard(t)
            self._handling.pop(t, None)
            self._slots.release()

        task.add_done_callback(done)

    async def _process(self, delivery: Delivery) -> None:
        w = self._labels
        metrics.RECORDS_IN.labels(*w, delivery.edge).inc()
        try:
            record = decode(delivery.payload)
        except RecordError as exc:
            await self._dead_letter(delivery, f"undecodable: {exc}", "undecodable")
            return
        for attempt in range(self.max_retries + 1):
            try:
                with metrics.HANDLE_SECONDS.labels(*w).time():
                    handled = await self.stage.handle(record, self.ctx)
                # An output that does not encode is the handler's error (retried, then dead-lettered),
                # not the worker's: encoding it later, outside this try, would crash the worker.
                outputs = self._encode(handled.outputs)
                break
            except FatalStageError:
                raise  # the stage cannot go on: fail the worker, leave the record pending
            except Exception as exc:  # noqa: BLE001 - any handler failure is retried, then dead-lettered
                if attempt == self.max_retries:
                    self.log.warning("dead-lettering", record_id=_rid(record), error=repr(exc))
                    await self._dead_letter(delivery, f"{type(exc).__name__}: {exc}", "handler_error")
                    return
                metrics.RECORDS_RETRIED.labels(*w).inc()
                await asyncio.sleep(self.retry_backoff_s * 2**attempt)  # backoff between attempts
        await self._commit(delivery, record, handled, outputs)

    async def _commit(
        self, delivery: Delivery, record: Any, handled: Handled, outputs: dict[str, list[bytes]]
    ) -> None:
        """Produce outputs and ack this input (unless held) plus released inputs, atomically per edge."""
        to_ack, acked = self._take_held(handled.release)
        if handled.hold:
            previous = self._held.get(record.record_id)
            if previous is not None and previous != (delivery.edge, delivery.id):
                # A second entry of a record already held (a producer retried after a lost reply): the
                # stage keeps one copy, so ack the older entry now; left unacked it would be reclaimed
                # over and over, and dead-lettered once it exceeded max_deliveries.
                to_ack[previous[0]].append(previous[1])
                acked.append(record.record_id)
            self._held[record.record_id] = (delivery.edge, delivery.id)
        else:
            to_ack[delivery.edge].append(delivery.id)
            acked.append(record.record_id)
        await self._settle(to_ack, acked, handled.outputs, outputs)

    def _take_held(self, record_ids: list[str]) -> tuple[dict[str, list[str]], list[str]]:
        """Held inputs to ack now, by edge, and their record ids (ids no longer held are skipped)."""
        to_ack: dict[str, list[str]] = defaultdict(list)
        acked: list[str] = []
        for record_id in record_ids:
            held = self._held.pop(record_id, None)
            if held is not None:
                to_ack[held[0]].append(held[1])
                acked.append(record_id)
        return to_ack, acked

    async def _settle(
        self,
        to_ack: dict[str, list[str]],
        acked: list[str],
        emits: list[Emit],
        outputs: dict[str, list[bytes]] | None = None,
        note: str = "",
    ) -> None:
        """Produce ``emits`` (``outputs``: already encoded) and ack ``to_ack`` in one atomic step per edge
        (outputs go with the first). ``acked``: the record ids behind ``to_ack``, for the ledger entry that
        goes with the outputs."""
        if outputs is None:
            outputs = self._encode(emits)
        # A lease that moved (a group finished, newer weights in use) is written before the outputs that
        # may lead the learner to its next snapshot clean-up, so it never waits for the next heartbeat.
        await self._renew_leases(changed_only=True)
        if self.ledger and (acked or emits):
            entry = ledgers.entry(self.name, self.worker_id, acked, emits, note)
            edge = ledger_edge(self.name)
            outputs = {**outputs, edge: [*outputs.get(edge, []), encode(entry)]}
        if not to_ack and self.ledger:  # outputs and their ledger entry in one atomic call
            await self.transport.ack(ledger_edge(self.name), self.group, [], outputs)
        elif not to_ack:  # the input is held and nothing is released: outputs (if any) go out alone
            for edge, payloads in outputs.items():
                await self.transport.produce(edge, payloads)
        first = True
        for edge, ids in to_ack.items():
            await self.transport.ack(edge, self.group, ids, outputs if first else None)
            metrics.RECORDS_ACKED.labels(*self._labels, edge).inc(len(ids))
            first = False
        for edge, payloads in outputs.items():
            metrics.RECORDS_OUT.labels(*self._labels, edge).inc(len(payloads))
        self._last_progress = time.time()

    async def _renew_leases(self, changed_only: bool = False) -> None:
        """Lease what the stage still uses (``stage.leases()``: name -> value) under this worker's id.
        The heartbeat renews every lease (its TTL); ``changed_only`` writes just the ones whose value moved."""
        for name, value in self.stage.leases().items():
            if changed_only and self._leased.get(name) == value:
                continue
            lease = self.transport.lease(name, self.worker_id, value, self.lease_ttl_ms)
            await asyncio.wait_for(lease, self.io_timeout_s)
            self._leased[name] = value

    async def _release_leases(self) -> None:
        for name in sorted(self._leased):
            try:
                await asyncio.wait_for(self.transport.release(name, self.worker_id), timeout=10)
            except (TransportError, TimeoutError) as exc:  # unreleased, it still expires after its ttl
                self.log.warning("lease not released", name=name, error=str(exc))
        self._leased.clear()

    async def _stage_drain(self) -> None:
        """The stage's ``drain`` hook, once in-flight work is done: its last outputs and the held inputs they
        cover (the learner checkpoints what it trained, so those groups are acked, not retrained)."""
        handled = await self.stage.drain(self.ctx)
        if handled.outputs or handled.release:
            await self._settle(*self._take_held(handled.release), handled.outputs)

    async def _release_all_held(self) -> None:
        count = len(self._held)
        if count:
            to_ack, acked = self._take_held(list(self._held))
            await self._settle(to_ack, acked, [], note=ledgers.RUN_FINISHED)
        self.log.info("released held inputs of the finished run", count=count)

    async def _produce(self, emits: list[Emit]) -> None:
        await self._settle({}, [], emits)

    async def _dead_letter(self, delivery: Delivery, error: str, reason: str) -> None:
        await self.transport.dead_letter(delivery.edge, self.group, delivery, error, f"{self.name}/{self.worker_id}")
        metrics.RECORDS_DEAD.labels(*self._labels, reason).inc()

    async def _idle(self) -> None:
        outputs = await self.stage.on_idle(self.ctx)
        if outputs:
            await self._produce(outputs)
        if self.burst and not self._in_flight and not self._held:
            self.request_stop("burst: input empty")

    # ------------------------------------------------------------------ helpers

    def _free_slots(self) -> int:
        return self.concurrency - len(self._in_flight)

    def health(self) -> dict[str, Any]:
        """/healthz: ready while the loop turns and no stop was asked; when it last made progress."""
        ready = time.monotonic() - self._last_beat < 30 and not self._stop.is_set()
        return {"ready": ready, "stage": self.name, "worker": self.worker_id, "last_progress": self._last_progress}

    @staticmethod
    def _encode(emits: list[Emit]) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = defaultdict(list)
        for edge, record in emits:
            out[edge].append(encode(record))
        return dict(out)


def _rid(record: Any) -> str:
    try:
        return record.record_id
    except Exception:  # noqa: BLE001 - only for a log line
        return "?"


async def run_together(workers: list[Worker], *, main: Worker | None = None) -> int:
    """The in-process runner: several stages on one (memory) transport in this event loop.

    When ``main`` (the learner) finishes, or any worker fails, every other worker is asked to stop and
    drains. Returns the first non-zero exit code, else 0.
    """
    tasks = {asyncio.create_task(w.serve(), name=w.name): w for w in workers}
    pending = set(tasks)
    code = 0
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            worker = tasks[task]
            if task.exception() is not None:
                code = code or 1
                for other in tasks.values():
                    other.request_stop(f"{worker.name} failed: {task.exception()!r}")
            elif main is None or worker is main:
                for other in tasks.values():
                    other.request_stop(f"{worker.name} finished", run_finished=True)
    for task in tasks:
        if (error := task.exception()) is not None:
            raise error
    return code
