"""Reward: score each request with the configured reward functions (and reward model) and their weights.

The shell around ``rewards.scoring.RewardScorer`` (what a reward function receives, how totals and
failures are computed: see there). The rollout sends each group as one ``TrajectoryGroup`` entry and this
stage answers with one ``ScoredGroup`` entry, so a group is one record from rollout to advantage: any
number of reward and advantage workers share their streams group by group and never split one.

Batches (``GroupBatcher``): each reward function is called once per batch of groups, as ms-swift and TRL
call a reward once per local batch — the groups this worker holds at the same time (those one read
delivered, up to ``reward.batch_groups``), so a batched reward model or a remote verifier amortises its
call; a lone group is scored at once, never kept waiting for company. A request a scheduler split into
several records is scored once. When a batched call fails (whatever ``on_error``) each group is scored again
on its own, so one bad group does not fail the others: under "zero" the others keep their scores, and only
the bad group counts towards ``run.max_consecutive_errors`` (one hung call no longer stops the run).

Under ``reward.on_error = "dead_letter"`` a failed entry is remembered, so the worker's retries of it
fail at once instead of calling the functions again. The weights records it subscribes to give
``trainer_state.global_step`` (the optimizer steps of the newest weights) besides the run's end.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from config import Config
from pipeline.edges import SCORED, WEIGHTS
from pipeline.records import (
    ScoredGroup,
    ScoredTrajectory,
    Trajectory,
    TrajectoryGroup,
    WeightsPublished,
)
from pipeline.stage import Handled, Stage, StageContext, stop_when_run_finished
from rewards.scoring import (
    RewardFailed,
    RewardScorer,
)

Requests = list[list[Trajectory]]  # a group's requests, each its records in turn order


class GroupBatcher:
    """Scores the groups handed to ``score`` in one turn of the event loop together, up to ``max_groups``.

    The worker starts a handler per delivery of one read in a single turn, so their groups join one batch
    before the flush (scheduled with ``call_soon``, behind those handlers) runs; a group alone is flushed
    in the next turn. ``score_requests`` is the scorer's: one call per reward function over all requests.
    """

    def __init__(self, score_requests: Callable[..., Awaitable[list[ScoredTrajectory]]], max_groups: int) -> None:
        self._score_requests = score_requests
        self.max_groups = max_groups
        self._pending: list[tuple[Requests, asyncio.Future]] = []
        self._flush_handle: asyncio.Handle | None = None
        self._running: set[asyncio.Task] = set()  # references, so a batch in flight is not collected
        self.batch_sizes: list[int] = []  # groups per batch scored, newest last (bounded; tests read it)

    async def score(self, requests: Requests) -> list[ScoredTrajectory]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((requests, future))
        if len(self._pending) >= self.max_groups:
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[Requests, asyncio.Future]]) -> None:
        self.batch_sizes = [*self.batch_sizes[-999:], len(batch)]
        tentative = len(batch) > 1  # a failed batch is scored again group by group
        try:
            scored = await self._score_requests([r for requests, _ in batch for r in requests], attribute=not tentative)
        except RewardFailed as exc:
            if not tentative:  # one group (under "zero" nothing raises it)
                for _, future in batch:
                    _settle(future, exc)
                return
            scored = None
        except BaseException as exc:
            for _, future in batch:
                _settle(future, exc)
            if not isinstance(exc, Exception):
                raise
            return
        # a function failed: "failed" (drop_group) or, under "zero", its error beside a 0
        if scored is not None and not (tentative and any(s.failed or s.reward_errors for s in scored)):
            start = 0
            for requests, future in batch:
                size = sum(len(records) for records in requests)
                _settle(future, scored[start : start + size])
                start += size
            return
        # A failed batch: each group on its own, so only the group that fails is dropped or dead-lettered.
        for requests, future in batch:
            try:
                _settle(future, await self._score_requests(requests))
            except Exception as exc:  # noqa: BLE001 - handed to that group's handler, which raises it
                _settle(future, exc)


def _settle(future: asyncio.Future, outcome: Any) -> None:
    if future.done():  # its handler was cancelled (a worker draining): nobody waits for it
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def group_requests(group: TrajectoryGroup) -> Requests:
    """The group's requests, each its records in turn order (a scheduler may split a request)."""
    by_request: dict[str, list[Trajectory]] = {}
    for t in group.trajectories:
        by_request.setdefault(t.request_id, []).append(t)
    return [sorted(rs, key=lambda t: t.turn) for rs in by_request.values()]


class Reward(Stage):
    name = "reward"
    consumes = ("trajectories",)
    subscribes = (WEIGHTS,)
    MAX_REMEMBERED_FAILURES = 10_000

    def __init__(self, cfg: Config, max_steps: int = 0, model_dir: Any = None) -> None:
        """``max_steps``: the run's planned optimizer steps (``trainer_state.max_steps``; 0 = run.max_steps);
        ``model_dir``: how to find the run's model directory (for a reward class declaring ``tokenizer``)."""
        self.cfg = cfg
        self.scorer = RewardScorer(cfg, max_steps=max_steps, model_dir=model_dir)
        self.batcher = GroupBatcher(self.scorer.score_requests, cfg.reward.batch_groups)
        # Room for a second batch to gather while one is scored.
        self.concurrency = 2 * cfg.reward.batch_groups
        self._failed: OrderedDict[str, str] = OrderedDict()  # record_id -> reason (dead_letter retries)

    async def start(self, ctx: StageContext) -> None:
        await self.scorer.start((ctx.run, ctx.stage, ctx.worker))

    async def close(self) -> None:
        await self.scorer.close()

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        if isinstance(record, WeightsPublished):
            self.scorer.global_step = max(self.scorer.global_step, record.step)
        stop_when_run_finished(record, ctx)
        return []

    async def handle(self, record: Any, ctx: StageContext) -> Handled:
        if not isinstance(record, TrajectoryGroup):
            raise TypeError(f"reward stage got {type(record).__name__}, expected TrajectoryGroup")
        if record.record_id in self._failed:  # a worker retry of a dead_letter failure: do not re-run it
            raise RewardFailed(self._failed[record.record_id])
        try:
            scored = await self.batcher.score(group_requests(record))
        except RewardFailed as exc:  # dead_letter: remembered, so the worker's retries fail at once
            self._remember_failure(record.record_id, str(exc))
            raise
        return Handled(outputs=[(SCORED, ScoredGroup(manifest=record.manifest, records=scored))])

    def _remember_failure(self, record_id: str, reason: str) -> None:
        self._failed[record_id] = reason
        while len(self._failed) > self.MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)
