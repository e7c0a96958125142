"""One fake of ``pipeline.stage.StageContext`` for driving a stage without a worker (``stage.start(ctx)``,
``stage.handle(record, ctx)``), implementing the whole protocol, so no test carries its own subset."""

from __future__ import annotations

from typing import Any


class FakeContext:
    """The worker's side as a stage sees it: its ids; ``request_stop`` recorded in ``stops`` as
    (reason, run_finished); ``newest`` from ``newest={edge: record}``; ``leases`` from
    ``leased={name: {worker: value}}``; blobs in ``transport`` when one is given, else in a dict."""

    def __init__(self, run: str = "t", stage: str = "test", worker: str = "w0", *,
                 newest: dict[str, Any] | None = None, leased: dict[str, dict[str, int]] | None = None,
                 transport: Any = None) -> None:
        self.run, self.stage, self.worker = run, stage, worker
        self.stops: list[tuple[str, bool]] = []
        self.newest_records = dict(newest or {})
        self.leased = leased if leased is not None else {}
        self.transport = transport
        self.blobs: dict[str, bytes] = {}

    @property
    def stopping(self) -> bool:
        return bool(self.stops)

    @property
    def stop_reason(self) -> str:
        """The first stop's reason ("" while none was asked for)."""
        return self.stops[0][0] if self.stops else ""

    def request_stop(self, reason: str, *, run_finished: bool = False) -> None:
        self.stops.append((reason, run_finished))

    async def newest(self, edge: str) -> Any:
        return self.newest_records.get(edge)

    async def leases(self, name: str) -> dict[str, int]:
        return dict(self.leased.get(name, {}))

    async def put_blob(self, key: str, data: bytes, ttl_s: int) -> bool:
        if self.transport is not None:
            return await self.transport.put_blob(key, data, ttl_s)
        stored = key not in self.blobs
        self.blobs.setdefault(key, data)
        return stored

    async def get_blob(self, key: str) -> bytes | None:
        if self.transport is not None:
            return await self.transport.get_blob(key)
        return self.blobs.get(key)
