"""Feeder: turns the dataset into prompt groups, one generation batch at a time, under max_staleness.

Epochs with a seeded shuffle per epoch and drop_last (as ms-swift), ``prompt_batch_size`` groups per
generation batch, each a ``PromptTask`` carrying ``num_generations``. Admission control: generation
batch ``b`` is released only when the learner has trained ``b - max_staleness`` batches, so at most
``max_staleness + 1`` batches are ever in flight and little generated work goes stale.
A group dropped downstream (``Feedback`` with outcome "dropped": DAPO zero std, reward failure,
staleness, truncation, a dead letter) is replaced by the next prompt of the same epoch order, so every
generation batch still reaches the learner whole; a drop's ids may come from a dead-lettered payload, so
only a group this feeder released is replaced (``Feeder.released``). Under ``truncation_strategy =
"delete"`` prompts over ``data.max_length`` tokens are skipped (and counted), counted as the rollout renders
them (``data.chat``: the run's chat template, its keywords and the row's tools). Every task records the
feeder's position after it: a restarted feeder resumes from the newest task on the prompts edge,
repeating and skipping nothing. A row's ``tools`` column travels as ``PromptTask.tools``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from config import Config
from data.chat import ChatTemplate, tool_schemas
from data.loading import DatasetError
from data.media import put_images
from grpo.batching import optimizer_steps_per_batch
from pipeline import log, metrics
from pipeline.edges import FEEDBACK, PROMPTS, WEIGHTS
from pipeline.records import Feedback, FeederPosition, PromptTask, WeightsPublished
from pipeline.stage import Handled, Stage, StageContext, stop_when_run_finished


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How many generation batches the run has and how many optimizer steps each brings."""

    num_batches: int
    batches_per_epoch: int
    optimizer_steps_per_batch: int


