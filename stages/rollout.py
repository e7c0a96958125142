"""Rollout: sample ``num_generations`` independent completions per prompt and emit them as one group.

The shell around the engines: it admits a ``PromptTask`` once the engine holds new enough weights,
tokenises and truncates its prompt (``data.max_length``), samples the group with the shared group sampler
(``engines.sampler``: single-turn, or through ``rollout.multi_turn_scheduler``), and emits one
``TrajectoryGroup`` (its ``GroupClosed`` manifest and its trajectories). New weights (``WeightsPublished``
on the fan-out edge, and the weights group's records) go to the engine through its ``weights.receive.Receiver``,
the same one the evaluate stage uses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from config import Config
from engines.base import EngineBase
from engines.sampler import GroupSampler, check_gym_scheduler, check_tool_scheduler
from engines.server_engine import ServerEngine
from engines.vllm_engine import start_engine

# Servers started with ``--worker-extension-cls stages.rollout.RLWeights`` (as documented before the engines
# moved) still find the worker extension here.
from engines.weight_loader import RLWeights  # noqa: F401 - re-exported
from pipeline import metrics
from pipeline.edges import FEEDBACK, TRAJECTORIES, WEIGHTS
from pipeline.errors import SetupError
from pipeline.records import Feedback, GroupClosed, PromptTask, TrajectoryGroup, WeightsPublished
from pipeline.stage import ErrorStreak, FatalStageError, Handled, Stage, StageContext, stop_when_run_finished
from schedulers import AgentFailed, EnvFailed, SchedulerError, SchedulerFailed, maybe_await, scheduler_class
from stages.feeder import truncate_prompt
from weights.receive import Receiver, WeightsUnavailable, receiver  # noqa: F401 - WeightsUnavailable re-exported

MIN_VERSION_TIMEOUT_S = 600.0


class Rollout(Stage):
    """The rollout stage. ``engine`` may be shared (tests start one for the whole session)."""

    name = "rollout"
    consumes = ("prompts",)
    subscribes = (WEIGHTS,)

    def __init__(self, cfg: Config, model_dir: Path, engine: EngineBase | None = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.engine = engine
        self._owns_engine = engine is None
        self.concurrency = cfg.rollout.max_concurrent_groups
        self._version_changed = asyncio.Condition()
        self._labels: tuple[str, str, str] = (cfg.run.name, self.name, "-")  # the worker's, from start
        self._versions_in_use: dict[str, int] = {}  # group id -> engine version when its requests started
        self._tokens = metrics.RateMeter()
        self.sampler: GroupSampler | None = None
        self.scheduler: Any = None  # built in start(), on the engine (as ms-swift builds it)
        self._scheduler_class: Any = None
        self._errors = ErrorStreak(cfg.run.max_consecutive_errors)
        self.receiver: Receiver = receiver(cfg)  # how new weights reach the engine (rollout.weight_transport)
        self.subscribes = (WEIGHTS, *self.receiver.subscribes)
        name = cfg.rollout.multi_turn_scheduler
        if name:  # an unknown name fails here, before the engine starts
            try:
                self._scheduler_class = scheduler_class(name)
                if cfg.rollout.use_gym_env:
                    check_gym_scheduler(self._scheduler_class, cfg)
                check_tool_scheduler(self._scheduler_class, cfg)
            except SchedulerError as exc:
                raise SetupError(str(exc)) from None

    async def start(self, ctx: StageContext) -> None:
        self._labels = (ctx.run, ctx.stage, ctx.worker)
        if self.engine is None:
            self.engine = await start_engine(self.cfg, self.model_dir)
        if isinstance(self.engine, ServerEngine):
            self.engine.labels = self._labels
        try:
            self.sampler = GroupSampler(self.engine, self.cfg, scheduler=self._scheduler_class)
        except SchedulerError as exc:  # a constructor that cannot take ms-swift's arguments
            raise SetupError(str(exc)) from None
        self.scheduler = self.sampler.scheduler
        metrics.ROLLOUT_VERSION.labels(*self._labels).set(self.engine.version)
        self.receiver.bind(self.engine, self._labels)
        await self.receiver.start(ctx)  # a LoRA rank too small, an engine that cannot join the group: fails here

    async def source(self, ctx: StageContext) -> AsyncIterator[list]:
        """This worker's records for the weights group (its registration, its answers), if it is in one."""
        async for records in self.receiver.records():
            yield records

    def sample_metrics(self) -> None:
        """Gauges the worker's heartbeat samples: engine queue, tokens/s, oldest version still in use, live envs."""
        if self.engine is None:
            return
        # The heartbeat's once-a-second look at the engine: a dead engine core fails the worker here.
        self.engine.check_alive()
        self.receiver.check()  # a weights-group member that can never take part fails the worker
        live_envs = getattr(self.scheduler, "__dict__", {}).get("live_envs")  # never the engine's (__getattr__)
        if live_envs is not None:
            metrics.ENVS_LIVE.labels(*self._labels).set(live_envs)
        if (queued := self.engine.unfinished_requests()) is not None:  # servers cannot tell
            metrics.ENGINE_QUEUE.labels(*self._labels).set(queued)
        metrics.TOKENS_PER_SECOND.labels(*self._labels).set(self._tokens.rate(time.monotonic()))
        metrics.ROLLOUT_OLDEST_VERSION.labels(*self._labels).set(self.oldest_version_in_use())

    @property
    def _engine(self) -> EngineBase:
        assert self.engine is not None, "the worker calls start() first"
        return self.engine

    @property
    def _sampler(self) -> GroupSampler:
        assert self.sampler is not None, "the worker calls start() first"
        return self.sampler

    def oldest_version_in_use(self) -> int:
        """The oldest weights version a group in flight started with (the engine's when none is)."""
        return min(self._versions_in_use.values(), default=self._engine.version)

    def leases(self) -> dict[str, int]:
        """Leased by the worker's heartbeat: the learner keeps every snapshot from this version on."""
        if self.engine is None:
            return {}
        return {WEIGHTS: self.oldest_version_in_use(), **self.receiver.leases()}

    async def close(self) -> None:
        # The gym scheduler's env threads and sessions. Looked up on the class: a scheduler forwards unknown
        # attributes to its engine (ms-swift's __getattr__), whose shutdown is not the scheduler's to call.
        if self.scheduler is not None and hasattr(type(self.scheduler), "shutdown"):
            await maybe_await(self.scheduler.shutdown())
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        if not isinstance(record, WeightsPublished):
            await self.receiver.on_record(record)  # the weights group's epochs and rounds
            await self._version_moved()
            return []
        if stop_when_run_finished(record, ctx):
            return []
        if await self.receiver.receive(record, ctx) is not None:  # None: a newer announcement follows
            await self._version_moved()
        return []

    async def _version_moved(self) -> None:
        # Also when a stage sharing the engine (evaluation) loaded this version first.
        metrics.ROLLOUT_VERSION.labels(*self._labels).set(self._engine.version)
        async with self._version_changed:
            self._version_changed.notify_all()

    def _prompt_ids(self, task: PromptTask) -> list[int] | None:
        """The prompt's token ids under data.max_length: "left" keeps the tail, "delete" gives None."""
        strategy = self.cfg.grpo.truncation_strategy
        ids = self._sampler.encode_prompt(task)  # the run's chat template, with the task's tools
        kept = truncate_prompt(ids, self._sampler.max_prompt_length, strategy)  # data.max_length, or what fits
        if kept is None or len(kept) < len(ids):
            metrics.PROMPTS_TRUNCATED.labels(self._labels[0], strategy).inc()
        return kept

    def _dropped(self, task: PromptTask, reason: str) -> Handled:
        dropped = Feedback(prompt_id=task.prompt_id, attempt=task.attempt, generation_batch=task.generation_batch,
                           outcome="dropped", reason=reason, learner_version=self._engine.version)
        return Handled(outputs=[(FEEDBACK, dropped)])

    async def handle(self, task: PromptTask, ctx: StageContext) -> Handled:
        # Admission: never sample batch b with weights older than b - max_staleness (the feeder saw a
        # newer version than this engine may have loaded yet).
        async with self._version_changed:
            await asyncio.wait_for(
                self._version_changed.wait_for(lambda: self._engine.version >= task.min_policy_version),
                timeout=MIN_VERSION_TIMEOUT_S,
            )
        prompt_ids = self._prompt_ids(task)
        if prompt_ids is None:  # truncation_strategy = "delete" and the feeder let a long prompt through
            return self._dropped(task, "truncated")
        metrics.REQUESTS_IN_FLIGHT.labels(*self._labels).inc(task.num_generations)
        self._versions_in_use[task.group_id] = self._engine.version
        try:
            trajectories = await self._sampler.sample(task, prompt_ids, ctx, engine_tag=ctx.worker)
        except EnvFailed as exc:
            # The reward failure policy: dead_letter raises (the worker retries, then dead-letters the task
            # with the reason); otherwise the group is dropped and the feeder replaces it (an env failure has
            # no partial score, so "zero" drops it too).
            metrics.ENV_FAILURES.labels(*self._labels).inc()
            if self.cfg.reward.on_error == "dead_letter":
                raise
            return self._dropped(task, f"env_error: {exc}")
        except FatalStageError:
            raise
        except Exception as exc:
            if isinstance(exc, AgentFailed):  # counted here; bounded below as every scheduler failure is
                metrics.AGENT_FAILURES.labels(*self._labels).inc()
            # A scheduler that fails the same way on every group would be retried, dead-lettered and
            # resampled forever: after max_consecutive_errors groups the run stops with its error.
            if self.scheduler is not None and self._errors.failed(task.group_id, exc):
                raise SchedulerFailed(
                    f"scheduler {self.cfg.rollout.multi_turn_scheduler!r} ({type(self.scheduler).__name__}) "
                    f"raised the same error on {self._errors.limit} consecutive prompt groups "
                    f"(run.max_consecutive_errors), so the run stops: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        else:
            self._errors.succeeded()
        finally:
            metrics.REQUESTS_IN_FLIGHT.labels(*self._labels).dec(task.num_generations)
            self._versions_in_use.pop(task.group_id, None)
        tokens = sum(int(t.completion_loss_mask().sum()) for t in trajectories)
        metrics.TOKENS_GENERATED.labels(*self._labels).inc(tokens)
        self._tokens.add(tokens, time.monotonic())
        for t in trajectories:
            metrics.TURNS.labels(*self._labels).observe(t.rollout_infos.get("num_turns", 1))
        manifest = GroupClosed(
            prompt_id=task.prompt_id,
            attempt=task.attempt,
            generation_batch=task.generation_batch,
            record_ids=[t.record_id for t in trajectories],
        )
        # One entry per group: one reward worker scores it with one call per reward function (as ms-swift and
        # TRL call them on a batch; a reward model runs one batched forward), and a scheduler's request split
        # into several records is scored once. Per-record entries cost ~50 ms per demo generation batch
        # (72 entries through reward and advantage instead of 8; bench/peer_trl.py).
        return Handled(outputs=[(TRAJECTORIES, TrajectoryGroup(manifest=manifest, trajectories=trajectories))])
