"""Learner: collect whole generation batches, train on each with the trainer, then publish the new weights.

It collects ``prompt_batch_size`` TrainGroups (one generation batch), drops groups older than
``max_staleness`` (counted, with ``Feedback`` so the feeder replaces them), and hands the batch to
``trainer.Trainer`` (GRPO as ms-swift; the loss in ``grpo/loss.py``). Then ``policy_version += 1``: the
trainer writes the snapshot and the stage announces it with ``WeightsPublished`` (a batch whose steps were
all skipped as non-finite announces the unchanged snapshot). Every ``save_steps`` optimizer steps, at the
end, and on a graceful stop (SIGTERM: ``drain``) a checkpoint is written (``trainer/checkpoint.py``);
``resume_from`` continues from one. A trained group is acked only once a checkpoint covers it.

How a version travels is the publisher's (``weights.publish``, one per ``rollout.weight_transport``): a
snapshot file (full weights or a LoRA adapter) the announcement names, or, under "broadcast", no file: the
stage is rank 0 of the weights group and ``WeightsPublished`` says every member holds the version.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec

from config import Config
from data.media import ImageCache
from grpo.loss import policy_loss  # noqa: F401  (users import policy_loss from here)
from pipeline import log, metrics
from pipeline.edges import FEEDBACK, TRAIN, WEIGHTS
from pipeline.records import Feedback, FeederPosition, TrainGroup, WeightsPublished
from pipeline.run_dir import atomic_write_text, remove_stale_temps, writing
from pipeline.stage import Emit, FatalStageError, Handled, Stage, StageContext
from rewards.scoring import conversation
from trainer import checkpoint as checkpoints
from trainer.process import TrainerProcess
from trainer.trainer import NonFiniteTrainingError, Trainer
from weights.publish import Publisher, publisher

ISSUED_FILE = "weights_issued.json"
"""In ``run.output_dir``: the newest policy version a learner of this run put out (see _number_after_predecessors)."""


class Learner(Stage):
    name = "learner"
    consumes = (TRAIN,)
    subscribes = ()
    # The one consumer of its group: what is pending at its start, a killed predecessor held. A resumed
    # learner acks the groups its checkpoint covers only when they come back, so it must not finish first.
    takes_over_at_start = True

    def __init__(
        self, cfg: Config, model_dir: Path, output_dir: Path, num_batches: int,
        on_step: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.num_batches = num_batches
        self.on_step = on_step  # callback(row: dict) for live progress
        # learner.own_process: the same trainer in a child process (trainer/process.py), with the same surface.
        trainer_class = TrainerProcess if cfg.learner.own_process else Trainer
        self.trainer: Trainer | TrainerProcess = trainer_class(cfg, Path(model_dir), self.output_dir, num_batches)
        self.version = 0
        self.batches_trained = 0
        self._waiting: dict[str, TrainGroup] = {}
        self._images = ImageCache()
        self._trained: set[str] = set()
        self._unacked: list[str] = []  # trained groups no checkpoint covers yet: held, acked at the next one
        # Their "trained" feedback goes out with their ack: a learner killed before a checkpoint covers them
        # trains them again after --resume, so "trained" means trained into weights a restart keeps.
        self._unacked_feedback: list[Emit] = []
        self._covered: set[str] = set()  # covered by the checkpoint resumed from; ack and feedback may have died
        self._drops: dict[str, int] = {}  # groups we dropped since the last batch, by reason
        self._stale_samples = 0  # trajectories we dropped for staleness since the last batch
        self._metrics_file = None
        self._completions_file = None
        # Checkpoints: resume_from is restored in start; feeder_position(b) says where the feeder must
        # restart to produce generation batch b (set by the `train` wiring, where the feeder lives).
        self.resume_from: checkpoints.Checkpoint | None = None
        self.feeder_position: Callable[[int], FeederPosition | None] | None = None
        self.publisher: Publisher = publisher(cfg)  # how a version travels (rollout.weight_transport)
        self.subscribes = self.publisher.subscribes
        # run.num_completions_to_print: the `train` wiring's callback(rows) with each batch's completions.jsonl rows.
        self.on_completions: Callable[[list[dict[str, Any]]], None] | None = None

    async def start(self, ctx: StageContext) -> None:
        await asyncio.to_thread(self.trainer.load, self.resume_from)
        if self.resume_from is not None:
            self._resume(self.resume_from.state)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Half-written checkpoints and snapshots of a predecessor killed mid-write: space a resume needs.
        remove_stale_temps(self.output_dir, (checkpoints.PREFIX, "final", ISSUED_FILE))
        remove_stale_temps(self.output_dir / "weights", ("v",))
        # Open for the stage's lifetime (closed in close()); line-buffered, so a kill loses no whole row.
        self._metrics_file = open(self.output_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115, ASYNC230
        if self.cfg.run.log_completions:
            self._completions_file = open(self.output_dir / "completions.jsonl", "a", buffering=1)  # noqa: SIM115, ASYNC230
        self.trainer.run = ctx.run
        if self.cfg.transport.kind != "memory":  # records of a predecessor may outlive it only across processes
            await self._number_after_predecessors(ctx)
        await self.publisher.start(ctx, self.trainer)

    async def _number_after_predecessors(self, ctx: StageContext) -> None:
        """Versions never repeat within a run. A learner killed after checkpoint C may have put out versions
        past C that died with it, while rollouts sampled with them are still queued; restarted from C, it
        would train C + 1, ... again under the same numbers, and a batch sampled with the lost version N
        would pass as on-policy for its own N. So the restored weights get the next number after every
        version any predecessor put out (ISSUED_FILE, written before each one goes out, and the newest
        announcement), and samples of lost versions are as stale as their numbers say. Restored at exactly the
        newest version put out, the weights still get the next number: no version is announced twice."""
        newest = await ctx.newest(WEIGHTS)
        issued = max(self._read_issued(ctx.run), newest.version if isinstance(newest, WeightsPublished) else 0)
        # ">=": restored from the checkpoint of the newest version that went out, its weights would be
        # announced again under the same number; the next number keeps every announcement unique.
        if issued and issued >= self.version:
            log.get(run=ctx.run, stage="learner").warning(
                "versions renumbered after a restart", restored=self.version, issued_before=issued,
                now=issued + 1, batches_trained=self.batches_trained)
            self.version = self.trainer.version = issued + 1

    def _read_issued(self, run: str) -> int:
        try:
            mark = json.loads((self.output_dir / ISSUED_FILE).read_text())
        except (OSError, ValueError):
            return 0
        return int(mark.get("version", 0)) if isinstance(mark, dict) and mark.get("run") == run else 0

    def _record_issued(self) -> None:
        """Before the current version goes out (a snapshot or a broadcast round): the high-water mark a
        restarted learner numbers after (atomic: a kill leaves the old mark or the new). Not in one process
        (memory transport): nothing of a killed run outlives it there."""
        if self.cfg.transport.kind == "memory":
            return
        atomic_write_text(self.output_dir / ISSUED_FILE, json.dumps({"run": self.trainer.run, "version": self.version}))

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        await self.publisher.on_record(record)
        return []

    async def on_idle(self, ctx: StageContext) -> list:
        """While no batch is being trained: the publisher's upkeep (a weights-group member that joined since
        the last round gets the current version now; LoRA over Redis: the newest adapter's blob is renewed)."""
        await self.publisher.on_idle(ctx, self.version)
        return []

    async def _publish(self, ctx: StageContext, path: Path | None, final: bool = False) -> WeightsPublished | None:
        """The announcement of the current version (its snapshot at ``path``), or None when the publisher
        sends it later (a broadcast round's members are still loading it)."""
        return await self.publisher.publish(ctx, self.version, path, step=self.trainer.step, final=final,
                                            batches=self.batches_trained)

    def _resume(self, state: dict[str, Any]) -> None:
        """The stage's part of a checkpoint: counters, the groups it covers, and the jsonl files cut back to
        their length at save time (rows written after it are written again)."""
        self.version = state["policy_version"]
        self.batches_trained = state["batches_trained"]
        self._trained = set(state.get("unacked_group_ids", []))
        self._covered = set(self._trained)
        for name in ("metrics", "completions"):
            size, file = state.get(f"{name}_bytes"), self.output_dir / f"{name}.jsonl"
            if size is not None and file.is_file() and file.stat().st_size > size:
                os.truncate(file, size)

    def follow(self) -> int:
        """Ranks > 0 of a distributed learner: no transport, no files; take rank 0's collective steps."""
        return self.trainer.follow(self.resume_from)

    async def close(self) -> None:
        for f in (self._metrics_file, self._completions_file):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:
                    # Line-buffered: only a row a failed write cut short is left to flush, and that write
                    # already raised OutputWriteError; a resume cuts the file back to its checkpoint's length.
                    pass
        self.publisher.close()
        self.trainer.close()

    async def drain(self, ctx: StageContext) -> Handled:
        """SIGTERM: checkpoint what was trained since the last checkpoint, so the groups it covers are acked
        now and ``--resume`` retrains nothing (with save_steps = 0 there is otherwise no checkpoint to resume
        from). Not with gradients accumulated across a batch boundary, which a checkpoint does not hold: the
        groups then stay held, as after a kill, and are retrained from the last checkpoint."""
        if self.trainer.step == self.trainer.last_checkpoint_step or self.trainer.accumulating:
            return Handled()
        await asyncio.to_thread(self.save_checkpoint)
        released, self._unacked = self._unacked, []
        feedback, self._unacked_feedback = self._unacked_feedback, []
        return Handled(outputs=feedback, release=released)

    async def source(self, ctx: StageContext) -> AsyncIterator[list]:
        """After a resume, announce the restored weights once: the rollout loads them and the feeder's
        admission control sees the restored version (a fresh transport has no weights record yet). Then
        whatever the publisher sends by itself (the weights group's records)."""
        restored = self._announce_restored(ctx) if self.resume_from is not None else None
        async for records in self.publisher.records(restored):
            yield records

    async def _announce_restored(self, ctx: StageContext) -> WeightsPublished | None:
        self._record_issued()
        path = None
        if self.publisher.writes_snapshots:
            path = await asyncio.to_thread(self.trainer.write_snapshot, self.version)
        return await self._publish(ctx, path)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path | None:
        """``checkpoint-<step>`` with the stage's state beside the trainer's (None on ranks > 0)."""
        position = self.feeder_position(self.batches_trained) if self.feeder_position is not None else None
        return self.trainer.save_checkpoint({
            "policy_version": self.version,
            "batches_trained": self.batches_trained,
            # Trained groups this checkpoint covers that are acked right after it is written: a kill in
            # between redelivers them, and the resumed learner acks them without training them again.
            "unacked_group_ids": list(self._unacked),
            "feeder_position": msgspec.to_builtins(position) if position is not None else None,
            # What the jsonl files held at this point: a resume cuts off rows written after it.
            "metrics_bytes": self._metrics_file.tell() if self._metrics_file is not None else None,
            "completions_bytes": self._completions_file.tell() if self._completions_file is not None else None,
        })

    def _checkpoint_due(self, done: bool) -> bool:
        """At the end, and at the first generation-batch boundary at or after every save_steps-th optimizer
        step (never with gradients accumulated across the boundary: those are not in the checkpoint)."""
        if self.trainer.accumulating and not done:
            return False
        every, step = self.cfg.learner.save_steps, self.trainer.step
        crossed = every > 0 and step // every > self.trainer.last_checkpoint_step // every
        return done or crossed

    # ------------------------------------------------------------------ buffering and staleness

    async def handle(self, group: TrainGroup, ctx: StageContext) -> Handled:
        if not isinstance(group, TrainGroup):
            raise TypeError(f"learner got {type(group).__name__}, expected TrainGroup")
        if group.group_id in self._covered:  # the killed learner's checkpoint covers it; its ack did not land
            self._covered.discard(group.group_id)
            return Handled(outputs=[(FEEDBACK, self._feedback(group, "trained"))])
        if group.group_id in self._trained or group.group_id in self._waiting:
            return Handled()  # a redelivery: never train a group twice
        stale = self._staleness(group) > self.cfg.grpo.max_staleness
        if stale:
            self._count_stale(group, ctx)
            self._trained.add(group.group_id)
            return Handled(outputs=[(FEEDBACK, self._feedback(group, "dropped", "staleness"))])
        self._waiting[group.group_id] = group
        if len(self._waiting) < self.cfg.grpo.prompt_batch_size or ctx.stopping:
            return Handled(hold=True)
        return await self._train_and_publish(ctx)

    def _count_stale(self, group: TrainGroup, ctx: StageContext) -> None:
        metrics.STALE_DROPPED.labels(ctx.run).inc(len(group.records))
        metrics.GROUPS_DROPPED.labels(ctx.run, "staleness").inc()
        self._drops["staleness"] = self._drops.get("staleness", 0) + 1
        self._stale_samples += len(group.records)

    def _drop_metrics(self, batch: list[TrainGroup]) -> dict[str, int]:
        """Groups dropped since the previous batch, by reason (advantage's and ours), for metrics.jsonl."""
        drops = dict(self._drops)
        for group in batch:
            for reason, count in group.drops.items():
                drops[reason] = drops.get(reason, 0) + count
        row = {f"dropped/{reason}": drops.get(reason, 0) for reason in ("zero_std", "reward_error", "staleness")}
        row.update({f"dropped/{reason}": count for reason, count in drops.items()})
        row["resample/count"] = sum(drops.values())  # every dropped group was replaced by the feeder
        row["staleness/dropped"] = self._stale_samples
        self._drops, self._stale_samples = {}, 0
        return row

    def _staleness(self, group: TrainGroup) -> int:
        return self.version - min(r.trajectory.policy_version for r in group.records)

    def _feedback(self, group: TrainGroup, outcome: str, reason: str = "") -> Feedback:
        return Feedback(
            prompt_id=group.prompt_id,
            attempt=group.attempt,
            generation_batch=group.generation_batch,
            outcome=outcome,
            reason=reason,
            learner_version=self.version,
        )

    # ------------------------------------------------------------------ one generation batch

    async def _train_and_publish(self, ctx: StageContext) -> Handled:
        outputs: list = []
        released: list[str] = []  # held inputs acked with these outputs
        # Oldest generation batches first; re-check staleness now that the version may have moved.
        candidates = sorted(self._waiting.values(), key=lambda g: (g.generation_batch, g.group_id))
        batch: list[TrainGroup] = []
        for group in candidates:
            if self._staleness(group) > self.cfg.grpo.max_staleness:
                del self._waiting[group.group_id]
                self._trained.add(group.group_id)
                self._count_stale(group, ctx)
                outputs.append((FEEDBACK, self._feedback(group, "dropped", "staleness")))
                released.append(group.group_id)
            elif len(batch) < self.cfg.grpo.prompt_batch_size:
                batch.append(group)
        if len(batch) < self.cfg.grpo.prompt_batch_size:
            # Stale groups were dropped (the feeder replaces them): wait for the replacements.
            return Handled(outputs=outputs, hold=True, release=released)
        for group in batch:
            del self._waiting[group.group_id]
            self._trained.add(group.group_id)
        number = self.batches_trained + 1
        try:
            return await self._train_batch(ctx, batch, outputs, released)
        except FatalStageError:
            raise
        except Exception as exc:
            # Past this point the batch is marked trained: a retried record would be acked as a redelivery with
            # no checkpoint covering its training, and the rest of the batch held for ever. Stop instead; the
            # batch stays unacked, and --resume trains it again from the last checkpoint.
            raise FatalStageError(
                f"learner: {type(exc).__name__}: {exc} (generation batch {number}); its groups "
                "stay unacked: restart the learner with --resume to go on from the last checkpoint") from exc

    async def _train_batch(self, ctx: StageContext, batch: list[TrainGroup], outputs: list,
                           released: list[str]) -> Handled:
        keys = list(dict.fromkeys(k for g in batch for r in g.records for k in r.trajectory.images))
        images = dict(zip(keys, await self._images.get(ctx, keys))) if keys else {}
        try:
            rows = await asyncio.to_thread(self.trainer.train_generation_batch, batch, self.version, images)
        except NonFiniteTrainingError as exc:
            # Keep what the run reached (the weights of the last good step) so it can go on from there.
            path = await asyncio.to_thread(self.save_checkpoint)
            raise NonFiniteTrainingError(f"{exc}. Checkpoint of the last good step: {path}") from None
        if rows:  # counted once per generation batch, on its first optimizer-step row
            rows[0].update(self._drop_metrics(batch))
        self.version += 1
        self.batches_trained += 1
        step = self.trainer.step
        done = self.batches_trained >= self.num_batches or (0 < self.cfg.run.max_steps <= step)
        leased = list((await ctx.leases(WEIGHTS)).values())  # the versions rollout workers still use
        self._record_issued()
        path = await asyncio.to_thread(self.trainer.publish, self.version, done, leased, self.publisher.writes_snapshots)
        metrics.LEARNER_VERSION.labels(ctx.run).set(self.version)
        for row in rows:
            row["policy_version"] = self.version
            self._append(self._metrics_file, json.dumps(row) + "\n")
            if self.on_step is not None:
                self.on_step(row)
        self._log_completions(batch)
        self._unacked += [g.group_id for g in batch]
        checkpointed = self._checkpoint_due(done)
        if checkpointed:
            await asyncio.to_thread(self.save_checkpoint)
        published = await self._publish(ctx, path, final=done)
        if published is not None:
            outputs.append((WEIGHTS, published))
        self._unacked_feedback += [(FEEDBACK, self._feedback(g, "trained")) for g in batch]
        if done:
            ctx.request_stop(f"trained {self.batches_trained} generation batches, {step} optimizer steps", run_finished=True)
        # A trained TrainGroup is acked only once a checkpoint covers it (with learner.save_steps > 0): until
        # then it stays pending, held by this worker. A learner killed after checkpoint C resumes from C, and
        # the transport redelivers exactly the groups it trained after C (their training died with it) plus
        # those it had not trained yet; a group C covers whose ack the kill prevented is listed in C
        # (unacked_group_ids) and acked without training. Acking each batch at once instead would lose
        # the groups trained after C: acked, but their training gone from the resumed weights.
        if checkpointed or self.cfg.learner.save_steps == 0:
            released += self._unacked
            outputs += self._unacked_feedback
            self._unacked, self._unacked_feedback = [], []
            return Handled(outputs=outputs, release=released)
        return Handled(outputs=outputs, hold=True, release=released)

    @staticmethod
    def _append(file: Any, text: str) -> None:
        """Rows to a jsonl file, flushed. A failed write (a full disk) raises OutputWriteError, fatal to the
        stage: the batch's groups stay unacked, and a resume cuts the file back to its checkpoint's length, so
        a row cut short is never read."""
        with writing(Path(file.name)):
            file.write(text)
            file.flush()

    def _log_completions(self, groups: list[TrainGroup]) -> None:
        if self._completions_file is None and self.on_completions is None:
            return  # run.log_completions = false
        # called after the publish bumped the version
        rows = completion_rows(groups, self.trainer.step, trained_at_version=self.version - 1)
        if self._completions_file is not None:
            self._append(self._completions_file, "".join(json.dumps(row) + "\n" for row in rows))
        if self.on_completions is not None:
            self.on_completions(rows)


