"""Advantage: take each scored prompt group, then normalise rewards.

A group arrives whole, as one ``ScoredGroup`` entry (the reward stage's answer to the rollout's
``TrajectoryGroup``), so any number of advantage workers share the stream group by group; it is the only
input a group comes in. An entry held (batch-wide scaling) is acked only with the ``TrainGroup`` it went
into, so a crash loses nothing.

DAPO dynamic sampling (``grpo.dynamic_sample``): a complete group whose rewards all agree carries no
signal, so instead of a ``TrainGroup`` it goes back to the feeder as ``Feedback(outcome="dropped",
reason="zero_std")`` and the feeder sends the next prompt of its epoch order in its place.
``max_resample_times`` counts rounds, as ms-swift's does. There a round regenerates a whole generation batch
of new prompts and pools its groups that have a reward spread until a batch is full (if the last round
leaves it short, the batch it started with is trained). Here a round re-asks, each with a new prompt, only
the groups found zero-std in the round before: a group's round is its ``attempt`` (0 = the batch's own
prompt, n = the n-th prompt asked in that place; a replacement for any other drop reason counts too), and a
zero-std group of round ``max_resample_times`` is trained as it is. The decision needs nothing but the
group itself, so a restarted advantage stage decides the same. A group with a failed reward
(``ScoredTrajectory.failed``, ``reward.on_error = "drop_group"``) is dropped the same way, uncapped.
Drop counts ride on the next ``TrainGroup`` (``drops``) into the learner's metrics.jsonl. DAPO overlong filtering (``grpo.overlong_filter``): truncated
completions keep their reward in the statistics but get loss weight 0. ``scale_rewards`` "batch" and "gdpo"
(each reward function normalised per group, then their weighted sum over the batch) hold the complete groups
until the whole generation batch is in: those need one advantage worker, which the stage enforces (a second
live one stops with the reason, through the workers' leases).

Dead letters: the stage also consumes the ``dead`` edge. A dead-lettered entry of a group (its prompt
task, its ``TrajectoryGroup``, its ``ScoredGroup``, its TrainGroup) means the group will not be trained, so
it is dropped like any other (``Feedback(reason="dead_letter")``) and the feeder replaces it; entries of it
that arrive later are acked and ignored. The ids come from a payload
that may be garbage: the feeder replaces only groups it released.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from config import Config
from grpo.advantages import (  # compute_advantages: users also import it from here
    compute_advantages,
    has_zero_std,
    overlong_loss_weights,
    rewards_per_func,
    split_request_disagrees,
)
from pipeline import metrics
from pipeline.edges import FEEDBACK, SCORED, TRAIN, WEIGHTS
from pipeline.records import (
    DEAD_LETTER_DROP,
    DeadLetter,
    Feedback,
    PromptTask,
    RecordError,
    ScoredGroup,
    TrainGroup,
    TrajectoryGroup,
    decode,
)
from pipeline.stage import FatalStageError, Handled, Stage, StageContext, stop_when_run_finished
from pipeline.transport.base import DEAD_EDGE
from rewards.scoring import REWARD_MODEL

# scale_rewards that need every group of a generation batch before any advantage.
BATCH_WIDE_SCALING = ("batch", "gdpo")
BATCH_WIDE_LEASE = "advantage_batch_wide"  # held by each advantage worker under BATCH_WIDE_SCALING
ALONE_CHECK_PERIOD_S = 2.0


class _Group:
    """A scored group, its records in its manifest's order."""

    __slots__ = ("entry", "manifest", "records")

    def __init__(self, scored: ScoredGroup) -> None:
        self.manifest = scored.manifest
        by_id = {r.record_id: r for r in scored.records}
        missing = [r for r in scored.manifest.record_ids if r not in by_id]
        if missing:  # the reward stage scores every record of a group: a malformed entry, dead-lettered
            raise ValueError(f"ScoredGroup {scored.record_id} lacks records {missing[:3]} its manifest lists")
        self.records = [by_id[r] for r in scored.manifest.record_ids]
        self.entry = scored.record_id  # held until the group is emitted or dropped


