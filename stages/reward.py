"""Reward: score each request with the configured reward functions (and reward model) and their weights.

The shell around ``rewards.scoring.RewardScorer`` (what a reward function receives, how totals and
failures are computed: see there). The rollout sends each group as one ``TrajectoryGroup`` entry, so a
group's records always reach the same worker (any number of workers share the stream, group by group):
each function is called once per group over its G requests (a batch, as ms-swift and TRL call them; a
reward model's forward is batched), a request a scheduler split into several records is scored once, and
under ``dead_letter`` the whole group goes to the dead edge as that one entry. (Single ``Trajectory``
entries, each with its group's ``GroupClosed`` manifest, are still scored one by one: older producers and
hand-written records.)

Under ``reward.on_error = "dead_letter"`` a failed entry is remembered, so the worker's retries of it
fail at once instead of calling the functions again. The weights records it subscribes to give
``trainer_state.global_step`` (the optimizer steps of the newest weights) besides the run's end.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pipeline.config import Config
from pipeline.edges import SCORED, WEIGHTS
from pipeline.records import GroupClosed, ScoredTrajectory, Trajectory, TrajectoryGroup, WeightsPublished
from pipeline.stage import Handled, stop_when_run_finished
from rewards.scoring import (
    RewardFailed,
    RewardScorer,
)


class Reward:
    name = "reward"
    consumes = ("trajectories",)
    subscribes = (WEIGHTS,)
    concurrency = 8
    MAX_REMEMBERED_FAILURES = 10_000

    def __init__(self, cfg: Config, max_steps: int = 0, model_dir: Any = None) -> None:
        """``max_steps``: the run's planned optimizer steps (``trainer_state.max_steps``; 0 = run.max_steps);
        ``model_dir``: how to find the run's model directory (for a reward class declaring ``tokenizer``)."""
        self.cfg = cfg
        self.scorer = RewardScorer(cfg, max_steps=max_steps, model_dir=model_dir)
        self._failed: OrderedDict[str, str] = OrderedDict()  # record_id -> reason (dead_letter retries)

    async def start(self, ctx: Any) -> None:
        await self.scorer.start((ctx.run, ctx.stage, ctx.worker))

    async def close(self) -> None:
        await self.scorer.close()

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        if isinstance(record, WeightsPublished):
            self.scorer.global_step = max(self.scorer.global_step, record.step)
        stop_when_run_finished(record, ctx)
        return []

    async def handle(self, record: Any, ctx: Any) -> Handled:
        if isinstance(record, GroupClosed):  # the manifest of a group whose records came one by one
            return Handled(outputs=[(SCORED, record)])
        if record.record_id in self._failed:  # a worker retry of a dead_letter failure: do not re-run it
            raise RewardFailed(self._failed[record.record_id])
        if isinstance(record, Trajectory):  # one record, one request
            scored = await self.score_requests([[record]], record.record_id)
            return Handled(outputs=[(SCORED, s) for s in scored])
        if isinstance(record, TrajectoryGroup):
            by_request: dict[str, list[Trajectory]] = {}
            for t in record.trajectories:
                by_request.setdefault(t.request_id, []).append(t)
            requests = [sorted(rs, key=lambda t: t.turn) for rs in by_request.values()]
            scored = await self.score_requests(requests, record.record_id)
            return Handled(outputs=[(SCORED, s) for s in scored] + [(SCORED, record.manifest)])
        raise TypeError(
            f"reward stage got {type(record).__name__}, expected Trajectory, TrajectoryGroup or GroupClosed"
        )

    async def score_requests(self, requests: list[list[Trajectory]], input_id: str = "") -> list[ScoredTrajectory]:
        """``RewardScorer.score_requests``, remembering a dead_letter failure under ``input_id`` (the record
        being handled; default: the failed request's first record), so the worker's retries do not call the
        functions again."""
        try:
            return await self.scorer.score_requests(requests)
        except RewardFailed as exc:
            self._remember_failure(input_id or exc.record_id, str(exc))
            raise

    def _remember_failure(self, record_id: str, reason: str) -> None:
        self._failed[record_id] = reason
        while len(self._failed) > self.MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)