def completion_rows(groups: list[TrainGroup], step: int, trained_at_version: int) -> list[dict[str, Any]]:
    """The completions.jsonl rows of one trained generation batch, one per completion."""
    rows = []
    for group in groups:
        for record, advantage in zip(group.records, group.advantages):
            t = record.trajectory
            prompt = t.messages[-1]["content"] if t.messages else ""
            rows.append(
                {
                    "step": step,
                    "generation_batch": group.generation_batch,
                    "prompt_id": group.prompt_id,
                    "attempt": group.attempt,
                    "request_id": t.request_id,
                    "policy_version": t.policy_version,
                    "max_policy_version": t.max_policy_version,
                    "trained_at_version": trained_at_version,
                    "prompt": prompt,
                    **({"images": list(t.images)} if t.images else {}),  # content keys, not bytes
                    "completion": t.completion,
                    "rewards": record.rewards,
                    "reward": record.reward,
                    "advantage": advantage,
                    # a gym rollout's per-step rewards and infos (reset first)
                    **({"trajectory_infos": t.rollout_infos["trajectory_infos"]}
                       if "trajectory_infos" in t.rollout_infos else {}),
                    # the final conversation the rewards saw (a scheduler's whole one)
                    "messages": conversation(t),
                    **({"reward_errors": record.reward_errors} if record.reward_errors else {}),
                    **record.logged_extra,  # TRL's log_extra columns (never a name above)
                }
            )
    return rows
