"""What a stage is, as the worker runtime sees it.

A stage subclasses ``Stage`` and writes ``handle(record, ctx) -> Handled``, its core. It never touches the
transport: the runtime (``pipeline/worker.py``) consumes, decodes, calls ``handle``, produces the
outputs and acks the input in one atomic step, retries, dead-letters and drains.

Every other hook is declared on ``Stage`` with a documented default that does nothing, so a stage
overrides only what it needs and the runtime calls each hook without probing for it: ``consumes``,
``subscribes`` and ``concurrency`` (set by the class or its constructor, fixed from then on), ``start`` and
``close``, ``source``, ``on_broadcast``, ``on_idle``, ``drain``, ``sample_metrics`` and ``leases``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Hashable
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

    @property
    def run(self) -> str: ...

    @property
    def stage(self) -> str: ...

    @property
    def worker(self) -> str: ...

    def request_stop(self, reason: str, *, run_finished: bool = False) -> None:
        """Finish in-flight work, ack, and exit. ``run_finished`` also acks inputs held for work the
        finished run no longer needs."""

    @property
    def stopping(self) -> bool: ...

    async def newest(self, edge: str) -> Any:
        """The newest record on ``edge`` (None when it is empty or holds no record): where a producer that
        starts again left off (the feeder's last prompt, the learner's last weights)."""
        ...

    async def leases(self, name: str) -> dict[str, int]:
        """Every live worker's lease under ``name``: worker id -> value (see the ``leases`` hook)."""
        ...

    async def put_blob(self, key: str, data: bytes, ttl_s: int) -> bool:
        """Store bulk bytes (images) once under their content key; True when this call stored them."""
        ...

    async def get_blob(self, key: str) -> bytes | None:
        """The bytes under a content key, or None."""
        ...


class FatalStageError(RuntimeError):
    """Raised by ``handle`` when the stage must not go on and a retry cannot help (the learner after
    repeated NaN steps): the worker neither retries nor dead-letters the record (it stays pending) but
    fails, and the in-process runner then stops every stage."""


class Stage:
    """The base of every stage: ``name`` and ``handle``, and each optional hook with a default that does
    nothing. The worker calls ``handle`` for each record of the edges in ``consumes``."""

    name: str
    consumes: tuple[str, ...] = ()
    """Group edges it takes work from: each entry goes to one copy of the stage."""
    subscribes: tuple[str, ...] = ()
    """Fan-out edges every copy reads (``weights``), each record given to ``on_broadcast``."""
    concurrency: int = 1
    """How many records may be in ``handle`` at once (rollout batches across groups)."""
    takes_over_at_start: bool = False
    """Every pending entry of its group is a dead predecessor's once ``start`` returns (a resumed learner, the
    one consumer of its group): the worker claims them all before it consumes, instead of after
    ``transport.min_idle_ms``, which a run ending sooner would never reach."""

    async def handle(self, record: Any, ctx: StageContext) -> Handled:
        """One record of a ``consumes`` edge: the outputs, and whether the input is held."""
        raise NotImplementedError(f"{type(self).__name__} consumes {self.consumes} but has no handle()")

    async def start(self, ctx: StageContext) -> None:
        """Acquire resources (an engine, a model) before the first record."""

    async def close(self) -> None:
        """Release them, after the last record (also after a failure)."""

    def source(self, ctx: StageContext) -> AsyncIterator[list[Emit] | Handled] | None:
        """For a stage that creates work (the feeder): an async iterator of output lists, or of ``Handled``
        whose ``release`` names held inputs to ack with its outputs. None: the stage creates nothing."""
        return None

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list[Emit]:
        """A record of a ``subscribes`` edge arrived (every copy sees every one)."""
        return []

    async def on_idle(self, ctx: StageContext) -> list[Emit]:
        """The input is momentarily empty: flush partial work."""
        return []

    async def drain(self, ctx: StageContext) -> Handled:
        """A stop that is not the run's end (SIGTERM), once in-flight work has finished: last outputs, and
        held inputs to ack with them (``release``); the rest stay pending for a successor."""
        return Handled()

    def sample_metrics(self) -> None:
        """Set the stage's own gauges; the worker's heartbeat calls it once a second."""

    def leases(self) -> dict[str, int]:
        """What the stage still uses (``{"weights": oldest version in use}``): the heartbeat leases it under
        the worker's id with a ttl, released on exit (``ctx.leases(name)`` reads every worker's)."""
        return {}


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