class Advantage(Stage):
    name = "advantage"
    consumes = (SCORED, DEAD_EDGE)
    subscribes = (WEIGHTS,)

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.estimator = cfg.grpo.advantage_estimator
        self.scale_rewards = cfg.grpo.scale_rewards  # the config fills ms-swift's default per estimator
        # gdpo normalises each reward on its own: their names in reward_weights' order (functions, then model).
        r = cfg.reward
        self.reward_names = [*r.reward_funcs, *([REWARD_MODEL] if r.reward_model is not None else [])]
        self._emitted: set[str] = set()
        # BATCH_WIDE_SCALING needs every group of a generation batch before any advantage.
        self._complete_by_batch: dict[int, list[_Group]] = {}
        # Drops since the last TrainGroup went out, carried on the next one for the learner's metrics.
        self._drops_since_emit: dict[str, int] = {}
        # Groups dropped for a dead letter (also in _emitted): a second dead letter of one drops it once.
        self._dead_groups: set[str] = set()
        # Batch-wide scaling: when this worker started (its lease's value: the earliest live one goes on).
        self._started_ms = time.time_ns() // 1_000_000
        self._checked_alone_at = -float("inf")

    def leases(self) -> dict[str, int]:
        return {BATCH_WIDE_LEASE: self._started_ms} if self.scale_rewards in BATCH_WIDE_SCALING else {}

    async def _check_alone(self, ctx: StageContext) -> None:
        """scale_rewards "batch"/"gdpo" hold a generation batch's groups until all are in: with a second
        advantage worker each would hold part of the batch forever. The later of two live workers stops."""
        now = time.monotonic()
        if now - self._checked_alone_at < ALONE_CHECK_PERIOD_S:
            return
        self._checked_alone_at = now
        mine = (self._started_ms, ctx.worker)
        earlier = sorted(w for w, started in (await ctx.leases(BATCH_WIDE_LEASE)).items()
                         if w != ctx.worker and (started, w) < mine)
        if earlier:
            raise FatalStageError(
                f"grpo.scale_rewards = {self.scale_rewards!r} needs every group of a generation batch in one "
                f"advantage worker, and {earlier[0]} runs already: run one advantage worker with it (the "
                "Procfile's default), or use scale_rewards 'group' or 'none' to run several"
            )

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        stop_when_run_finished(record, ctx)
        return []

    async def handle(self, record: Any, ctx: StageContext) -> Handled:
        if isinstance(record, DeadLetter):
            return self._dead_letter(record, ctx)
        if not isinstance(record, ScoredGroup):
            raise TypeError(f"advantage stage got {type(record).__name__}, expected ScoredGroup")
        group_id = record.group_id
        if group_id in self._emitted:  # a redelivery of something already trained on: ack, emit nothing
            return Handled()
        if self.scale_rewards in BATCH_WIDE_SCALING:
            await self._check_alone(ctx)
        group = _Group(record)
        self._emitted.add(group_id)
        reason = self._drop_reason(group)
        if reason:
            m = group.manifest
            feedback = Feedback(
                prompt_id=m.prompt_id,
                attempt=m.attempt,
                generation_batch=m.generation_batch,
                outcome="dropped",
                reason=reason,
            )
            self._count_drop(reason, ctx)
            return Handled(outputs=[(FEEDBACK, feedback)])
        if self.scale_rewards not in BATCH_WIDE_SCALING:
            train_group, held = self._train_group(group, None)
            return Handled(outputs=[(TRAIN, train_group)], release=held)
        batch = self._complete_by_batch.setdefault(group.manifest.generation_batch, [])
        batch.append(group)
        if len(batch) < self.cfg.grpo.prompt_batch_size:
            return Handled(hold=True)
        del self._complete_by_batch[group.manifest.generation_batch]
        outputs, released = self._batch_groups(batch)
        return Handled(outputs=outputs, release=released)

    def _dead_letter(self, letter: DeadLetter, ctx: StageContext) -> Handled:
        """An entry of some group went to the dead edge: drop the group, once."""
        found = dead_letter_drop(letter)
        if found is None:  # undecodable, or no group's record: a dead letter and nothing more
            return Handled()
        feedback, past_advantage = found
        group_id = f"{feedback.prompt_id}/{feedback.attempt}"
        # A group already emitted was whole: the dead letter was a duplicate of one of its entries.
        # Not so for its TrainGroup (past this stage): the learner never trained it, so it is dropped now.
        done = group_id in self._dead_groups if past_advantage else group_id in self._emitted
        if done:
            return Handled()
        self._emitted.add(group_id)
        self._dead_groups.add(group_id)
        self._count_drop(DEAD_LETTER_DROP, ctx)
        return Handled(outputs=[(FEEDBACK, feedback)])

    def _count_drop(self, reason: str, ctx: StageContext) -> None:
        self._drops_since_emit[reason] = self._drops_since_emit.get(reason, 0) + 1
        metrics.GROUPS_DROPPED.labels(ctx.run, reason).inc()
        metrics.RESAMPLES.labels(ctx.run).inc()

    def _drop_reason(self, group: _Group) -> str:
        """Why the group is not trained ("" = train it): a reward failure, or DAPO's zero std."""
        if any(r.failed for r in group.records):
            return "reward_error"
        if split_request_disagrees(group.records):
            # compute_advantages would raise on it forever: drop it (counted) rather than hold it for good.
            return "inconsistent_rewards"
        return "zero_std" if self._resample(group) else ""

    def _resample(self, group: _Group) -> bool:
        """DAPO: drop a zero-std group for a new attempt, unless it is of the last round (see the module doc)."""
        g = self.cfg.grpo
        if not g.dynamic_sample or not has_zero_std(group.records):
            return False
        return group.manifest.attempt < g.max_resample_times  # its attempt is its round

    def _train_group(self, group: _Group, advantages: np.ndarray | None) -> tuple[TrainGroup, list[str]]:
        records = group.records
        if advantages is None:
            advantages = compute_advantages(
                [r.reward for r in records],
                [r.trajectory.prompt_id for r in records],
                [r.trajectory.request_id for r in records],
                scale_rewards=self.scale_rewards,
                estimator=self.estimator,
            )
        m = group.manifest
        train_group = TrainGroup(
            prompt_id=m.prompt_id,
            attempt=m.attempt,
            generation_batch=m.generation_batch,
            records=records,
            advantages=[float(a) for a in advantages],
            loss_weights=overlong_loss_weights(records) if self.cfg.grpo.overlong_filter else [],
            drops=self._drops_since_emit,
        )
        self._drops_since_emit = {}
        return train_group, [group.entry]  # the runtime acks the current one; the rest were held

    def _batch_groups(self, groups: list[_Group]) -> tuple[list, list[str]]:
        records = [r for g in groups for r in g.records]
        gdpo = self.scale_rewards == "gdpo"
        advantages = compute_advantages(
            [r.reward for r in records],
            [f"{r.trajectory.prompt_id}/{r.trajectory.attempt}" for r in records],
            [r.trajectory.request_id for r in records],
            scale_rewards=self.scale_rewards,
            estimator=self.estimator,
            rewards_per_func=rewards_per_func(records, self.reward_names) if gdpo else None,
            reward_weights=self.cfg.reward.reward_weights if gdpo else None,
        )
        outputs, released, start = [], [], 0
        for g in groups:
            size = len(g.manifest.record_ids)
            train_group, held = self._train_group(g, advantages[start : start + size])
            start += size
            outputs.append((TRAIN, train_group))
            released += held
        return outputs, released


def dead_letter_drop(letter: DeadLetter) -> tuple[Feedback, bool] | None:
    """Pure: the drop a dead letter calls for, as (Feedback, whether the record was a TrainGroup, already
    past the advantage stage), or None when its payload is no record of a prompt group (undecodable, a
    weights or feedback record) or it is itself a dead letter's dead letter (never a loop)."""
    if letter.edge == DEAD_EDGE:
        return None
    try:
        record = decode(letter.payload)
    except RecordError:
        return None
    if isinstance(record, (TrajectoryGroup, ScoredGroup)):
        record = record.manifest
    elif not isinstance(record, (PromptTask, TrainGroup)):
        return None
    feedback = Feedback(
        prompt_id=record.prompt_id,
        attempt=record.attempt,
        generation_batch=record.generation_batch,
        outcome="dropped",
        reason=DEAD_LETTER_DROP,
    )
    return feedback, isinstance(record, TrainGroup)
