"""Advantage: collect each prompt group (its manifest and every scored record), then normalise rewards.

A group is complete when every record its ``GroupClosed`` manifest lists has been scored. Records and
the manifest arrive in any order and possibly twice (redelivery): they are kept by ``record_id`` and
held unacked until the group is emitted as one ``TrainGroup``, so a crash loses nothing.

DAPO dynamic sampling (``grpo.dynamic_sample``): a complete group whose rewards all agree carries no
signal, so instead of a ``TrainGroup`` it goes back to the feeder as ``Feedback(outcome="dropped",
reason="zero_std")`` and the feeder sends the next prompt of its epoch order in its place; at most
``max_resample_times`` such resamples per generation batch, then the group is trained as it is (as
ms-swift, which keeps what it has after its last resample). A group with a failed reward
(``ScoredTrajectory.failed``, ``reward.on_error = "drop_group"``) is dropped the same way, uncapped.
Drop counts ride on the next ``TrainGroup`` (``drops``) into the learner's metrics.jsonl. DAPO overlong filtering (``grpo.overlong_filter``): truncated
completions keep their reward in the statistics but get loss weight 0.

Dead letters: the stage also consumes the ``dead`` edge. A dead-lettered record of a group (its prompt
task, a trajectory, the manifest, a scored record, its TrainGroup) means the group can never be whole, so
it is dropped like any other (``Feedback(reason="dead_letter")``, its held records acked with it) and the
feeder replaces it; records of it that arrive later are acked and ignored. The ids come from a payload
that may be garbage: the feeder replaces only groups it released.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline import metrics
from pipeline.config import DEFAULT_SCALE_REWARDS
from pipeline.edges import FEEDBACK, SCORED, TRAIN, WEIGHTS
from pipeline.records import (
    DEAD_LETTER_DROP,
    DeadLetter,
    Feedback,
    GroupClosed,
    PromptTask,
    RecordError,
    ScoredTrajectory,
    TrainGroup,
    Trajectory,
    TrajectoryGroup,
    decode,
)
from pipeline.stage import Handled, stop_when_run_finished
from pipeline.transport.base import DEAD_EDGE

STD_EPS = 1e-4  # as ms-swift: (r - mean) / (std + 1e-4)


def _unbiased_std(values: np.ndarray) -> float:
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def _group_mean_baseline(values: np.ndarray) -> np.ndarray:
    """grpo and reinforce_plus_plus: A_q = R_q - mean_G."""
    return values - values.mean()


def _leave_one_out_baseline(values: np.ndarray) -> np.ndarray:
    """rloo: A_q = R_q - mean of the OTHER requests = K/(K-1) * (R_q - mean_G) (as ms-swift); 0 when K = 1."""
    k = len(values)
    centered = values - values.mean()
    return centered * k / (k - 1) if k > 1 else centered


# The baseline of each estimator. Scaling differs too: grpo and rloo divide by the std of the REWARDS,
# reinforce_plus_plus by the std of the (centered) ADVANTAGES, which for "batch" whitens across prompts.
BASELINES = {
    "grpo": _group_mean_baseline,
    "rloo": _leave_one_out_baseline,
    "reinforce_plus_plus": _group_mean_baseline,
}


def compute_advantages(
    rewards: Sequence[float] | np.ndarray,
    prompt_ids: Sequence[str],
    request_ids: Sequence[str],
    *,
    scale_rewards: str = "group",
    estimator: str = "grpo",
) -> np.ndarray:
    """GRPO advantages, request-aware as ms-swift: statistics per prompt over its unique requests.

    R_q is the reward of request q (all its records must agree); for the requests G of one prompt,
    A_q = R_q - mean_G, divided by ``std_G + 1e-4`` (``group``), by the std over every unique request of
    the batch + 1e-4 (``batch``), or not at all (``none``). std is unbiased (ddof=1, torch's default)
    and 0 for a single request. Each record gets its request's A_q.

    ``estimator`` (ms-swift's ``advantage_estimator``): ``grpo`` as above; ``rloo`` uses the
    leave-one-out baseline A_q = K/(K-1) (R_q - mean_G), scaled by the same reward stds;
    ``reinforce_plus_plus`` uses A_q = R_q - mean_G and divides by the std of those A_q, over the
    group (``group``, equal to the reward std) or over every request of the batch (``batch``).
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    n = len(rewards)
    if len(prompt_ids) != n or len(request_ids) != n:
        raise ValueError(f"lengths differ: {n} rewards, {len(prompt_ids)} prompt_ids, {len(request_ids)} request_ids")
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")
    if estimator not in BASELINES:
        raise ValueError(f"estimator must be one of {', '.join(BASELINES)}, got {estimator!r}")

    request_reward: dict[str, float] = {}
    request_prompt: dict[str, str] = {}
    for reward, prompt, request in zip(rewards, prompt_ids, request_ids):
        if request in request_reward:
            if not np.isclose(request_reward[request], reward, rtol=1e-5, atol=1e-6):
                raise ValueError(
                    f"request {request!r} has records with different rewards "
                    f"({request_reward[request]} and {reward}); a request's records must share one reward"
                )
            continue
        request_reward[request] = float(reward)
        request_prompt[request] = prompt

    by_prompt: dict[str, list[str]] = {}
    for request, prompt in request_prompt.items():
        by_prompt.setdefault(prompt, []).append(request)

    values = {p: np.array([request_reward[r] for r in requests]) for p, requests in by_prompt.items()}
    centered = {p: BASELINES[estimator](v) for p, v in values.items()}
    # grpo and rloo divide by the std of the rewards; reinforce_plus_plus by the std of the centered
    # advantages (ms-swift's whitening), which differs from the reward std only across prompts ("batch").
    spread = centered if estimator == "reinforce_plus_plus" else values
    batch_std = _unbiased_std(np.concatenate([np.empty(0), *spread.values()]))
    advantage: dict[str, float] = {}
    for prompt, requests in by_prompt.items():
        scaled = centered[prompt]
        if scale_rewards == "group":
            scaled = scaled / (_unbiased_std(spread[prompt]) + STD_EPS)
        elif scale_rewards == "batch":
            scaled = scaled / (batch_std + STD_EPS)
        advantage.update(zip(requests, scaled.tolist()))
    return np.array([advantage[r] for r in request_ids], dtype=np.float64)


class _Group:
    __slots__ = ("manifest", "manifest_record_id", "records")

    def __init__(self) -> None:
        self.manifest: GroupClosed | None = None
        self.records: dict[str, ScoredTrajectory] = {}

    def complete(self) -> bool:
        return self.manifest is not None and all(r in self.records for r in self.manifest.record_ids)


class Advantage:
    name = "advantage"
    consumes = (SCORED, DEAD_EDGE)
    subscribes = (WEIGHTS,)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        g = cfg.grpo
        self.estimator = g.advantage_estimator
        # None only in a config built by hand (load_config fills it): ms-swift's default per estimator.
        self.scale_rewards = g.scale_rewards or DEFAULT_SCALE_REWARDS[self.estimator]
        self._open: dict[str, _Group] = {}
        self._emitted: set[str] = set()
        # scale_rewards = "batch" needs every group of a generation batch before any advantage.
        self._complete_by_batch: dict[int, list[_Group]] = {}
        # dynamic_sample: resamples asked so far, per generation batch (capped by max_resample_times).
        self.resamples_by_batch: dict[int, int] = {}
        # Drops since the last TrainGroup went out, carried on the next one for the learner's metrics.
        self._drops_since_emit: dict[str, int] = {}
        # Groups dropped for a dead letter (also in _emitted): a second dead letter of one drops it once.
        self._dead_groups: set[str] = set()

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        stop_when_run_finished(record, ctx)
        return []

    async def handle(self, record: Any, ctx: Any) -> Handled:
        if isinstance(record, DeadLetter):
            return self._dead_letter(record, ctx)
        if isinstance(record, (GroupClosed, ScoredTrajectory)):
            group_id = record.group_id
        else:
            raise TypeError(f"advantage stage got {type(record).__name__}, expected ScoredTrajectory or GroupClosed")
        if group_id in self._emitted:  # a redelivery of something already trained on: ack, emit nothing
            return Handled()
        group = self._open.setdefault(group_id, _Group())
        if isinstance(record, GroupClosed):
            group.manifest = record
        else:
            group.records[record.record_id] = record
        if not group.complete():
            return Handled(hold=True)
        del self._open[group_id]
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
            return Handled(outputs=[(FEEDBACK, feedback)], release=self._held_ids(group))
        if self.scale_rewards != "batch":
            train_group, held = self._train_group(group, None)
            return Handled(outputs=[(TRAIN, train_group)], release=held)
        batch = self._complete_by_batch.setdefault(group.manifest.generation_batch, [])
        batch.append(group)
        if len(batch) < self.cfg.grpo.prompt_batch_size:
            return Handled(hold=True)
        del self._complete_by_batch[group.manifest.generation_batch]
        outputs, released = self._batch_groups(batch)
        return Handled(outputs=outputs, release=released)

    def _dead_letter(self, letter: DeadLetter, ctx: Any) -> Handled:
        """A record of some group went to the dead edge: drop the group, once, with what we hold of it."""
        found = dead_letter_drop(letter)
        if found is None:  # undecodable, or no group's record: a dead letter and nothing more
            return Handled()
        feedback, past_advantage = found
        group_id = f"{feedback.prompt_id}/{feedback.attempt}"
        # A group already emitted was whole: the dead letter was a duplicate entry of one of its records.
        # Not so for its TrainGroup (past this stage): the learner never trained it, so it is dropped now.
        done = group_id in self._dead_groups if past_advantage else group_id in self._emitted
        if done:
            return Handled()
        self._emitted.add(group_id)
        self._dead_groups.add(group_id)
        group = self._open.pop(group_id, None)
        held = []
        if group is not None:
            held = list(group.records) + ([group.manifest.record_id] if group.manifest is not None else [])
        self._count_drop(DEAD_LETTER_DROP, ctx)
        return Handled(outputs=[(FEEDBACK, feedback)], release=held)

    def _count_drop(self, reason: str, ctx: Any) -> None:
        self._drops_since_emit[reason] = self._drops_since_emit.get(reason, 0) + 1
        metrics.GROUPS_DROPPED.labels(ctx.run, reason).inc()
        metrics.RESAMPLES.labels(ctx.run).inc()

    def _drop_reason(self, group: _Group) -> str:
        """Why the group is not trained ("" = train it): a reward failure, or DAPO's zero std."""
        if any(r.failed for r in group.records.values()):
            return "reward_error"
        if split_request_disagrees(self._ordered(group)):
            # compute_advantages would raise on it forever: drop it (counted) rather than hold it for good.
            return "inconsistent_rewards"
        return "zero_std" if self._resample(group) else ""

    def _resample(self, group: _Group) -> bool:
        """DAPO: drop a zero-std group for a new attempt, while the generation batch has resamples left."""
        g = self.cfg.grpo
        if not g.dynamic_sample or not has_zero_std(self._ordered(group)):
            return False
        b = group.manifest.generation_batch
        asked = self.resamples_by_batch.get(b, 0)
        if asked >= g.max_resample_times:
            return False  # as ms-swift after its last resample: train with what exists
        self.resamples_by_batch[b] = asked + 1
        return True

    def _ordered(self, group: _Group) -> list[ScoredTrajectory]:
        return [group.records[r] for r in group.manifest.record_ids]

    def _held_ids(self, group: _Group) -> list[str]:
        # The current input is acked by the runtime; release lists every other held input of the group.
        return [r.record_id for r in self._ordered(group)] + [group.manifest.record_id]

    def _train_group(self, group: _Group, advantages: np.ndarray | None) -> tuple[TrainGroup, list[str]]:
        records = self._ordered(group)
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
        return train_group, self._held_ids(group)

    def _batch_groups(self, groups: list[_Group]) -> tuple[list, list[str]]:
        records = [r for g in groups for r in self._ordered(g)]
        advantages = compute_advantages(
            [r.reward for r in records],
            [f"{r.trajectory.prompt_id}/{r.trajectory.attempt}" for r in records],
            [r.trajectory.request_id for r in records],
            scale_rewards="batch",
            estimator=self.estimator,
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
    if isinstance(record, ScoredTrajectory):
        record = record.trajectory
    elif isinstance(record, TrajectoryGroup):
        record = record.manifest
    if not isinstance(record, (PromptTask, Trajectory, GroupClosed, TrainGroup)):
        return None
    feedback = Feedback(
        prompt_id=record.prompt_id,
        attempt=record.attempt,
        generation_batch=record.generation_batch,
        outcome="dropped",
        reason=DEAD_LETTER_DROP,
    )
    return feedback, isinstance(record, TrainGroup)


def kl_penalized_rewards(
    rewards: Sequence[float] | np.ndarray, kl: Sequence[float] | np.ndarray, request_ids: Sequence[str], beta: float
) -> np.ndarray:
    """Pure: ms-swift's ``kl_in_reward``, R'_q = R_q - beta * KL_q, where KL_i = sum over record i's
    completion of (old - ref) log-probs and KL_q sums the records of request q (one reward per request,
    as ``compute_advantages`` requires). Only the learner has the reference model, so it calls this and
    then ``compute_advantages`` again on the result."""
    per_request: dict[str, float] = {}
    for request, value in zip(request_ids, kl):
        per_request[request] = per_request.get(request, 0.0) + float(value)
    penalty = np.array([per_request[r] for r in request_ids], dtype=np.float64)
    return np.asarray(rewards, dtype=np.float64) - beta * penalty


def split_request_disagrees(records: Sequence[ScoredTrajectory]) -> bool:
    """Pure: do the records of some request (a scheduler split it into turns) carry different rewards?
    Same tolerance as ``compute_advantages``."""
    first: dict[str, float] = {}
    for r in records:
        reward = first.setdefault(r.trajectory.request_id, r.reward)
        if not np.isclose(reward, r.reward, rtol=1e-5, atol=1e-6):
            return True
    return False


def has_zero_std(records: Sequence[ScoredTrajectory]) -> bool:
    """Pure: do the group's requests all share one reward? Then every advantage is 0 (DAPO drops it).

    Counted per unique request, as the advantages are; a group of one request counts as zero std
    (as ms-swift with num_generations = 1)."""
    rewards = {r.trajectory.request_id: r.reward for r in records}
    return len(set(rewards.values())) <= 1


def overlong_loss_weights(records: Sequence[ScoredTrajectory]) -> list[float]:
    """Pure: DAPO overlong filtering, 0.0 for a truncated completion (finish_reason "length"), else 1.0."""
    return [0.0 if r.trajectory.is_truncated else 1.0 for r in records]
