"""Feeder: turns the dataset into prompt groups, one generation batch at a time, under max_staleness.

Epochs with a seeded shuffle per epoch and drop_last (as ms-swift), ``prompt_batch_size`` groups per
generation batch, each a ``PromptTask`` carrying ``num_generations``. Admission control: generation
batch ``b`` is released only when the learner's published version >= ``b - max_staleness``, so at most
``max_staleness + 1`` batches are ever in flight and little generated work goes stale.
A group dropped downstream (``Feedback`` with outcome "dropped") is replaced by a new attempt of the
same prompt, so every generation batch still reaches the learner whole.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline import metrics
from pipeline.records import Feedback, PromptTask, WeightsPublished
from pipeline.stage import Handled, stop_when_run_finished
from stages import PROMPTS, WEIGHTS


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How many generation batches the run has and how many optimizer steps each brings."""

    num_batches: int
    batches_per_epoch: int
    optimizer_steps_per_batch: int


def optimizer_steps_per_batch(grpo: Any) -> int:
    """Pure: optimizer steps one generation batch brings (at least 1)."""
    return max(1, (grpo.steps_per_generation * grpo.num_iterations) // grpo.gradient_accumulation_steps)


def plan_batches(cfg: Any, dataset_size: int) -> BatchPlan:
    """Pure: the run's length in generation batches, from ``max_steps`` or ``num_train_epochs``.

    A generation batch gives ``steps_per_generation`` mini-batches per pass, ``num_iterations`` passes,
    and an optimizer step every ``gradient_accumulation_steps`` mini-batches (ms-swift semantics).
    """
    g = cfg.grpo
    per_epoch = dataset_size // g.prompt_batch_size  # drop_last
    if per_epoch == 0:
        raise ValueError(
            f"the dataset has {dataset_size} prompts, fewer than one generation batch "
            f"(grpo.prompt_batch_size = {g.prompt_batch_size}); add data or lower grpo.generation_batch_size"
        )
    steps_per_batch = optimizer_steps_per_batch(g)
    by_epochs = per_epoch * cfg.data.num_train_epochs
    if cfg.run.max_steps > 0:
        by_steps = math.ceil(cfg.run.max_steps / steps_per_batch)
        # max_steps wins over epochs (as in transformers' Trainer): cycle the data if needed.
        num_batches = by_steps
    else:
        num_batches = by_epochs
    return BatchPlan(num_batches=num_batches, batches_per_epoch=per_epoch, optimizer_steps_per_batch=steps_per_batch)


def epoch_order(num_rows: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Pure: the row order of one epoch (seeded, so a restart replays it exactly)."""
    order = list(range(num_rows))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def truncate_prompt(prompt_ids: list[int], max_length: int | None, strategy: str) -> list[int] | None:
    """Pure: apply ``data.max_length`` to a tokenized prompt with ``grpo.truncation_strategy``.

    Within the cap (or no cap) the prompt is returned unchanged. Over it, ``left`` keeps the last
    ``max_length`` tokens (the end of the conversation and the generation prompt survive, as ms-swift's
    left truncation), ``delete`` returns None: the prompt is not sampled and another takes its place.
    """
    if strategy not in ("left", "delete"):
        raise ValueError(f"truncation_strategy must be left or delete, got {strategy!r}")
    if max_length is None or len(prompt_ids) <= max_length:
        return prompt_ids
    if strategy == "delete":
        return None
    return prompt_ids[len(prompt_ids) - max_length :]


def admitted(generation_batch: int, learner_version: int, max_staleness: int) -> bool:
    """Pure: may generation batch ``b`` be released? Only when ``version >= b - max_staleness``."""
    return learner_version >= generation_batch - max_staleness


class Feeder:
    name = "feeder"
    consumes = ("feedback",)
    subscribes = (WEIGHTS,)

    def __init__(self, cfg: Any, rows: list[dict[str, Any]]) -> None:
        self.cfg = cfg
        self.rows = rows
        self.plan = plan_batches(cfg, len(rows))
        self.learner_version = 0
        self.released_batches = 0
        self._version_changed = asyncio.Event()
        self._seed = cfg.data.data_seed if cfg.data.data_seed is not None else cfg.run.seed

    def batch_tasks(self, b: int) -> list[PromptTask]:
        """The prompt groups of generation batch ``b`` (pure given the config and rows)."""
        g = self.cfg.grpo
        epoch, index = divmod(b, self.plan.batches_per_epoch)
        order = epoch_order(len(self.rows), epoch, self._seed, self.cfg.data.dataset_shuffle)
        start = index * g.prompt_batch_size
        tasks = []
        for row_index in order[start : start + g.prompt_batch_size]:
            tasks.append(self._task(f"e{epoch}:{row_index}", 0, b, self.rows[row_index]))
        return tasks

    def _task(self, prompt_id: str, attempt: int, b: int, row: dict[str, Any]) -> PromptTask:
        g = self.cfg.grpo
        data = {k: v for k, v in row.items() if k != "messages"}
        return PromptTask(
            prompt_id=prompt_id,
            attempt=attempt,
            generation_batch=b,
            num_generations=g.num_generations,
            messages=row["messages"],
            data_dict=data,
            # Distinct, reproducible seeds per (batch, prompt, attempt); request i adds i.
            seed=(self._seed * 7919 + b * 104_729 + hash_id(prompt_id) * 31 + attempt * 1_000_003) % (2**31 - 1024),
            min_policy_version=max(0, b - g.max_staleness),
        )

    async def source(self, ctx: Any) -> AsyncIterator[list]:
        k = self.cfg.grpo.max_staleness
        for b in range(self.plan.num_batches):
            waited = time.monotonic()
            while not admitted(b, self.learner_version, k):
                self._version_changed.clear()
                await self._version_changed.wait()
                if ctx.stopping:
                    return
            metrics.ADMISSION_WAIT.labels(ctx.run).inc(time.monotonic() - waited)
            self.released_batches = b + 1
            yield [(PROMPTS, t) for t in self.batch_tasks(b)]
        # Every batch is out; replacements for dropped groups still flow through ``handle``.

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        if isinstance(record, WeightsPublished):
            self.learner_version = max(self.learner_version, record.version)
            metrics.LEARNER_VERSION.labels(ctx.run).set(self.learner_version)
            stop_when_run_finished(record, ctx)
            self._version_changed.set()
        return []

    async def handle(self, record: Any, ctx: Any) -> Handled:
        """Feedback: a dropped group comes back as a new attempt of the same prompt."""
        if isinstance(record, Feedback) and record.outcome == "dropped":
            epoch_row = record.prompt_id.split(":", 1)
            row = self.rows[int(epoch_row[1])] if len(epoch_row) == 2 and epoch_row[1].isdigit() else None
            if row is not None:
                task = self._task(record.prompt_id, record.attempt + 1, record.generation_batch, row)
                fresh = max(0, self.learner_version - self.cfg.grpo.max_staleness)
                task = msgspec.structs.replace(task, min_policy_version=max(task.min_policy_version, fresh))
                return Handled(outputs=[(PROMPTS, task)])
        return Handled()


def hash_id(text: str) -> int:
    """A stable (not per-process salted) hash of an id, for seeds."""
    value = 0
    for ch in text.encode():
        value = (value * 131 + ch) % 1_000_000_007
    return value
