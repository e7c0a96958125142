"""Evaluate: how the policy does on held-out prompts, at the versions ``eval.eval_steps`` picks, while training goes on.

The stage reads the fan-out weights edge like every worker. For a due version (a multiple of ``eval_steps``,
and the final one) it samples ``eval_num_generations`` completions per held-out prompt with exactly those
weights, scores them with the training rewards and weights (``rewards.scoring.RewardScorer``), and
writes one row per evaluated version into ``metrics.jsonl`` (``"split": "eval"``) and the
``rollstream_eval_*`` gauges.

It never holds training back. Nothing upstream waits for it (the weights edge is a broadcast), and the
evaluation runs in its own task: while it works, newer due versions replace each other, and when it is
done it jumps to the newest, counting the ones it passed over (``eval_skipped_versions``).

Engines: a separate worker (``rollstream worker evaluate``) starts its own, and weights reach it through the
rollout's receiver (``weights.receive``): each evaluated snapshot is loaded into it. Under
``rollout.weight_transport = "broadcast"`` there are no snapshots: that engine is a member of the weights group
(role "eval"). It takes part in every round, as a rank of the collective must,
but loads a version only when it will evaluate it (a due one) and no evaluation is running; otherwise it
drops what it received and answers at once, so the learner never waits for an evaluation. A due version
whose round came during an evaluation is skipped (counted); the run's final version instead cancels the
running evaluation (that version is skipped) and is loaded and evaluated.

With ``eval.share_rollout_engine`` (``rollstream train`` only) it samples on the rollout engine: its
requests go at a lower vLLM priority and do not hold a weight load back, so rollout goes on as if it were
not there; the engine's per-token weight versions then say whether every sample came from the version
evaluated, and a version whose weights changed mid-evaluation is dropped and counted as skipped. (Under
broadcast the rollout engine is the member: a version is evaluated if the engine still holds it.)

Sampling is the rollout's group sampler (``engines.sampler``), seeded per (prompt, sample), so
``rollstream eval`` on a saved snapshot gives the same samples.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from config import Config
from data.chat import tool_schemas
from data.media import MediaError
from engines.base import EngineBase
from engines.sampler import GroupSampler
from engines.vllm_engine import start_engine
from grpo.stats import eval_row
from pipeline import log, metrics
from pipeline.edges import WEIGHTS
from pipeline.errors import SetupError
from pipeline.records import PromptTask, ScoredTrajectory, Trajectory, WeightsPublished, WeightsRound
from pipeline.stage import Stage, StageContext, stop_when_run_finished
from rewards.scoring import RewardScorer
from stages.feeder import truncate_prompt
from weights.receive import receiver

EVAL_PRIORITY = 1  # vLLM serves lower values first: training requests (0) go ahead of evaluation
FINISH_TIMEOUT_S = 600.0  # longest `train` waits, after the learner, for the final version's evaluation
EVAL_SEED_OFFSET = 7_919  # eval seeds stay clear of the feeder's per-prompt sampling seeds
PREEMPT_TIMEOUT_S = 10.0  # longest a final version's round waits for a cancelled evaluation to stop


class WeightsGone(RuntimeError):
    """The version to evaluate can no longer be had (snapshot deleted, or the shared engine moved on)."""


def is_due(version: int, eval_steps: int, *, final: bool = False) -> bool:
    """Is this policy version evaluated? Multiples of ``eval_steps``, and the run's last version."""
    return final or (version > 0 and version % eval_steps == 0)


def eval_seed(base_seed: int, prompt_index: int, sample: int, num_generations: int) -> int:
    """The seed of sample ``sample`` of held-out prompt ``prompt_index``: fixed across versions and runs."""
    return base_seed + EVAL_SEED_OFFSET + prompt_index * num_generations + sample


def eval_completions_in_flight(cfg: Config) -> int:
    """ms-swift's eval batch, world_size * per_device_eval_batch_size completions (whole prompt groups,
    checked at load): the most eval requests in the engine at once."""
    return cfg.eval.per_device_eval_batch_size * cfg.grpo.world_size


def eval_task(cfg: Config, index: int, row: dict[str, Any]) -> PromptTask:
    """Held-out prompt ``index`` as a prompt group: its samples are seeded ``eval_seed(.., index, j, ..)``."""
    num_generations = cfg.eval.eval_num_generations
    return PromptTask(
        prompt_id=f"eval:{index}",
        generation_batch=-1,
        num_generations=num_generations,
        messages=row["messages"],
        data_dict={k: v for k, v in row.items() if k not in ("messages", "tools")},
        tools=tool_schemas(row.get("tools"), where=f"held-out prompt {index}: the tools column"),
        seed=eval_seed(cfg.run.seed, index, 0, num_generations),
    )


