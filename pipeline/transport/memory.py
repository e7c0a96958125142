"""The embedded transport: Redis Streams semantics in one asyncio event loop, no server.

Same contract as ``redis`` (tests/test_transport_contract.py runs both): entry ids "<ms>-<seq>",
consumer groups with pending entries and delivery counts, reclaim by idle time, touch, dead letters,
fan-out reads from a cursor, stats, trim_acked.

Bounded: an edge holds at most ``maxlen`` entries. When it is full, acked entries are trimmed to make
room; when every entry it holds is unacked, ``produce`` (and ``ack`` with outputs) waits for an ack
instead of dropping anything. The dead edge and the ledger edges are exempt: they must never stall a stage.
Waiting is on an ``asyncio.Event`` per edge, never a sleep loop.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field

from pipeline.records import encode
from pipeline.transport.base import (
    DEAD_EDGE,
    Delivery,
    EdgeStats,
    dead_letter_for,
    exceeded_max_deliveries,
    is_unbounded,
    parse_id,
)


@dataclass(slots=True)
class _Pending:
    index: int  # absolute position: how many entries were ever appended to the edge before it
    consumer: str
    deliveries: int
    delivered_at: float  # time.monotonic() of the last delivery or touch


@dataclass(slots=True)
class _Group:
    next_index: int  # absolute position of the first entry not yet delivered to this group
    # Insertion order is delivery order, which is id order (consume hands out entries in order and
    # reclaim/touch mutate in place), so the first value is the oldest pending entry.
    pending: dict[str, _Pending] = field(default_factory=dict)

    def first_unacked(self) -> int:
        """Absolute position below which this group has acked everything."""
        for oldest in self.pending.values():
            return oldest.index
        return self.next_index


class _Edge:
    """One stream. Entries live in parallel lists; ``first_index`` is the absolute position of ids[0]."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.keys: list[tuple[int, int]] = []  # parsed ids, for bisecting fan-out cursors
        self.payloads: list[bytes] = []
        self.first_index = 0
        self.last_key = (0, 0)
        self.groups: dict[str, _Group] = {}
        self._changed = asyncio.Event()

    @property
    def end_index(self) -> int:
        return self.first_index + len(self.ids)

    def append(self, payload: bytes) -> str:
        # As Redis: the wall-clock millisecond, and a sequence number when the clock has not moved on.
        now_ms = int(time.time() * 1000)
        last_ms, last_seq = self.last_key
        key = (now_ms, 0) if now_ms > last_ms else (last_ms, last_seq + 1)
        entry_id = f"{key[0]}-{key[1]}"
        self.ids.append(entry_id)
        self.keys.append(key)
        self.payloads.append(payload)
        self.last_key = key
        return entry_id

    def payload_at(self, index: int) -> bytes:
        return self.payloads[index - self.first_index]

    def trim_acked(self) -> int:
        """Drop the prefix every group has acked. No groups: nobody has acked anything, keep all."""
        if not self.groups:
            return 0
        # Never the newest entry: a restarted producer reads where it left off from it.
        bound = min(min(group.first_unacked() for group in self.groups.values()), self.end_index - 1)
        count = bound - self.first_index
        if count <= 0:
            return 0
        del self.ids[:count], self.keys[:count], self.payloads[:count]
        self.first_index = bound
        self.notify()
        return count

    def notify(self) -> None:
        """Wake everyone waiting on this edge (new entries, acks, trims): they re-check their condition."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout_s: float | None) -> bool:
        """Wait for the next change; False on timeout."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
            return True
        except TimeoutError:
            return False


