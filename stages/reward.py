"""Reward: score each trajectory with the configured reward functions and their weights.

A reward is ms-swift's ORM protocol: ``(completions: list[str], **kwargs) -> list[float | None]``, sync
or async, with every dataset column as a list kwarg (``solution``, ...), plus ``messages``,
``is_truncated``, ``prompt_id``, ``request_id`` and ``completion_ids``. ``None`` means "not applicable"
and is left out of the weighted sum (NaN-aware, as TRL).
Group manifests pass through unchanged so the advantage stage knows when a group is complete.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from pipeline import metrics
from pipeline.records import GroupClosed, ScoredTrajectory, Trajectory
from pipeline.stage import Handled, stop_when_run_finished
from stages import SCORED, WEIGHTS


def weighted_total(scores: dict[str, float | None], weights: dict[str, float]) -> float:
    """Pure: sum of weight * score over the functions that returned a number (None / NaN skipped)."""
    total = 0.0
    for name, value in scores.items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        total += weights[name] * float(value)
    return total


class Reward:
    name = "reward"
    consumes = ("trajectories",)
    subscribes = (WEIGHTS,)
    concurrency = 8

    def __init__(self, cfg: Any) -> None:
        from rewards import get_reward

        self.cfg = cfg
        names = list(cfg.reward.reward_funcs)
        self.funcs = {name: get_reward(name) for name in names}
        self.weights = dict(zip(names, cfg.reward.reward_weights))
        self._labels: tuple[str, str, str] | None = None

    async def start(self, ctx: Any) -> None:
        self._labels = (ctx.run, ctx.stage, ctx.worker)
        for name in self.funcs:  # exported at 0 from the start, so error-rate alerts see a series
            for counter in (metrics.REWARD_CALLS, metrics.REWARD_ERRORS, metrics.REWARD_TIMEOUTS):
                counter.labels(*self._labels, name)

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        stop_when_run_finished(record, ctx)
        return []

    async def handle(self, record: Any, ctx: Any) -> Handled:
        if isinstance(record, GroupClosed):
            return Handled(outputs=[(SCORED, record)])
        if not isinstance(record, Trajectory):
            raise TypeError(f"reward stage got {type(record).__name__}, expected Trajectory or GroupClosed")
        scores = {name: await self._score(name, func, record) for name, func in self.funcs.items()}
        scored = ScoredTrajectory(trajectory=record, rewards=scores, reward=weighted_total(scores, self.weights))
        return Handled(outputs=[(SCORED, scored)])

    async def _score(self, name: str, func: Any, t: Trajectory) -> float | None:
        kwargs: dict[str, Any] = {key: [value] for key, value in t.data_dict.items()}
        kwargs.update(
            messages=[t.messages + [{"role": "assistant", "content": t.completion}]],
            is_truncated=[t.is_truncated],
            prompt_id=[t.prompt_id],
            request_id=[t.request_id],
            completion_ids=[t.completion_token_ids().tolist()],
        )
        metrics.REWARD_CALLS.labels(*self._labels, name).inc()
        try:
            with metrics.REWARD_SECONDS.labels(*self._labels, name).time():
                result = func([t.completion], **kwargs)
                if inspect.isawaitable(result):
                    result = await result
        except Exception:
            metrics.REWARD_ERRORS.labels(*self._labels, name).inc()
            raise
        value = list(result)[0]
        return None if value is None else float(value)
