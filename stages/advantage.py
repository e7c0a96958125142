"""Advantage: collect each prompt group (its manifest and every scored record), then normalise rewards.

A group is complete when every record its ``GroupClosed`` manifest lists has been scored. Records and
the manifest arrive in any order and possibly twice (redelivery): they are kept by ``record_id`` and
held unacked until the group is emitted as one ``TrainGroup``, so a crash loses nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.records import GroupClosed, ScoredTrajectory, TrainGroup
from pipeline.stage import Handled, stop_when_run_finished
from stages import TRAIN, WEIGHTS

STD_EPS = 1e-4  # as ms-swift: (r - mean) / (std + 1e-4)


def compute_advantages(
    rewards: Sequence[float] | np.ndarray,
    prompt_ids: Sequence[str],
    request_ids: Sequence[str],
    *,
    scale_rewards: str = "group",
) -> np.ndarray:
    """GRPO advantages, request-aware as ms-swift: statistics per prompt over its unique requests.

    R_q is the reward of request q (all its records must agree); for the requests G of one prompt,
    A_q = R_q - mean_G, divided by ``std_G + 1e-4`` (``group``), by the std over every unique request of
    the batch + 1e-4 (``batch``), or not at all (``none``). std is unbiased (ddof=1, torch's default)
    and 0 for a single request. Each record gets its request's A_q.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    n = len(rewards)
    if len(prompt_ids) != n or len(request_ids) != n:
        raise ValueError(f"lengths differ: {n} rewards, {len(prompt_ids)} prompt_ids, {len(request_ids)} request_ids")
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards must be group, batch or none, got {scale_rewards!r}")

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

    def unbiased_std(values: np.ndarray) -> float:
        return float(values.std(ddof=1)) if len(values) > 1 else 0.0

    batch_std = unbiased_std(np.array(list(request_reward.values())))
    advantage: dict[str, float] = {}
    for prompt, requests in by_prompt.items():
        values = np.array([request_reward[r] for r in requests])
        centered = values - values.mean()
        if scale_rewards == "group":
            centered = centered / (unbiased_std(values) + STD_EPS)
        elif scale_rewards == "batch":
            centered = centered / (batch_std + STD_EPS)
        advantage.update(zip(requests, centered.tolist()))
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
    consumes = ("scored",)
    subscribes = (WEIGHTS,)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.scale_rewards = cfg.grpo.scale_rewards
        self._open: dict[str, _Group] = {}
        self._emitted: set[str] = set()
        # scale_rewards = "batch" needs every group of a generation batch before any advantage.
        self._complete_by_batch: dict[int, list[_Group]] = {}

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        stop_when_run_finished(record, ctx)
        return []

    async def handle(self, record: Any, ctx: Any) -> Handled:
        if isinstance(record, GroupClosed) or isinstance(record, ScoredTrajectory):
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
        if self.scale_rewards != "batch":
            train_group, held = self._train_group(group, None)
            return Handled(outputs=[(TRAIN, train_group)], release=held + [])
        batch = self._complete_by_batch.setdefault(group.manifest.generation_batch, [])
        batch.append(group)
        if len(batch) < self.cfg.grpo.prompt_batch_size:
            return Handled(hold=True)
        del self._complete_by_batch[group.manifest.generation_batch]
        outputs, released = self._batch_groups(batch)
        return Handled(outputs=outputs, release=released)

    def _ordered(self, group: _Group) -> list[ScoredTrajectory]:
        return [group.records[r] for r in group.manifest.record_ids]

    def _train_group(self, group: _Group, advantages: np.ndarray | None) -> tuple[TrainGroup, list[str]]:
        records = self._ordered(group)
        if advantages is None:
            advantages = compute_advantages(
                [r.reward for r in records],
                [r.trajectory.prompt_id for r in records],
                [r.trajectory.request_id for r in records],
                scale_rewards=self.scale_rewards,
            )
        m = group.manifest
        train_group = TrainGroup(
            prompt_id=m.prompt_id,
            attempt=m.attempt,
            generation_batch=m.generation_batch,
            records=records,
            advantages=[float(a) for a in advantages],
        )
        # The current input is acked by the runtime; release lists every other held input of the group.
        return train_group, [r.record_id for r in records] + [m.record_id]

    def _batch_groups(self, groups: list[_Group]) -> tuple[list, list[str]]:
        records = [r for g in groups for r in self._ordered(g)]
        advantages = compute_advantages(
            [r.reward for r in records],
            [f"{r.trajectory.prompt_id}/{r.trajectory.attempt}" for r in records],
            [r.trajectory.request_id for r in records],
            scale_rewards="batch",
        )
        outputs, released, start = [], [], 0
        for g in groups:
            size = len(g.manifest.record_ids)
            train_group, held = self._train_group(g, advantages[start : start + size])
            start += size
            outputs.append((TRAIN, train_group))
            released += held
        return outputs, released
