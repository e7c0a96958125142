"""The one Transport protocol every edge goes through. Both implementations pass tests/test_transport_contract.py.

Semantics (identical for ``memory`` and ``redis``):
- An *edge* is a named append-only stream (``prompts``, ``trajectories``, ...). ``produce`` appends.
- *Group* edges are shared by a consumer group: each entry goes to one consumer, stays *pending* until
  acked, and is redelivered (``reclaim``) to another consumer when it has been idle longer than
  ``min_idle_ms`` (its consumer died). Every delivery increments the entry's delivery counter.
- ``ack`` acks inputs and appends outputs atomically (Redis MULTI/EXEC): a crash between the two can
  neither lose an output nor ack an input whose outputs were not written.
- An entry delivered more than ``max_deliveries`` times is moved to the ``dead`` edge as a
  ``DeadLetter`` (payload, error, origin) and acked, so poison never blocks good records.
- *Fan-out* edges (``weights``) are read by every reader from its own cursor (``read``), not a group.
- *Leases* are the run's small shared state about who still uses what: a holder (a worker id) keeps an
  integer under a name (``weights``: the oldest weights version it still samples with) for ``ttl_ms``,
  renewing it from its heartbeat; a holder that dies stops renewing and its lease expires.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline.errors import UserError
from pipeline.records import DeadLetter, RecordError, decode

DEAD_EDGE = "dead"
LEDGER_EDGE_PREFIX = "ledger."


def ledger_edge(stage: str) -> str:
    """The edge a stage's ledger entries go to (``run.ledger``): ``rollstream:{run}:ledger.<stage>`` on Redis.
    No consumer group reads it, so nothing ever trims it; the memory transport leaves it unbounded."""
    return LEDGER_EDGE_PREFIX + stage


def is_unbounded(edge: str) -> bool:
    """Edges a bound must never stall: dead-lettering and the ledger (nobody acks them, nothing trims them)."""
    return edge == DEAD_EDGE or edge.startswith(LEDGER_EDGE_PREFIX)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One entry handed to a consumer."""

    edge: str
    id: str  # entry id, e.g. Redis "1700000000000-0"
    payload: bytes
    deliveries: int = 1  # how many times it has been delivered, this time included


def dead_letter_for(delivery: Delivery, error: str, *, stage: str, worker: str, deliveries: int) -> DeadLetter:
    """The record that keeps a poison entry on the dead edge: its raw payload, why, and where from."""
    return DeadLetter(
        edge=delivery.edge,
        entry_id=delivery.id,
        payload=delivery.payload,
        error=error,
        stage=stage,
        worker=worker,
        deliveries=deliveries,
    )


@dataclass(slots=True)
class EdgeStats:
    """Depth and lag of one edge for one consumer group (what metrics and `rollstream top` show)."""

    edge: str
    length: int  # entries in the stream
    pending: int = 0  # delivered, not acked
    lag: int = 0  # not yet delivered to the group
    oldest_pending_ms: int = 0  # idle time of the oldest pending entry
    consumers: dict[str, int] = field(default_factory=dict)  # consumer -> pending


