"""The learner's side of weight sync: one ``Publisher`` per ``rollout.weight_transport``, chosen by ``publisher``.

The learner stage trains a generation batch, has the trainer write the version (a snapshot file when the
publisher ``writes_snapshots``), and hands it to ``publish``, which returns the ``WeightsPublished`` to emit,
or None when it goes out later through ``records`` (a broadcast round's members are still loading it):

- ``FilePublisher`` (``"file"``): the full-weights snapshot's path; the engines load it from a shared filesystem.
- ``LoraPublisher`` (``"lora"``): the adapter snapshot's path and, over Redis, the adapter as a blob too (a
  rollout host may not see the learner's output_dir), renewed while the learner waits for data.
- ``BroadcastPublisher`` (``"broadcast"``): no file; the learner is rank 0 of the weights group
  (``weights.membership.Coordinator``) and sends each version to every member in one round (``weights.sender``).

The stage calls only ``start``, ``publish``, ``records``, ``on_record``, ``on_idle``, ``close`` and reads
``subscribes`` (the edges it reads besides its input) and ``writes_snapshots``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config import Config
from data.media import ADAPTER_TTL_S, put_adapter
from pipeline.edges import WEIGHTS
from pipeline.errors import SetupError
from pipeline.records import WeightsPublished
from pipeline.stage import StageContext
from weights.membership import MEMBER_LEASE, SYNC_EDGE, Coordinator, advertised_address

if TYPE_CHECKING:
    from trainer.process import TrainerProcess
    from trainer.trainer import Trainer


class Publisher:
    """Snapshot files: the trainer writes each version under ``run.output_dir/weights``, the announcement
    names it. Subclasses change how the version travels."""

    subscribes: tuple[str, ...] = ()
    """Edges the learner reads besides its input (the weights group's records)."""
    writes_snapshots = True
    """Whether the trainer writes a snapshot file per version (``Trainer.publish``'s ``snapshot``)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    async def start(self, ctx: StageContext, trainer: Trainer | TrainerProcess) -> None:
        """Once ``trainer`` loaded the model."""

    async def publish(self, ctx: StageContext, version: int, path: Path | None, *, step: int, final: bool = False,
                      batches: int = 0) -> WeightsPublished | None:
        """The announcement of ``version`` (its snapshot at ``path``; ``step``, ``batches``: the trainer's
        optimizer steps and generation batches so far), or None when ``records`` sends it later."""
        return WeightsPublished(version=version, path=str(path), step=step, published_at=time.time(),
                                final=final, batches=batches, blob=await self._blob(ctx, path))

    async def records(self, restored: Awaitable[WeightsPublished | None] | None) -> AsyncIterator[list]:
        """The learner's source: the records this side produces outside a batch. ``restored``: the restored
        weights' announcement after a resume (awaited here, sent once)."""
        if restored is not None and (published := await restored) is not None:
            yield [(WEIGHTS, published)]

    async def on_record(self, record: Any) -> None:
        """A record from an edge in ``subscribes``."""

    async def on_idle(self, ctx: StageContext, version: int) -> None:
        """While no batch is being trained (``version``: the current one)."""

    def close(self) -> None:
        pass

    async def _blob(self, ctx: StageContext, path: Path | None) -> str:
        return ""


class FilePublisher(Publisher):
    """``rollout.weight_transport = "file"``: full-weights snapshots on a filesystem every engine reads."""


class LoraPublisher(Publisher):
    """``rollout.weight_transport = "lora"``: adapter snapshots; over Redis each one is also stored as a blob
    (a rollout host may not see output_dir), the newest renewed while the learner waits for data."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.blobs = cfg.transport.kind != "memory"
        self._adapter: tuple[str, bytes, float] | None = None  # the newest adapter's (key, bytes, when stored)

    async def _blob(self, ctx: StageContext, path: Path | None) -> str:
        """The adapter snapshot at ``path`` as a blob; its key ("" in one process)."""
        if not self.blobs or path is None:
            return ""
        key, data = await put_adapter(ctx, Path(path))
        self._adapter = (key, data, time.monotonic())
        return key

    async def on_idle(self, ctx: StageContext, version: int) -> None:
        """The newest adapter's blob is renewed, for a rollout worker that starts later."""
        if self._adapter is not None and time.monotonic() - self._adapter[2] > ADAPTER_TTL_S / 3:
            key, data, _ = self._adapter
            await ctx.put_blob(key, data, ADAPTER_TTL_S)
            self._adapter = (key, data, time.monotonic())


class BroadcastPublisher(Publisher):
    """``rollout.weight_transport = "broadcast"``: no snapshot; rank 0 of the weights group sends each version
    to every member in one round, and ``WeightsPublished`` says every member holds it."""

    subscribes = (SYNC_EDGE,)  # the members' registrations and answers
    writes_snapshots = False

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.coordinator: Coordinator | None = None  # set in start
        self._announcing: set[asyncio.Task] = set()  # announcements waiting for the members' loads

    async def start(self, ctx: StageContext, trainer: Trainer | TrainerProcess) -> None:
        """Rank 0's end of the weights group: the address it advertises, its sender (``trainer``'s weights),
        the coordinator."""
        from weights.sender import BroadcastSender, state_layout

        ro, t = self.cfg.rollout, self.cfg.transport
        try:
            address = await asyncio.to_thread(advertised_address, ro.weight_sync_address, t.kind, t.url)
        except OSError as exc:
            raise SetupError(f"weights group: no address to advertise to the rollout workers: {exc}") from None
        from trainer.trainer import Trainer

        if not isinstance(trainer, Trainer):  # (config refuses the pair; the sender reads the model here)
            raise SetupError('rollout.weight_transport = "broadcast" sends from the learner\'s own process: '
                             "set learner.own_process = false")
        model = trainer.model
        assert model is not None, "start() loads the model first"

        def weights() -> dict[str, Any]:
            state = trainer.weights_state()
            assert state is not None, "the stage runs on rank 0, which gets the whole weights"
            return state

        sender = BroadcastSender(
            weights, state_layout(model.state_dict()),
            chunk_bytes=max(1, int(ro.weight_sync_chunk_mb * 2**20)), timeout_s=ro.weight_sync_timeout_s,
            cuda=trainer.device.type == "cuda", bucket_bytes=int(ro.weight_sync_bucket_mb * 2**20),
        )
        newest = await ctx.newest(SYNC_EDGE)  # a restarted learner's epochs come after its predecessor's
        self.coordinator = Coordinator(
            sender, lambda: ctx.leases(MEMBER_LEASE), address=address, port=ro.weight_sync_port,
            timeout_s=ro.weight_sync_timeout_s, first_epoch=getattr(newest, "epoch", 0) + 1, run=ctx.run,
        )

    @property
    def _coordinator(self) -> Coordinator:
        assert self.coordinator is not None, "start() makes the coordinator"
        return self.coordinator

    async def publish(self, ctx: StageContext, version: int, path: Path | None, *, step: int, final: bool = False,
                      batches: int = 0) -> WeightsPublished | None:
        """One broadcast round of ``version``. Training goes on once every member received it; the
        announcement that they hold it goes out when they loaded it (returned at once when ``final``, or when
        there are no members; else None, ``records`` sends it)."""
        coordinator = self._coordinator
        result = await coordinator.publish(version, wait_loaded=final, final=final)
        published = WeightsPublished(version=version, path=f"broadcast://epoch/{result.epoch}", via="broadcast",
                                     epoch=result.epoch, step=step, published_at=time.time(), final=final,
                                     batches=batches)
        loaded = result.loaded
        if final or loaded is None or loaded.done():
            return published

        async def announce() -> None:
            await loaded
            coordinator.outbox.put_nowait((WEIGHTS, published))

        self._track(asyncio.create_task(announce()))
        return None

    async def records(self, restored: Awaitable[WeightsPublished | None] | None) -> AsyncIterator[list]:
        """The group's records, as the coordinator makes them; after a resume a new epoch sends the restored
        weights (``restored`` runs beside them: its round needs the members' answers this source carries)."""
        coordinator = self._coordinator
        if restored is not None:
            async def announce() -> None:
                if (published := await restored) is not None:
                    coordinator.outbox.put_nowait((WEIGHTS, published))

            self._track(asyncio.create_task(announce()))
        while True:
            yield [await coordinator.outbox.get()]

    def _track(self, task: asyncio.Task) -> None:
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    async def on_record(self, record: Any) -> None:
        if self.coordinator is not None:
            await self.coordinator.on_record(record)

    async def on_idle(self, ctx: StageContext, version: int) -> None:
        """A member that joined since the last round (a restarted rollout worker, one added to the run) gets
        the current version now, not only at the next."""
        if self.coordinator is not None and await self.coordinator.pending_joiners():
            await self.coordinator.publish(version)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.sender.close()


PUBLISHERS: dict[str, type[Publisher]] = {"file": FilePublisher, "lora": LoraPublisher, "broadcast": BroadcastPublisher}


def publisher(cfg: Config) -> Publisher:
    """The learner's publisher for ``rollout.weight_transport``."""
    return PUBLISHERS[str(cfg.rollout.weight_transport)](cfg)
