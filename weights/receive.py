"""The engine's side of weight sync: one ``Receiver`` per ``rollout.weight_transport``, chosen by ``receiver``,
used by the rollout and the evaluate stage alike.

- ``FileReceiver`` (``"file"``): a ``WeightsPublished`` names a snapshot; ``receive`` waits for it to be visible
  (a shared filesystem may show it a moment late), and loads it under ``rollout.weight_load`` (how the engine
  pauses). A snapshot the learner collected means a newer announcement follows.
- ``LoraReceiver`` (``"lora"``): the same, for an adapter (over Redis one this host cannot see is fetched
  from its blob); the engine must be LoRA-enabled with a large enough rank.
- ``BroadcastReceiver`` (``"broadcast"``): the worker is a member of the learner's weights group
  (``weights.membership.Member``): the engine receives each version in a round and loads it there; the
  announcement that follows only says every member holds it.

The stages call ``bind``, ``start``, ``receive`` (``load``: a snapshot whatever the transport, as an evaluation of
saved weights needs), ``records``, ``on_record``, ``check``, ``leases`` and read ``subscribes``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from config import Config, vllm_max_lora_rank
from data.media import MediaError, readable_here
from engines.base import EngineBase
from engines.server_engine import ServerEngine
from pipeline import log, metrics
from pipeline.edges import WEIGHTS
from pipeline.errors import SetupError
from pipeline.records import WeightsPublished, WeightsRound
from pipeline.stage import FatalStageError, StageContext
from weights.membership import MEMBER_LEASE, SYNC_EDGE, Member

SNAPSHOT_VISIBLE_S = 5.0  # a shared filesystem may show a renamed directory a moment late (NFS attribute cache)


class WeightsUnavailable(SetupError, FatalStageError):
    """This worker cannot get the learner's weights (a snapshot it cannot see, an unreachable learner):
    nothing it retries can fix that, so it fails with the reason and the fix."""


class Receiver:
    """Snapshot files: each announced version is loaded from the path it names. ``labels``: the worker's
    (run, stage, worker); ``role``: "rollout", or "eval" for an evaluate worker's own engine."""

    subscribes: tuple[str, ...] = ()
    """Edges the stage reads besides ``weights`` (the weights group's records)."""
    joins_group = False
    """Whether the engine is a member of the learner's weights group (receives versions in rounds)."""

    def __init__(self, cfg: Config, *, role: str = "rollout",
                 wants: Callable[[WeightsRound], Awaitable[bool]] | None = None) -> None:
        self.cfg = cfg
        self.role = role
        self.wants = wants  # the weights group: whether this engine loads a round's version (eval: due ones)
        self.engine: EngineBase | None = None
        self.labels: tuple[str, str, str] = (cfg.run.name, role, "-")
        self.member: Member | None = None

    @property
    def _engine(self) -> EngineBase:
        assert self.engine is not None, "bind() first"
        return self.engine

    def bind(self, engine: EngineBase, labels: tuple[str, str, str]) -> None:
        """The engine the weights go to, and the worker's (run, stage, worker) labels."""
        self.engine, self.labels = engine, labels

    async def start(self, ctx: StageContext) -> None:
        """Before the stage reads any record (once bound): check the engine can take this mode's weights."""

    async def receive(self, record: WeightsPublished, ctx: StageContext | None) -> float | None:
        """Make the engine hold the announced version (``ctx``: where an adapter blob is fetched from; None
        offline). Returns the load's seconds (0.0: nothing to load), or None when it cannot any more and a
        newer announcement follows (the learner collected the snapshot, or the adapter expired after a newer one)."""
        if record.via == "broadcast":
            raise self._mismatch(record)
        return await self.load(record, ctx)

    def _mismatch(self, record: WeightsPublished) -> WeightsUnavailable:
        return WeightsUnavailable(
            f"weights version {record.version} comes by {record.via}, but this {self.role} worker has "
            f"rollout.weight_transport = {self.cfg.rollout.weight_transport!r}: run every worker with the same config"
        )

    async def load(self, record: WeightsPublished, ctx: StageContext | None) -> float | None:
        """Load the snapshot a file announcement names, whatever this receiver's transport (an evaluation of
        saved weights loads one under broadcast too); ``receive``'s returns. Over Redis a LoRA adapter this
        host cannot see is fetched from its blob."""
        engine = self._engine
        if record.version > engine.version:
            try:
                record = await readable_here(ctx, record) if ctx is not None else record
            except MediaError:
                newest = await ctx.newest(WEIGHTS) if ctx is not None else None
                if isinstance(newest, WeightsPublished) and newest.version > record.version:
                    return None  # the adapter expired after a newer one was published: that announcement follows
                raise
        if record.version > engine.version and not await self._visible(record):
            return None  # collected after a newer snapshot was published: that newer message follows
        try:
            seconds = await engine.load_weights(record.path, record.version, mode=self.cfg.rollout.weight_load)
        except Exception:
            if Path(record.path).exists() or not self._collected(record):
                raise
            # Collected while this worker (not leasing it yet: it just started) was loading it: the learner
            # deletes a snapshot only once it published a newer one, whose message follows.
            return None
        if seconds:
            metrics.WEIGHT_SYNC_SECONDS.labels(*self.labels).observe(seconds)
        return seconds

    async def _visible(self, record: WeightsPublished) -> bool:
        """Whether the snapshot can be loaded: True when it is there; False when the learner collected it
        (a newer snapshot is beside it: its announcement follows). A path this host never sees is an error
        with the fix, never a silent skip: the worker would sample with its old weights forever."""
        deadline = time.monotonic() + SNAPSHOT_VISIBLE_S
        while not Path(record.path).exists():
            if self._collected(record):
                log.get(run=self.labels[0], stage=self.labels[1], worker=self.labels[2]).info(
                    "weights snapshot collected; a newer one follows", version=record.version, path=record.path)
                return False
            if time.monotonic() > deadline:
                raise WeightsUnavailable(
                    f"weights version {record.version}: {record.path} is not visible from this {self.role} worker "
                    f"(host {socket.gethostname()}). The learner writes snapshots under its run.output_dir: give "
                    f"every {self.role} worker that directory at the same absolute path (a shared filesystem), or "
                    f'set rollout.weight_transport = "broadcast" to send weights over the network'
                )
            await asyncio.sleep(0.2)  # polling a shared filesystem that may show the rename late
        return True

    @staticmethod
    def _collected(record: WeightsPublished) -> bool:
        """A newer snapshot sits beside this one: the learner collected this one after publishing that."""
        weights_dir = Path(record.path).parent
        if not weights_dir.is_dir():
            return False
        newer = [d for d in weights_dir.glob("v*") if d.name[1:].isdigit() and int(d.name[1:]) > record.version]
        return bool(newer)

    async def records(self) -> AsyncIterator[list]:
        """The stage's source: this worker's records for the weights group (none without one)."""
        return
        yield

    async def on_record(self, record: Any) -> None:
        """A record from an edge in ``subscribes``."""

    def check(self) -> None:
        """The worker's heartbeat: raise when this worker can never get weights."""

    def leases(self) -> dict[str, int]:
        """The leases this side keeps alive (the weights group's member lease)."""
        return {}