@runtime_checkable
class Transport(Protocol):
    max_deliveries: int

    async def produce(self, edge: str, payloads: list[bytes]) -> list[str]:
        """Append payloads to an edge; returns their entry ids."""
        ...

    async def consume(
        self, edge: str, group: str, consumer: str, count: int, block_ms: int
    ) -> list[Delivery]:
        """New entries for this group (creating it at the stream start if needed), up to ``count``,
        waiting at most ``block_ms`` for the first one. Entries exceeding ``max_deliveries`` never
        come back here: they are dead-lettered by ``reclaim``."""
        ...

    async def ack(
        self, edge: str, group: str, ids: list[str], outputs: dict[str, list[bytes]] | None = None
    ) -> None:
        """Atomically append ``outputs`` (edge -> payloads) and ack ``ids`` on ``edge``."""

    async def reclaim(
        self, edge: str, group: str, consumer: str, min_idle_ms: int, count: int
    ) -> list[Delivery]:
        """Take over entries pending longer than ``min_idle_ms`` (their consumer died) for ``consumer``.
        Those already delivered ``max_deliveries`` times are dead-lettered and acked instead."""
        ...

    async def touch(self, edge: str, group: str, consumer: str, ids: list[str]) -> None:
        """Reset the idle time of entries this consumer still holds, so a live holder is not reclaimed."""

    async def dead_letter(self, edge: str, group: str, delivery: Delivery, error: str, origin: str) -> None:
        """Move one entry to the dead edge with its error and origin (stage/worker), and ack it."""

    async def read(self, edge: str, after: str, count: int, block_ms: int) -> list[Delivery]:
        """Fan-out read: entries after id ``after`` ("0" for the start, "$" for only new ones)."""
        ...

    async def last_id(self, edge: str) -> str:
        """The id of the newest entry on an edge ("0" when empty), to start a fan-out read after it."""
        ...

    async def stats(self, edge: str, group: str | None = None) -> EdgeStats:
        """Length, pending, lag and oldest pending age of an edge (for one group)."""
        ...

    async def trim_acked(self, edge: str) -> int:
        """Drop entries every group has acked (never an unacked one, never the newest: a restarted
        producer reads where it left off from it); returns how many."""
        ...

    async def lease(self, name: str, holder: str, value: int, ttl_ms: int) -> None:
        """Hold ``value`` under ``name`` for ``holder`` until ``ttl_ms`` from now (call again to renew)."""

    async def leases(self, name: str) -> dict[str, int]:
        """The unexpired leases under ``name``: holder -> value (expired ones are dropped)."""
        ...

    async def release(self, name: str, holder: str) -> None:
        """Drop ``holder``'s lease under ``name`` now (a clean exit; a dead holder's expires instead)."""

    async def delete_run(self) -> int:
        """Delete every edge of this run (``rollstream reset``); returns how many there were."""
        ...

    async def put_blob(self, key: str, data: bytes, ttl_s: int) -> bool:
        """Store ``data`` under the content key ``key`` unless it is there (then only its TTL is renewed);
        True when this call stored it. Bulk data (images) crosses the transport once this way, records carry
        the key (``data/media.py``). Redis: ``rollstream:{run}:blob:{key}`` with a TTL; memory: a dict."""
        ...

    async def get_blob(self, key: str) -> bytes | None:
        """The bytes stored under ``key``; None when absent (never stored, or expired)."""
        ...

    async def close(self) -> None: ...


class TransportError(UserError, RuntimeError):
    """The transport cannot be used (unreachable server, refused credentials): a one-line message with the fix."""


def parse_id(entry_id: str) -> tuple[int, int]:
    """ "<ms>-<seq>" -> (ms, seq), for comparing entry ids. A bare "<ms>" means "<ms>-0", as in Redis."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def id_before(entry_id: str) -> str:
    """The greatest id smaller than ``entry_id``: reading after it returns that entry first."""
    ms, _, seq = entry_id.partition("-")
    if seq and int(seq) > 0:
        return f"{ms}-{int(seq) - 1}"
    return f"{int(ms) - 1}-18446744073709551615" if int(ms) > 0 else "0"


def exceeded_max_deliveries(deliveries: int, max_deliveries: int) -> str:
    """The error of an entry dead-lettered by ``reclaim`` (the same text on every transport)."""
    return (
        f"exceeded max_deliveries={max_deliveries}: delivered {deliveries} times and never acked "
        "(its consumers crashed or timed out on it)"
    )


async def newest_payload(transport: Transport, edge: str) -> bytes | None:
    """The payload of the newest entry on ``edge`` (``trim_acked`` always keeps it), None if there is none."""
    last = await transport.last_id(edge)
    if last == "0":
        return None
    entries = await transport.read(edge, id_before(last), 1, 0)
    return entries[0].payload if entries else None


async def newest_record(transport: Transport, edge: str) -> Any:
    """The newest entry on ``edge`` decoded (None when the edge is empty or it is not a record: the
    consuming workers judge that, not a reader looking for where a producer left off)."""
    payload = await newest_payload(transport, edge)
    if payload is None:
        return None
    try:
        return decode(payload)
    except RecordError:
        return None