async def evaluate_version(
    engine: EngineBase,
    scorer: RewardScorer,
    cfg: Config,
    rows: list[dict[str, Any]],
    version: int,
    *,
    worker: str = "eval",
    shared: bool = False,
) -> list[list[ScoredTrajectory]]:
    """Sample and score every held-out prompt with the engine's weights, which must be ``version``.

    ``shared``: the engine also serves rollout, so requests go at EVAL_PRIORITY and ungated; raises
    WeightsGone when any sample's per-token weight versions are not all ``version``."""
    num_generations = cfg.eval.eval_num_generations
    slots = asyncio.Semaphore(eval_completions_in_flight(cfg) // num_generations)  # whole prompt groups
    sampler = GroupSampler(engine, cfg, temperature=cfg.eval.eval_temperature)
    priority = EVAL_PRIORITY if shared and engine.priority_scheduling else 0

    async def group(index: int, row: dict[str, Any]) -> list[Trajectory]:
        # Held-out prompts are never dropped: over data.max_length they keep their tail ("left").
        task = eval_task(cfg, index, row)
        prompt_ids = truncate_prompt(sampler.encode_prompt(task), sampler.max_prompt_length, "left")
        assert prompt_ids is not None, '"left" keeps the tail: only "delete" drops a prompt'
        async with slots:
            if shared and engine.version != version:  # moved on while this group waited: no use sampling it
                raise WeightsGone(
                    f"the shared engine moved to version {engine.version} before version {version} was done"
                )
            trajectories = await sampler.sample(
                task, prompt_ids, None, engine_tag=f"{worker}/v{version}",
                what=f"held-out prompt {index}", priority=priority, gated=not shared,
            )
        if shared and any((t.policy_version, t.max_policy_version) != (version, version) for t in trajectories):
            found = sorted({v for t in trajectories for v in (t.policy_version, t.max_policy_version)})
            raise WeightsGone(
                f"the shared engine's weights changed during the evaluation of version {version} "
                f"(samples came from versions {found})"
            )
        return trajectories

    try:  # a TaskGroup: once one group finds the weights changed, the others' requests are cancelled (aborted)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(group(i, row)) for i, row in enumerate(rows)]
    except* WeightsGone as gone:
        raise gone.exceptions[0] from None
    groups = [task.result() for task in tasks]
    # One reward call over every request (as the reward stage scores a group), then split back by prompt.
    scored = await scorer.score_requests([[t] for g in groups for t in g])
    return [scored[i * num_generations : (i + 1) * num_generations] for i in range(len(groups))]


class Evaluate(Stage):
    """The evaluate stage. ``engine`` given: shared with rollout (``rollstream train``) unless ``shared=False``
    (tests lend one); none: it starts its own."""

    name = "evaluate"
    subscribes = (WEIGHTS,)

    def __init__(
        self,
        cfg: Config,
        model_dir: Path,
        rows: list[dict[str, Any]],
        output_dir: Path | None,
        engine: EngineBase | None = None,
        shared: bool | None = None,
    ) -> None:
        # Off (eval_strategy = "no"): the worker only waits for the run's end, so a Procfile that always
        # starts it (honcho stops every process when one exits) runs configs without evaluation too.
        self.enabled = cfg.eval.eval_strategy != "no"
        self.cfg = cfg
        self.model_dir = model_dir
        self.rows = rows
        self.output_dir = output_dir
        self.engine = engine
        self.shared = engine is not None if shared is None else shared
        # Broadcast, own engine: a member of the weights group (role "eval"). While a round loads a version
        # into the engine no evaluation starts; while an evaluation runs no round loads.
        self.receiver = receiver(cfg, role="eval", wants=self._wants_round)
        self.joins = self.enabled and not self.shared and self.receiver.joins_group
        if self.joins and cfg.rollout.engine == "server":
            # (the config refuses this without eval.share_rollout_engine): an evaluate worker of its own cannot
            # share the rollout's engine, and its "own" would be the rollout's servers, whose version it
            # could never tell while it samples.
            raise SetupError(
                "eval.share_rollout_engine shares the rollout's engine only within `rollstream train`; this "
                'evaluate worker, with rollout.engine = "server" and weight_transport = "broadcast", would sample '
                "on the rollout's servers without knowing which version they hold: evaluate in `rollstream "
                'train`, or evaluate saved weights with `rollstream eval` and set eval.eval_strategy = "no" here'
            )
        self._owns_engine = engine is None
        self._ctx: StageContext | None = None  # the worker's context, once started
        self.scorer = RewardScorer(cfg, model_dir=(lambda: model_dir) if model_dir else None)  # the training rewards
        self.skipped_versions = 0
        self.results: list[dict[str, Any]] = []  # the rows written, in order
        self._pending: WeightsPublished | None = None
        self._evaluating: int | None = None  # the version being evaluated now (leased, so it is not deleted)
        self._claimed = -1  # newest version taken or evaluated: older announcements are not news
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._running: asyncio.Task | None = None  # the evaluation in progress
        self._skipped: set[int] = set()  # versions counted as skipped (each once)
        self.subscribes = (WEIGHTS, *self.receiver.subscribes) if self.joins else (WEIGHTS,)
        self._engine_idle = asyncio.Event()
        self._engine_idle.set()
        self._preempted: str | None = None  # why the running evaluation was cancelled (the final version came)
        self._labels: tuple[str, str, str] = (cfg.run.name, self.name, "-")
        self.log = log.get(stage=self.name)

    async def start(self, ctx: StageContext) -> None:
        if not self.enabled:
            log.get(run=ctx.run, stage=ctx.stage).info(
                "evaluation is off (eval_strategy = no): idle until the run ends"
            )
            return
        await self.prepare((ctx.run, ctx.stage, ctx.worker))
        self._ctx = ctx  # LoRA over Redis: where an adapter this host cannot see is fetched from
        if not self.shared:  # shared: the rollout's receiver brings the engine its weights
            await self.receiver.start(ctx)
        if self.cfg.eval.eval_on_start:
            self._offer(WeightsPublished(version=0, path=str(self.model_dir)))
        self._task = asyncio.create_task(self._loop(ctx), name="evaluate")

    async def prepare(self, labels: tuple[str, str, str]) -> None:
        """The engine (unless shared) and the reward functions, under the worker's (run, stage, worker) labels;
        ``start`` then begins listening (``rollstream eval`` calls only this)."""
        self._labels = labels
        run, stage, worker = labels
        self.log = log.get(run=run, stage=stage, worker=worker)
        metrics.init_eval(run)
        if self.engine is None:
            self.engine = await start_engine(self.cfg, self.model_dir, nice=self.cfg.eval.engine_nice)
        self.receiver.bind(self.engine, labels)
        await self.scorer.start(self._labels)

    async def source(self, ctx: StageContext) -> Any:
        """This worker's records for the weights group (its registration, its answers), if it is in one."""
        async for records in self.receiver.records():
            yield records

    def sample_metrics(self) -> None:
        """The worker's heartbeat: a member that can never take part (the learner is unreachable) fails the
        worker with the reason and the fix, instead of skipping every version."""
        self.receiver.check()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.scorer.close()
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    async def on_broadcast(self, record: Any, ctx: StageContext) -> list:
        if not self.enabled:
            stop_when_run_finished(record, ctx)
            return []
        # Only note the version: the fan-out loop must never wait for an evaluation.
        if isinstance(record, WeightsPublished):
            if is_due(record.version, self.cfg.eval.eval_steps, final=record.final):
                self._offer(record)
            return []
        if not self.joins:
            return []
        try:  # the weights group's epochs and rounds (this engine's part in them)
            await self.receiver.on_record(record)
        finally:
            if isinstance(record, WeightsRound):
                self._engine_idle.set()  # a load _wants_round allowed is over (done or failed)
        return []

    async def _wants_round(self, record: WeightsRound) -> bool:
        """Whether this engine loads the version a round brings (it receives it either way). Never waits
        for an evaluation: the learner's announcement waits for this member's answer."""
        version = record.version
        if not is_due(version, self.cfg.eval.eval_steps, final=record.final):
            return False  # never evaluated: dropped, the engine keeps the weights it has
        running = self._running if self._running is not None and not self._running.done() else None
        if running is not None and not record.final:
            self._skip(version, f"its round came while version {self._evaluating} was being evaluated")
            return False
        self._engine_idle.clear()  # before anything else: no evaluation starts until this load is over
        if running is not None:  # the final version matters most: the running evaluation gives way
            self._preempted = f"the run's final version {version} arrived during its evaluation"
            running.cancel()
            done, _ = await asyncio.wait({running}, timeout=PREEMPT_TIMEOUT_S)
            if not done:
                self._engine_idle.set()
                self._skip(version, f"the evaluation of version {self._evaluating} did not stop within "
                                    f"{PREEMPT_TIMEOUT_S:.0f} s")
                return False
        return True

    def _offer(self, record: WeightsPublished) -> None:
        if record.version in self._skipped and not record.final:
            return  # passed over at its round, and counted then
        if record.version <= self._claimed and not record.final:
            return
        if self._pending is not None and self._pending.version < record.version:
            self._skip(self._pending.version, "a newer version arrived first")
        if self._pending is None or self._pending.version <= record.version:
            self._pending = record
        self._wake.set()

    def _skip(self, version: int, reason: str) -> None:
        if version in self._skipped:
            return
        self._skipped.add(version)
        self.skipped_versions += 1
        metrics.EVAL_SKIPPED.labels(self._labels[0]).inc()
        self.log.info("eval skipped", version=version, reason=reason)

    async def _loop(self, ctx: StageContext) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not self._engine_idle.is_set():  # a round is loading a version into the engine
                await self._engine_idle.wait()
            record, self._pending = self._pending, None
            if record is None:
                continue
            self._claimed = max(self._claimed, record.version)
            self._evaluating = record.version
            self._running = asyncio.create_task(self.evaluate(record, ctx.worker), name=f"evaluate-v{record.version}")
            try:
                await self._running
            except WeightsGone as exc:
                self._skip(record.version, str(exc))
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if self._preempted is None or (current is not None and current.cancelling()):
                    raise  # the stage is closing
                self._skip(record.version, self._preempted)
            except Exception as exc:  # noqa: BLE001 - a failed evaluation must not stop training; counted
                metrics.EVAL_FAILED.labels(self._labels[0]).inc()
                self.log.warning("eval failed", version=record.version, error=repr(exc))
            finally:
                self._evaluating = None
                self._preempted = None
            if record.final:
                ctx.request_stop(f"evaluated the run's final version {record.version}", run_finished=True)
                return

    @property
    def claimed(self) -> int:
        """The newest version taken for evaluation or evaluated (-1: none yet)."""
        return self._claimed

    @property
    def evaluating(self) -> int | None:
        """The version being evaluated now, None between evaluations."""
        return self._evaluating

    def leases(self) -> dict[str, int]:
        """Leased by the worker's heartbeat: the learner keeps the snapshots this stage still has to load.
        (One announced just now may be collected before the next heartbeat: that version is skipped.)"""
        versions = [v for v in (self._evaluating, self._pending and self._pending.version) if v is not None]
        return {**({WEIGHTS: min(versions)} if versions else {}), **self.receiver.leases()}

    @property
    def _engine(self) -> EngineBase:
        assert self.engine is not None, "prepare() starts the engine first"
        return self.engine

    async def evaluate(self, record: WeightsPublished, worker: str = "eval") -> dict[str, Any]:
        """Evaluate one announced version: load it (own engine) or check the shared engine holds it,
        sample, score, write the row. Raises WeightsGone when the version cannot be had any more."""
        started = time.perf_counter()
        await self._load(record)
        groups = await evaluate_version(
            self._engine, self.scorer, self.cfg, self.rows, record.version, worker=worker, shared=self.shared
        )
        row = eval_row(
            groups,
            list(self.cfg.reward.reward_funcs),
            version=record.version,
            step=record.step,
            seconds=time.perf_counter() - started,
        )
        row["eval_skipped_versions"] = self.skipped_versions
        self.results.append(row)
        metrics.set_eval_gauges(self._labels[0], row)
        if self.output_dir is not None:
            Path(self.output_dir).mkdir(parents=True, exist_ok=True)  # an evaluate worker on another host than the learner's
            with open(Path(self.output_dir) / "metrics.jsonl", "a") as f:  # noqa: ASYNC230 - one short line
                f.write(json.dumps(row) + "\n")
        self.log.info(
            "evaluated", version=record.version, reward=row["eval_reward"], seconds=row["eval_runtime"]
        )
        return row

    async def _load(self, record: WeightsPublished) -> None:
        version = self._engine.version
        if version > record.version:
            raise WeightsGone(f"the engine already holds version {version}, newer than {record.version}")
        if version == record.version:
            return
        if record.via == "broadcast":  # no file: the engine has it from the round, or not at all
            if self.shared:
                raise WeightsGone(f"the shared engine holds version {version}, not broadcast version {record.version}")
            raise WeightsGone(
                f"broadcast version {record.version} is not in this engine (it holds version {version}): its "
                f"round came before this worker joined the weights group, or the round failed for it"
            )
        # The rollout's load of a snapshot (shared: the same load the rollout makes on this announcement, whoever
        # comes first loads it; it matters for the final version, which the finishing rollout no longer loads).
        try:
            loaded = await self.receiver.load(record, self._ctx)
        except MediaError as exc:  # LoRA over Redis: the adapter's blob expired
            raise WeightsGone(str(exc)) from None
        if loaded is None:  # the learner keeps only its newest few snapshots
            raise WeightsGone(f"snapshot {record.path} of version {record.version} is gone")