def plan_batches(cfg: Config, dataset_size: int) -> BatchPlan:
    """Pure: the run's length in generation batches, from ``max_steps`` or ``num_train_epochs``.

    A generation batch gives ``steps_per_generation`` mini-batches per pass, ``num_iterations`` passes,
    and an optimizer step every ``gradient_accumulation_steps`` mini-batches (ms-swift semantics).
    """
    g = cfg.grpo
    per_epoch = dataset_size // g.prompt_batch_size  # drop_last
    if per_epoch == 0:
        raise DatasetError(
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


def admitted(generation_batch: int, learner_batches: int, max_staleness: int) -> bool:
    """Pure: may generation batch ``b`` be released? Only when the learner has trained ``b - max_staleness``
    generation batches (its version, unless a restarted learner renumbered: ``WeightsPublished.batches``)."""
    return learner_batches >= generation_batch - max_staleness


class PromptOrder:
    """Pure: the dataset as one stream of prompts, epoch 0's seeded order, then epoch 1's, and so on.

    Stream position ``p`` is row ``epoch_order(n, p // n)[p % n]`` of epoch ``p // n``. The feeder takes
    positions in order and never twice, so a prompt id ``e<epoch>:<row>`` is never reused, replacements
    for dropped groups come from the same order (DAPO), and a restart resumes at a recorded position.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool) -> None:
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._orders: dict[int, list[int]] = {}

    def at(self, position: int) -> tuple[int, int]:
        """(epoch, row) at a stream position."""
        epoch, offset = divmod(position, self.num_rows)
        return epoch, self._order(epoch)[offset]

    def position_of(self, prompt_id: str) -> int | None:
        """The stream position of prompt id ``e<epoch>:<row>``; None when it names no prompt of this order."""
        epoch, sep, row = prompt_id.removeprefix("e").partition(":")
        if not (prompt_id.startswith("e") and sep and epoch.isdecimal() and row.isdecimal()):
            return None
        epoch_index, row_index = int(epoch), int(row)
        if row_index >= self.num_rows:
            return None
        return epoch_index * self.num_rows + self._order(epoch_index).index(row_index)

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            self._orders = {epoch: epoch_order(self.num_rows, epoch, self.seed, self.shuffle)}  # one cached
            order = self._orders[epoch]
        return order

    def batch_start(self, position: int, batch_size: int) -> int:
        """Where a generation batch starting at ``position`` begins: drop_last, so a batch that does not
        fit in the rest of the epoch starts the next one (as ms-swift's dataloader)."""
        epoch, offset = divmod(position, self.num_rows)
        return position if offset + batch_size <= self.num_rows else (epoch + 1) * self.num_rows


class Feeder(Stage):
    """Releases generation batches under admission control and answers dropped groups with replacements.

    One writer: every task leaves through ``source`` (a dropped group's ``Feedback`` is held until its
    replacement goes out, acked in the same step), so the tasks on the prompts edge are in the order the
    feeder's position advanced, and the newest one says where a restarted feeder resumes.
    """

    name = "feeder"
    consumes = (FEEDBACK,)
    subscribes = (WEIGHTS,)

    def __init__(
        self,
        cfg: Config,
        rows: list[dict[str, Any]],
        prompt_length: Callable[[list[dict[str, Any]]], int] | None = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        """``prompt_length(messages)`` or, better, the model's ``tokenizer`` (then a prompt is counted as the
        rollout renders it, with the chat template's keywords and the row's tools): needed only to skip
        prompts over data.max_length under truncation_strategy = "delete"."""
        self.cfg = cfg
        self.rows = rows
        self.plan = plan_batches(cfg, len(rows))
        self.learner_version = 0
        self.learner_batches = 0  # generation batches the learner has trained (admission counts these)
        self.version_lead = 0  # version - batches of the newest weights: > 0 after a restarted learner renumbered
        self.position = FeederPosition()
        self.order = PromptOrder(len(rows), cfg.data.data_seed if cfg.data.data_seed is not None else cfg.run.seed,
                                 cfg.data.dataset_shuffle)
        self._seed = self.order.seed
        # Under truncation_strategy = "delete", prompts longer than data.max_length are skipped.
        self._prompt_length: Callable[[dict[str, Any]], int] | None = None
        if cfg.grpo.truncation_strategy == "delete" and cfg.data.max_length is not None:
            if tokenizer is not None:
                chat = ChatTemplate.from_config(cfg)
                self._prompt_length = lambda row: len(chat.token_ids(tokenizer, row["messages"], tools=row.get("tools")))
            elif prompt_length is not None:
                self._prompt_length = lambda row: prompt_length(row["messages"])
        self._too_long: dict[int, bool] = {}  # row -> over the cap (rows are immutable: tokenize once)
        self._drops: deque[Feedback] = deque()  # dropped groups waiting for a replacement, oldest first
        self._answered: set[str] = set()  # Feedback record ids already queued or answered
        self._released: dict[str, int] = {}  # group id -> generation batch, of every task this process sent
        self._resumed_at = FeederPosition()  # where this process took over (a restart, a checkpoint)
        self._wake = asyncio.Event()
        self.skipped_too_long = 0
        # The position each released generation batch started from: a checkpoint taken after batch b
        # was trained restarts the feeder at ``batch_starts[b + 1]`` (see ``restart_at``).
        self.batch_starts: dict[int, FeederPosition] = {}

    async def start(self, ctx: StageContext) -> None:
        newest = await ctx.newest(PROMPTS)
        if isinstance(newest, PromptTask) and newest.resume_at is not None:
            self.position = self._resumed_at = newest.resume_at
            log.get(stage=ctx.stage).info(
                "resuming", batch=self.position.batch, slot=self.position.slot, cursor=self.position.cursor
            )

    def restart_at(self, position: FeederPosition) -> None:
        """Resume from a checkpoint's recorded position (the start of the first untrained batch).

        Exact under max_staleness = 0; with more in flight, prompts that replaced dropped groups of
        earlier batches after that batch was released may be taken again (as new groups, never as a
        retrained one)."""
        self.position = self._resumed_at = position
        self.batch_starts = {position.batch: position}

    # ------------------------------------------------------------------ pure-ish task building

    def release_batch(self) -> list[PromptTask]:
        """The remaining tasks of the current generation batch; advances the position past them."""
        g = self.cfg.grpo
        b = self.position.batch
        self.batch_starts.setdefault(b, self.position)
        cursor = self.position.cursor
        if self.position.slot == 0:
            cursor = self.order.batch_start(cursor, g.prompt_batch_size)
        tasks = []
        for slot in range(self.position.slot, g.prompt_batch_size):
            prompt_id, row, cursor = self._take(cursor)
            last = slot + 1 == g.prompt_batch_size
            after = FeederPosition(batch=b + 1 if last else b, slot=0 if last else slot + 1, cursor=cursor)
            tasks.append(self._task(prompt_id, 0, b, row, after))
        self.position = tasks[-1].resume_at
        return tasks

    def replacement(self, dropped: Feedback) -> PromptTask:
        """A new prompt, next in the stream, for a dropped group of generation batch ``b``."""
        prompt_id, row, cursor = self._take(self.position.cursor)
        self.position = msgspec.structs.replace(self.position, cursor=cursor)
        task = self._task(prompt_id, dropped.attempt + 1, dropped.generation_batch, row, self.position)
        # Never older than what the learner would accept by the time it is trained.
        fresh = max(0, self.learner_version - self.cfg.grpo.max_staleness)
        return msgspec.structs.replace(task, min_policy_version=max(task.min_policy_version, fresh))

    def released(self, dropped: Feedback) -> bool:
        """Did this feeder release the group a drop names? Exactly, for a task this process sent; for one
        sent before it took over, by the prompt's stream position (taken before the resume point) and a
        generation batch already out. A made-up group (a poison record's ids) is never replaced."""
        group_id = f"{dropped.prompt_id}/{dropped.attempt}"
        if group_id in self._released:
            return self._released[group_id] == dropped.generation_batch
        taken = self.order.position_of(dropped.prompt_id)
        return (
            taken is not None
            and taken < self._resumed_at.cursor
            and 0 <= dropped.attempt
            and 0 <= dropped.generation_batch <= self._resumed_at.batch
        )

    def _take(self, cursor: int) -> tuple[str, dict[str, Any], int]:
        """The next usable prompt at ``cursor``: (prompt id, row, cursor after it)."""
        while True:
            epoch, row_index = self.order.at(cursor)
            cursor += 1
            if self._prompt_length is not None and self._over_cap(row_index):
                self.skipped_too_long += 1
                metrics.PROMPTS_TRUNCATED.labels(self.cfg.run.name, "delete").inc()
                continue
            return f"e{epoch}:{row_index}", self.rows[row_index], cursor

    def _over_cap(self, row_index: int) -> bool:
        measure, cap = self._prompt_length, self.cfg.data.max_length
        assert measure is not None and cap is not None, "called only under a prompt-length cap"
        if row_index not in self._too_long:
            self._too_long[row_index] = measure(self.rows[row_index]) > cap
            if len(self._too_long) == len(self.rows) and all(self._too_long.values()):
                raise ValueError(
                    f"every prompt is longer than data.max_length={self.cfg.data.max_length} tokens; "
                    "raise data.max_length or set grpo.truncation_strategy = \"left\""
                )
        return self._too_long[row_index]

    def _task(self, prompt_id: str, attempt: int, b: int, row: dict[str, Any], after: FeederPosition) -> PromptTask:
        g = self.cfg.grpo
        self._released[f"{prompt_id}/{attempt}"] = b
        return PromptTask(
            prompt_id=prompt_id,
            attempt=attempt,
            generation_batch=b,
            num_generations=g.num_generations,
            messages=row["messages"],
            # Images travel as content keys (stored by ``source``, data/media.py), not in the task.
            data_dict={k: v for k, v in row.items() if k not in ("messages", "images", "tools")},
            tools=tool_schemas(row.get("tools"), where=f"prompt {prompt_id}: the tools column"),
            # Distinct, reproducible seeds per (batch, prompt, attempt); request i adds i.
            seed=(self._seed * 7919 + b * 104_729 + hash_id(prompt_id) * 31 + attempt * 1_000_003) % (2**31 - 1024),
            # the version the learner publishes once it has trained batch b - max_staleness
            min_policy_version=max(0, b - g.max_staleness + self.version_lead),
            resume_at=after,
        )

    # ------------------------------------------------------------------ the stage

    async def source(self, ctx: StageContext) -> AsyncIterator[list | Handled]:
        k = self.cfg.grpo.max_staleness
        waiting_since: float | None = None
        while not ctx.stopping:  # the run finished (final weights): release nothing more
            self._wake.clear()
            if self._drops:
                dropped = self._drops.popleft()
                task = await self._store_images(self.replacement(dropped), ctx)
                yield Handled(outputs=[(PROMPTS, task)], release=[dropped.record_id])
                continue
            b = self.position.batch
            if b < self.plan.num_batches:
                if admitted(b, self.learner_batches, k):
                    if waiting_since is not None:
                        metrics.ADMISSION_WAIT.labels(ctx.run).inc(time.monotonic() - waiting_since)
                        waiting_since = None
                    yield [(PROMPTS, await self._store_images(t, ctx)) for t in self.release_batch()]
                    continue
                waiting_since = waiting_since if waiting_since is not None else time.monotonic()
            # Every batch is out, or the next waits on the learner: sleep until a version or a drop.
            await self._wake.wait()

    async def _store_images(self, task: PromptTask, ctx: StageContext) -> PromptTask:
        """A task whose row has images: store them once (content-addressed) and carry their keys."""
        epoch_row = task.prompt_id.partition(":")[2]
        row = self.rows[int(epoch_row)] if epoch_row.isdigit() else {}
        if not row.get("images"):
            return task
        keys = await put_images(ctx, list(row["images"]), ttl_s=self.cfg.transport.blob_ttl_s,
                                max_bytes=self.cfg.data.max_image_bytes, where=f"prompt {task.prompt_id}: ")
        return msgspec.structs.replace(task, images=keys)

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        if isinstance(record, WeightsPublished):
            if record.version >= self.learner_version:
                self.version_lead = record.version - record.batches_trained
            self.learner_version = max(self.learner_version, record.version)
            # A restarted learner's batches count again from its checkpoint; the batches released past it
            # are trained again (redelivered, or dropped as stale and replaced) before admission moves on.
            self.learner_batches = max(self.learner_batches, record.batches_trained)
            metrics.LEARNER_VERSION.labels(ctx.run).set(self.learner_version)
            stop_when_run_finished(record, ctx)
            self._wake.set()
        return []

    async def handle(self, record: Any, ctx: StageContext) -> Handled:
        """A dropped group: held until ``source`` sends its replacement (acked with it, never lost)."""
        if not isinstance(record, Feedback) or record.outcome != "dropped":
            return Handled()
        if record.record_id in self._answered:
            return Handled()  # a redelivery of a drop already queued or answered
        if not self.released(record):
            log.get(stage=ctx.stage).warning(
                "ignoring a drop of a group this feeder never released",
                prompt_id=record.prompt_id, attempt=record.attempt, reason=record.reason,
            )
            return Handled()
        self._answered.add(record.record_id)
        self._drops.append(record)
        self._wake.set()
        return Handled(hold=True)


def hash_id(text: str) -> int:
    """A stable (not per-process salted) hash of an id, for seeds."""
    value = 0
    for ch in text.encode():
        value = (value * 131 + ch) % 1_000_000_007
    return value