class FileReceiver(Receiver):
    """``rollout.weight_transport = "file"``: full-weights snapshots from a filesystem the learner writes."""


class LoraReceiver(Receiver):
    """``rollout.weight_transport = "lora"``: adapter snapshots (``load`` fetches one from its blob when this
    host does not see the learner's output_dir); the engine must be LoRA-enabled."""

    async def start(self, ctx: StageContext) -> None:
        engine = self._engine
        max_lora_rank = vllm_max_lora_rank(self.cfg.learner.lora_rank)
        engine_rank = engine.max_lora_rank  # servers take full weights only
        if engine_rank is None or engine_rank < max_lora_rank:
            raise SetupError(
                f'rollout.weight_transport = "lora" needs an engine started with max_lora_rank >= '
                f"{max_lora_rank} (learner.lora_rank = {self.cfg.learner.lora_rank}); "
                f"this one has {engine_rank}"
            )


# Why an engine cannot join the weights group, by the role of the worker it serves.
_NO_JOIN = {
    "rollout": 'rollout.weight_transport = "broadcast" needs an engine that joins the weights group (a vLLM '
               "engine or vLLM servers); this engine is a {engine}",
    "eval": 'rollout.weight_transport = "broadcast": evaluation\'s own engine must be the in-process vLLM '
            "engine to receive weights by broadcast; this one is a {engine}: set "
            'eval.share_rollout_engine = true (in `rollstream train`), or use weight_transport = "file"',
}


class BroadcastReceiver(Receiver):
    """``rollout.weight_transport = "broadcast"``: the worker is a member of the learner's weights group; the
    engine receives each version in a round and loads it under ``rollout.weight_load`` there."""

    subscribes = (SYNC_EDGE,)
    joins_group = True

    async def start(self, ctx: StageContext) -> None:
        engine = self._engine
        if not engine.joins_broadcast:
            raise SetupError(_NO_JOIN[self.role].format(engine=type(engine).__name__))
        # Servers: their vLLM workers are the group's ranks (checked here: started for it, how many).
        world_size = await engine.prepare_broadcast()
        urls = list(engine.urls) if isinstance(engine, ServerEngine) else None
        self.member = Member(ctx.worker, engine, mode=self.cfg.rollout.weight_load, engine_kind=self.cfg.rollout.engine,
                             backends=engine.broadcast_backends(), server_urls=urls, world_size=world_size,
                             labels=self.labels, role=self.role, wants=self.wants)
        self.member.register()

    async def receive(self, record: WeightsPublished, ctx: StageContext | None) -> float | None:
        """Every member of the group holds the announced version already (a late joiner: at the next round)."""
        if record.via != "broadcast":
            raise self._mismatch(record)
        return 0.0 if self._engine.version == record.version else None

    async def records(self) -> AsyncIterator[list]:
        member = self.member
        if member is None:
            return
        while True:
            yield [(SYNC_EDGE, await member.outbox.get())]

    async def on_record(self, record: Any) -> None:
        if self.member is not None:
            await self.member.on_record(record)  # the weights group's epochs and rounds

    def check(self) -> None:
        """A member that can never take part (the learner is unreachable) fails its worker with the reason
        and the fix, instead of sampling with old weights forever."""
        if self.member is not None and self.member.error:
            raise WeightsUnavailable(self.member.error)

    def leases(self) -> dict[str, int]:
        """The member's lease says it is alive (its value: this incarnation's nonce)."""
        return {MEMBER_LEASE: self.member.nonce} if self.member is not None else {}


RECEIVERS: dict[str, type[Receiver]] = {"file": FileReceiver, "lora": LoraReceiver, "broadcast": BroadcastReceiver}


def receiver(cfg: Config, *, role: str = "rollout",
             wants: Callable[[WeightsRound], Awaitable[bool]] | None = None) -> Receiver:
    """The engine's receiver for ``rollout.weight_transport`` (``role``/``wants``: see ``Receiver``)."""
    return RECEIVERS[str(cfg.rollout.weight_transport)](cfg, role=role, wants=wants)