class MemoryTransport:
    """In-process transport for ``rollstream train`` and unit tests; see the module docstring."""

    def __init__(self, max_deliveries: int = 5, maxlen: int = 10_000) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be at least 1, got {maxlen}")
        self.max_deliveries = max_deliveries
        self.maxlen = maxlen
        self._edges: dict[str, _Edge] = {}
        self._leases: dict[str, dict[str, tuple[int, float]]] = {}  # name -> holder -> (value, expires at)
        self._blobs: dict[str, bytes] = {}  # content key -> bytes (images); they live as long as the run
        self.blobs_stored = 0  # put_blob calls that stored new bytes (the rest found them there)

    def _edge(self, edge: str) -> _Edge:
        found = self._edges.get(edge)
        if found is None:
            found = self._edges[edge] = _Edge()
        return found

    # ------------------------------------------------------------------ produce / consume / ack

    async def produce(self, edge: str, payloads: list[bytes]) -> list[str]:
        stream = self._edge(edge)
        ids: list[str] = []
        for payload in payloads:
            while not self._has_room(edge, stream, 1):
                stream.notify()  # let consumers see what this batch appended so far, or they cannot ack it
                await stream.wait_changed(None)
            ids.append(stream.append(payload))
        stream.notify()
        return ids

    async def consume(
        self, edge: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[Delivery]:
        stream = self._edge(edge)
        state = stream.groups.get(group)
        if state is None:  # created at the stream start, as XGROUP CREATE ... 0
            state = stream.groups[group] = _Group(next_index=stream.first_index)
        deadline = time.monotonic() + block_ms / 1000
        while stream.end_index <= state.next_index:
            remaining = deadline - time.monotonic()
            if block_ms <= 0 or remaining <= 0 or not await stream.wait_changed(remaining):
                return []
        now = time.monotonic()
        start = state.next_index
        stop = min(stream.end_index, start + max(1, count))
        deliveries = []
        for index in range(start, stop):
            entry_id = stream.ids[index - stream.first_index]
            state.pending[entry_id] = _Pending(index, consumer, 1, now)
            deliveries.append(Delivery(edge, entry_id, stream.payload_at(index), 1))
        state.next_index = stop
        return deliveries

    async def ack(
        self, edge: str, group: str, ids: list[str], outputs: dict[str, list[bytes]] | None = None
    ) -> None:
        outputs = {out_edge: payloads for out_edge, payloads in (outputs or {}).items() if payloads}
        await self._wait_for_room(outputs)
        # From here on nothing awaits: the outputs and the acks happen together or not at all.
        for out_edge, payloads in outputs.items():
            out_stream = self._edge(out_edge)
            for payload in payloads:
                out_stream.append(payload)
            out_stream.notify()
        stream = self._edge(edge)
        state = stream.groups.get(group)
        if state is not None and ids:
            for entry_id in ids:
                state.pending.pop(entry_id, None)
            stream.notify()

    # ------------------------------------------------------------------ redelivery

    async def reclaim(
        self, edge: str, group: str, consumer: str, min_idle_ms: int, count: int
    ) -> list[Delivery]:
        stream = self._edge(edge)
        state = stream.groups.get(group)
        if state is None:
            return []
        now = time.monotonic()
        claimed: list[Delivery] = []
        dead: list[Delivery] = []
        for entry_id, pending in state.pending.items():
            if len(claimed) + len(dead) >= count:
                break
            if (now - pending.delivered_at) * 1000 < min_idle_ms:
                continue
            # As XAUTOCLAIM: the entry changes owner and its delivery counter goes up.
            pending.consumer = consumer
            pending.deliveries += 1
            pending.delivered_at = now
            delivery = Delivery(edge, entry_id, stream.payload_at(pending.index), pending.deliveries)
            (dead if pending.deliveries > self.max_deliveries else claimed).append(delivery)
        for delivery in dead:
            handed_out = delivery.deliveries - 1  # this last claim was never handed to anyone
            error = exceeded_max_deliveries(handed_out, self.max_deliveries)
            self._move_to_dead(edge, delivery, error, stage=group, worker=consumer, deliveries=handed_out)
            del state.pending[delivery.id]
        if dead:
            stream.notify()
        return claimed

    async def touch(self, edge: str, group: str, consumer: str, ids: list[str]) -> None:
        state = self._edge(edge).groups.get(group)
        if state is None:
            return
        now = time.monotonic()
        for entry_id in ids:
            pending = state.pending.get(entry_id)
            # Only its holder may touch it: a slow worker never takes back an entry someone reclaimed.
            if pending is not None and pending.consumer == consumer:
                pending.delivered_at = now

    async def dead_letter(self, edge: str, group: str, delivery: Delivery, error: str, origin: str) -> None:
        stage, _, worker = origin.partition("/")
        self._move_to_dead(edge, delivery, error, stage=stage, worker=worker, deliveries=delivery.deliveries)
        stream = self._edge(edge)
        state = stream.groups.get(group)
        if state is not None and state.pending.pop(delivery.id, None) is not None:
            stream.notify()

    def _move_to_dead(
        self, edge: str, delivery: Delivery, error: str, *, stage: str, worker: str, deliveries: int
    ) -> None:
        letter = dead_letter_for(delivery, error, stage=stage, worker=worker, deliveries=deliveries)
        dead = self._edge(DEAD_EDGE)
        dead.append(encode(letter))  # unbounded on purpose: see the module docstring
        dead.notify()

    # ------------------------------------------------------------------ fan-out

    async def read(self, edge: str, after: str, count: int, block_ms: int) -> list[Delivery]:
        stream = self._edge(edge)
        after_key = stream.last_key if after == "$" else parse_id(after)
        deadline = time.monotonic() + block_ms / 1000
        while True:
            start = bisect.bisect_right(stream.keys, after_key)
            if start < len(stream.ids):
                stop = min(len(stream.ids), start + max(1, count))
                return [Delivery(edge, stream.ids[i], stream.payloads[i], 1) for i in range(start, stop)]
            remaining = deadline - time.monotonic()
            if block_ms <= 0 or remaining <= 0 or not await stream.wait_changed(remaining):
                return []

    async def last_id(self, edge: str) -> str:
        stream = self._edges.get(edge)
        return stream.ids[-1] if stream is not None and stream.ids else "0"

    # ------------------------------------------------------------------ inspection and upkeep

    async def stats(self, edge: str, group: str | None = None) -> EdgeStats:
        stream = self._edges.get(edge)
        if stream is None:
            return EdgeStats(edge=edge, length=0)
        length = len(stream.ids)
        if group is None:
            return EdgeStats(edge=edge, length=length)
        state = stream.groups.get(group)
        if state is None:  # not created yet: it will start at the stream start
            return EdgeStats(edge=edge, length=length, lag=length)
        consumers: dict[str, int] = {}
        for pending in state.pending.values():
            consumers[pending.consumer] = consumers.get(pending.consumer, 0) + 1
        oldest_ms = 0
        for oldest in state.pending.values():  # the lowest id, as XPENDING - + 1
            oldest_ms = int((time.monotonic() - oldest.delivered_at) * 1000)
            break
        return EdgeStats(
            edge=edge,
            length=length,
            pending=len(state.pending),
            lag=stream.end_index - state.next_index,
            oldest_pending_ms=oldest_ms,
            consumers=consumers,
        )

    async def trim_acked(self, edge: str) -> int:
        stream = self._edges.get(edge)
        return stream.trim_acked() if stream is not None else 0

    async def delete_run(self) -> int:
        """Forget every edge of this run (``rollstream reset``); returns how many there were."""
        removed = len(self._edges)
        for stream in self._edges.values():
            stream.notify()
        self._edges.clear()
        self._leases.clear()
        return removed

    # ------------------------------------------------------------------ leases

    async def lease(self, name: str, holder: str, value: int, ttl_ms: int) -> None:
        self._leases.setdefault(name, {})[holder] = (int(value), time.monotonic() + ttl_ms / 1000)

    async def leases(self, name: str) -> dict[str, int]:
        held = self._leases.get(name, {})
        now = time.monotonic()
        for holder in [h for h, (_, expires) in held.items() if expires <= now]:
            del held[holder]
        return {holder: value for holder, (value, _) in held.items()}

    async def release(self, name: str, holder: str) -> None:
        self._leases.get(name, {}).pop(holder, None)

    async def put_blob(self, key: str, data: bytes, ttl_s: int) -> bool:
        if key in self._blobs:
            return False
        self._blobs[key] = bytes(data)
        self.blobs_stored += 1
        return True

    async def get_blob(self, key: str) -> bytes | None:
        return self._blobs.get(key)

    async def close(self) -> None:
        return None

    # ------------------------------------------------------------------ bounds

    def _has_room(self, edge: str, stream: _Edge, count: int) -> bool:
        if is_unbounded(edge):
            return True
        # A batch larger than the bound needs an edge holding only its newest entry, then goes in.
        needed = min(count, self.maxlen - 1)
        if len(stream.ids) + needed <= self.maxlen:
            return True
        stream.trim_acked()
        return len(stream.ids) + needed <= self.maxlen

    async def _wait_for_room(self, outputs: dict[str, list[bytes]]) -> None:
        """Wait until every output edge has room for its payloads at the same moment."""
        while True:
            full = [
                edge
                for edge, payloads in outputs.items()
                if not self._has_room(edge, self._edge(edge), len(payloads))
            ]
            if not full:
                return
            await self._edge(full[0]).wait_changed(None)
