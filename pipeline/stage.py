"""What a stage is, as the worker runtime sees it.

A stage is a plain class with a pure-ish ``handle(record) -> Handled`` core. It never touches the
transport: the runtime (``pipeline/worker.py``) consumes, decodes, calls ``handle``, produces the
outputs and acks the input in one atomic step, retries, dead-letters and drains.

Optional hooks (looked up with ``getattr``, so a stage defines only what it needs):

- ``consumes: tuple[str, ...]`` — group edges it takes work from (each entry to one copy).
- ``subscribes: tuple[str, ...]`` — fan-out edges every copy reads (``weights``), fed to ``on_broadcast``.
- ``concurrency: int`` — how many records may be in ``handle`` at once (rollout batches across groups).
- ``async start(ctx)`` / ``async close()`` — acquire and release resources (an engine, a model).
- ``source(ctx)`` — an async iterator of output lists for stages that create work (the feeder).
- ``async on_broadcast(record, ctx) -> list[Emit]`` — a fan-out record arrived.
- ``async on_idle(ctx) -> list[Emit]`` — the input is momentarily empty (flush partial work).
- ``async drain(ctx) -> Handled`` — a stop that is not the run's end (SIGTERM), once in-flight work has
  finished: last outputs, and held inputs to ack with them (``release``); the rest stay pending.
- ``sample_metrics()`` — set the stage's own gauges; called by the worker's heartbeat, once a second.
- ``leases() -> dict[str, int]`` — what the stage still uses (``{"weights": oldest version in use}``); the
  heartbeat leases it under the worker's id with a ttl, released on exit (``ctx.leases(name)`` reads all).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pipeline.records import Record

Emit = tuple[str, "Record"]
"""An output: (edge name, record)."""


@dataclass(slots=True)
class Handled:
    """What ``handle`` decided for one input record.

    ``hold=True`` keeps the input unacked (pending, owned by this worker) because the stage buffers it
    until something else arrives (the advantage stage waits for a group's manifest). A later
    ``Handled`` lists its ``record_id`` in ``release`` so it is acked together with the outputs it
    contributed to: a crash in between redelivers it instead of losing it.
    """

    outputs: list[Emit] = field(default_factory=list)
    hold: bool = False
    release: list[str] = field(default_factory=list)


class StageContext(Protocol):
    """What the runtime offers a stage."""

    run: str
    stage: str
    worker: str

    def request_stop(self, reason: str, *, run_finished: bool = False) -> None:
        """Finish in-flight work, ack, and exit. ``run_finished`` also acks inputs held for work the
        finished run no longer needs."""

    @property
    def stopping(self) -> bool: ...

    async def leases(self, name: str) -> dict[str, int]:
        """Every live worker's lease under ``name``: worker id -> value (see the ``leases`` hook)."""

    async def put_blob(self, key: str, data: bytes, ttl_s: int) -> bool:
        """Store bulk bytes (images) once under their content key; True when this call stored them."""

    async def get_blob(self, key: str) -> bytes | None:
        """The bytes under a content key, or None."""


class FatalStageError(RuntimeError):
    """Raised by ``handle`` when the stage must not go on and a retry cannot help (the learner after
    repeated NaN steps): the worker neither retries nor dead-letters the record (it stays pending) but
    fails, and the in-process runner then stops every stage."""


class Stage(Protocol):
    name: str

    async def handle(self, record: Any, ctx: StageContext) -> Handled: ...


def stop_when_run_finished(record: Any, ctx: StageContext) -> bool:
    """On the final ``WeightsPublished`` every worker drains and exits, acking inputs the run no
    longer needs. Returns True when it asked to stop."""
    if getattr(record, "final", False):
        ctx.request_stop(f"run finished at version {record.version}", run_finished=True)
        return True
    return False


def same_error(exc: BaseException) -> Hashable:
    """Errors are the same when their type and text match up to numbers (request ids, counts)."""
    return type(exc).__name__, re.sub(r"\d+", "#", str(exc))


class ErrorStreak:
    """The same error on consecutive groups, for ``run.max_consecutive_errors``: a group's retries count once;
    any success, or another error, starts over. ``key`` says which errors are the same."""

    def __init__(self, limit: int, key: Callable[[BaseException], Hashable] = same_error) -> None:
        self.limit = limit
        self._key_of = key
        self._key: Hashable | None = None
        self._groups: set[str] = set()

    @property
    def count(self) -> int:
        """Consecutive groups that failed the same way so far."""
        return len(self._groups)

    def failed(self, group_id: str, exc: BaseException) -> bool:
        """Count ``exc`` for ``group_id``; True once ``limit`` consecutive groups failed the same way."""
        key = self._key_of(exc)
        if key != self._key:
            self._key, self._groups = key, set()
        self._groups.add(group_id)
        return len(self._groups) >= self.limit

    def succeeded(self) -> None:
        self._key, self._groups = None, set()
