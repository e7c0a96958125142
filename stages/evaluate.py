"""Evaluate: how the policy does on held-out prompts, at the versions ``eval.eval_steps`` picks, while training goes on.

The stage reads the fan-out weights edge like every worker. For a due version (a multiple of ``eval_steps``,
and the final one) it samples ``eval_num_generations`` completions per held-out prompt with exactly those
weights, scores them with the training rewards and weights (the reward stage's ``score_requests``), and
writes one row per evaluated version into ``metrics.jsonl`` (``"split": "eval"``) and the
``rollstream_eval_*`` gauges.

It never holds training back. Nothing upstream waits for it (the weights edge is a broadcast), and the
evaluation runs in its own task: while it works, newer due versions replace each other, and when it is
done it jumps to the newest, counting the ones it passed over (``eval_skipped_versions``).

Engines: a separate worker (``rollstream worker evaluate``) starts its own and loads each evaluated
snapshot into it. In ``rollstream train`` it shares the rollout engine: its requests go at a lower vLLM
priority and do not hold a weight load back, so rollout goes on as if it were not there; the engine's
per-token weight versions then say whether every sample came from the version evaluated, and a version
whose weights changed mid-evaluation is dropped and counted as skipped.

Sampling is seeded per (prompt, sample), so ``rollstream eval`` on a saved snapshot gives the same samples.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from pathlib import Path
from typing import Any

from pipeline import log, metrics
from pipeline.edges import WEIGHTS
from pipeline.records import ScoredTrajectory, Trajectory, WeightsPublished, pack_f32, pack_i32
from pipeline.stage import stop_when_run_finished
from stages.feeder import truncate_prompt

EVAL_PRIORITY = 1  # vLLM serves lower values first: training requests (0) go ahead of evaluation
FINISH_TIMEOUT_S = 600.0  # longest `train` waits, after the learner, for the final version's evaluation
EVAL_SEED_OFFSET = 7_919  # eval seeds stay clear of the feeder's per-prompt sampling seeds


class WeightsGone(RuntimeError):
    """The version to evaluate can no longer be had (snapshot deleted, or the shared engine moved on)."""


# ---------------------------------------------------------------------------------------------------
# Pure cores


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, HumanEval):
    ``1 - C(n - c, k) / C(n, k)``, the chance that k samples drawn without replacement hold a correct one."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def is_due(version: int, eval_steps: int, *, final: bool = False) -> bool:
    """Is this policy version evaluated? Multiples of ``eval_steps``, and the run's last version."""
    return final or (version > 0 and version % eval_steps == 0)


def eval_seed(base_seed: int, prompt_index: int, sample: int, num_generations: int) -> int:
    """The seed of sample ``sample`` of held-out prompt ``prompt_index``: fixed across versions and runs."""
    return base_seed + EVAL_SEED_OFFSET + prompt_index * num_generations + sample


def eval_row(
    groups: list[list[ScoredTrajectory]], reward_funcs: list[str], *, version: int, step: int, seconds: float
) -> dict[str, Any]:
    """One ``metrics.jsonl`` row for an evaluated version, with the training row's names behind
    transformers' ``eval_`` prefix (as TRL/ms-swift log evaluation): ``eval_reward``, ``eval_reward_std``
    (mean of the per-prompt stds, as training's), ``eval_reward/<func>/mean``, ``eval_completions/...``,
    ``eval_runtime`` (seconds); with the accuracy reward, ``eval_pass@1`` and ``eval_pass@<G>`` (mean over
    prompts of the unbiased estimator; a completion is correct when accuracy scores 1)."""
    from stages.learner import mean_std

    records = [r for group in groups for r in group]
    row: dict[str, Any] = {"split": "eval", "policy_version": version, "step": step}
    row["eval_reward"] = mean_std([r.reward for r in records])[0]
    row["eval_reward_std"] = mean_std([mean_std([r.reward for r in group])[1] for group in groups])[0]
    names = list(dict.fromkeys([*reward_funcs, *(n for r in records for n in r.rewards)]))
    for name in names:
        values = [r.rewards.get(name) for r in records]
        values = [v for v in values if v is not None and not math.isnan(v)]
        row[f"eval_reward/{name}/mean"], row[f"eval_reward/{name}/std"] = mean_std(values)
    lengths = [len(r.trajectory.completion_ids) // 4 for r in records]  # int32 tokens
    row["eval_completions/mean_length"] = mean_std(lengths)[0]
    row["eval_completions/clipped_ratio"] = mean_std([float(r.trajectory.is_truncated) for r in records])[0]
    if "accuracy" in names and groups:
        n = min(len(group) for group in groups)
        for k in dict.fromkeys((1, n)):
            per_prompt = [
                pass_at_k(len(group), sum((r.rewards.get("accuracy") or 0.0) >= 1.0 for r in group), k)
                for group in groups
            ]
            row[f"eval_pass@{k}"] = mean_std(per_prompt)[0]
    row["eval_prompts"] = len(groups)
    row["eval_samples"] = len(records)
    row["eval_runtime"] = seconds
    row["time"] = time.time()
    return row


# ---------------------------------------------------------------------------------------------------
# One evaluation


def eval_completions_in_flight(cfg: Any) -> int:
    """ms-swift's eval batch, world_size * per_device_eval_batch_size completions (whole prompt groups,
    checked at load): the most eval requests in the engine at once."""
    return cfg.eval.per_device_eval_batch_size * cfg.grpo.world_size


def sampling(cfg: Any) -> dict[str, Any]:
    """The training sampling settings, with ``eval.eval_temperature``."""
    g, r = cfg.grpo, cfg.rollout
    return {
        "temperature": cfg.eval.eval_temperature,
        "top_p": g.top_p,
        "top_k": g.top_k,
        "min_p": r.min_p,
        "repetition_penalty": g.repetition_penalty,
        "stop": list(r.stop),
    }


async def evaluate_version(
    engine: Any,
    scorer: Any,
    cfg: Any,
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
    options = sampling(cfg)
    priority = EVAL_PRIORITY if shared and getattr(engine, "priority_scheduling", False) else 0

    async def group(index: int, row: dict[str, Any]) -> list[Trajectory]:
        messages = row["messages"]
        # Held-out prompts are never dropped: over data.max_length they keep their tail ("left").
        prompt_ids = truncate_prompt(engine.encode_prompt(messages), cfg.data.max_length, "left")
        max_tokens = min(cfg.grpo.max_completion_length, cfg.rollout.max_model_len - len(prompt_ids))
        if max_tokens <= 0:
            raise ValueError(
                f"held-out prompt {index} has {len(prompt_ids)} tokens, leaving no room under "
                f"rollout.max_model_len={cfg.rollout.max_model_len}; raise it or set data.max_length"
            )
        async with slots:
            if shared and engine.version != version:  # moved on while this group waited: no use sampling it
                raise WeightsGone(
                    f"the shared engine moved to version {engine.version} before version {version} was done"
                )
            samples = await asyncio.gather(
                *(
                    engine.generate(
                        prompt_ids,
                        request_id=f"eval/v{version}/{index}/{j}@{worker}",
                        seed=eval_seed(cfg.run.seed, index, j, num_generations),
                        max_tokens=max_tokens,
                        priority=priority,
                        gated=not shared,
                        **options,
                    )
                    for j in range(num_generations)
                )
            )
        if shared and any((s.min_version, s.max_version) != (version, version) for s in samples):
            found = sorted({v for s in samples for v in (s.min_version, s.max_version)})
            raise WeightsGone(
                f"the shared engine's weights changed during the evaluation of version {version} "
                f"(samples came from versions {found})"
            )
        data_dict = {k: v for k, v in row.items() if k != "messages"}
        packed_prompt = pack_i32(prompt_ids)
        return [
            Trajectory(
                prompt_id=f"eval:{index}",
                attempt=0,
                request_id=f"eval:{index}/0/{j}",
                generation_batch=-1,
                prompt_ids=packed_prompt,
                completion_ids=pack_i32(s.completion_ids),
                logprobs=pack_f32(s.logprobs),
                messages=messages,
                completion=engine.decode(s.completion_ids),
                finish_reason=s.finish_reason,
                data_dict=data_dict,
                policy_version=s.min_version,
                max_policy_version=s.max_version,
            )
            for j, s in enumerate(samples)
        ]

    try:  # a TaskGroup: once one group finds the weights changed, the others' requests are cancelled (aborted)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(group(i, row)) for i, row in enumerate(rows)]
    except* WeightsGone as gone:
        raise gone.exceptions[0] from None
    groups = [task.result() for task in tasks]
    # One reward call over every request (as the reward stage scores a group), then split back by prompt.
    scored = await scorer.score_requests([[t] for g in groups for t in g], f"eval/v{version}")
    return [scored[i * num_generations : (i + 1) * num_generations] for i in range(len(groups))]


def snapshot_version(path: Path) -> int | None:
    """The policy version of a weights directory: ``weights/v000004`` -> 4, a checkpoint's trainer_state."""
    if m := re.fullmatch(r"v(\d+)", path.name):
        return int(m[1])
    state = path / "trainer_state.json"
    if state.is_file():
        return int(json.loads(state.read_text()).get("policy_version", 0))
    return None


# ---------------------------------------------------------------------------------------------------
# The stage


class Evaluate:
    """The evaluate stage. ``engine`` given: shared with rollout (``rollstream train``) unless ``shared=False``
    (tests lend one); none: it starts its own."""

    name = "evaluate"
    subscribes = (WEIGHTS,)

    def __init__(
        self,
        cfg: Any,
        model_dir: Path,
        rows: list[dict[str, Any]],
        output_dir: Path | None,
        engine: Any = None,
        shared: bool | None = None,
    ) -> None:
        from pipeline.errors import SetupError
        from stages.reward import Reward

        # Off (eval_strategy = "no"): the worker only waits for the run's end, so a Procfile that always
        # starts it (honcho stops every process when one exits) runs configs without evaluation too.
        self.enabled = cfg.eval.eval_strategy != "no"
        if self.enabled and cfg.rollout.multi_turn_scheduler:
            raise SetupError(
                f"evaluation samples single-turn completions; rollout.multi_turn_scheduler="
                f'{cfg.rollout.multi_turn_scheduler!r} is not evaluated yet: set eval.eval_strategy = "no"'
            )
        self.cfg = cfg
        self.model_dir = model_dir
        self.rows = rows
        self.output_dir = output_dir
        self.engine = engine
        self.shared = engine is not None if shared is None else shared
        self._owns_engine = engine is None
        self.scorer = Reward(cfg)  # the training rewards and weights
        self.skipped_versions = 0
        self.results: list[dict[str, Any]] = []  # the rows written, in order
        self._pending: WeightsPublished | None = None
        self._evaluating: int | None = None  # the version being evaluated now (leased, so it is not deleted)
        self._claimed = -1  # newest version taken or evaluated: older announcements are not news
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._labels: tuple[str, str, str] = (cfg.run.name, self.name, "-")
        self.log = log.get(stage=self.name)

    async def start(self, ctx: Any) -> None:
        if not self.enabled:
            log.get(run=ctx.run, stage=ctx.stage).info(
                "evaluation is off (eval_strategy = no): idle until the run ends"
            )
            return
        await self.prepare(ctx)
        if self.cfg.eval.eval_on_start:
            self._offer(WeightsPublished(version=0, path=str(self.model_dir)))
        self._task = asyncio.create_task(self._loop(ctx), name="evaluate")

    async def prepare(self, ctx: Any) -> None:
        """The engine (unless shared) and the reward functions; ``start`` then begins listening."""
        from stages.rollout import start_engine

        self._labels = (ctx.run, ctx.stage, ctx.worker)
        self.log = log.get(run=ctx.run, stage=ctx.stage, worker=ctx.worker)
        metrics.init_eval(ctx.run)
        if self.engine is None:
            self.engine = await start_engine(self.cfg, self.model_dir, nice=self.cfg.eval.engine_nice)
        await self.scorer.start(ctx)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.scorer.close()
        if self._owns_engine and self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        if not self.enabled:
            stop_when_run_finished(record, ctx)
            return []
        # Only note the version: the fan-out loop must never wait for an evaluation.
        if isinstance(record, WeightsPublished) and is_due(
            record.version, self.cfg.eval.eval_steps, final=record.final
        ):
            self._offer(record)
        return []

    def _offer(self, record: WeightsPublished) -> None:
        if record.version <= self._claimed and not record.final:
            return
        if self._pending is not None and self._pending.version < record.version:
            self._skip(self._pending.version, "a newer version arrived first")
        if self._pending is None or self._pending.version <= record.version:
            self._pending = record
        self._wake.set()

    def _skip(self, version: int, reason: str) -> None:
        self.skipped_versions += 1
        metrics.EVAL_SKIPPED.labels(self._labels[0]).inc()
        self.log.info("eval skipped", version=version, reason=reason)

    async def _loop(self, ctx: Any) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            record, self._pending = self._pending, None
            if record is None:
                continue
            self._claimed = max(self._claimed, record.version)
            self._evaluating = record.version
            try:
                await self.evaluate(record, ctx.worker)
            except WeightsGone as exc:
                self._skip(record.version, str(exc))
            except Exception as exc:  # noqa: BLE001 - a failed evaluation must not stop training; counted
                metrics.EVAL_FAILED.labels(self._labels[0]).inc()
                self.log.warning("eval failed", version=record.version, error=repr(exc))
            finally:
                self._evaluating = None
            if record.final:
                ctx.request_stop(f"evaluated the run's final version {record.version}", run_finished=True)
                return

    def leases(self) -> dict[str, int]:
        """Leased by the worker's heartbeat: the learner keeps the snapshots this stage still has to load.
        (One announced just now may be collected before the next heartbeat: that version is skipped.)"""
        versions = [v for v in (self._evaluating, self._pending and self._pending.version) if v is not None]
        return {WEIGHTS: min(versions)} if versions else {}

    async def evaluate(self, record: WeightsPublished, worker: str = "eval") -> dict[str, Any]:
        """Evaluate one announced version: load it (own engine) or check the shared engine holds it,
        sample, score, write the row. Raises WeightsGone when the version cannot be had any more."""
        started = time.perf_counter()
        await self._load(record)
        groups = await evaluate_version(
            self.engine, self.scorer, self.cfg, self.rows, record.version, worker=worker, shared=self.shared
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
            with open(Path(self.output_dir) / "metrics.jsonl", "a") as f:  # noqa: ASYNC230 - one short line
                f.write(json.dumps(row) + "\n")
        self.log.info(
            "evaluated", version=record.version, reward=row["eval_reward"], seconds=row["eval_runtime"]
        )
        return row

    async def _load(self, record: WeightsPublished) -> None:
        version = self.engine.version
        if version > record.version:
            raise WeightsGone(f"the engine already holds version {version}, newer than {record.version}")
        if version == record.version:
            return
        if not Path(record.path).exists():  # the learner keeps only its newest few snapshots
            raise WeightsGone(f"snapshot {record.path} of version {record.version} is gone")
        # Shared: the same load the rollout makes on this announcement (whoever comes first loads it);
        # it matters for the final version, which the finishing rollout no longer loads.
        await self.engine.load_weights(record.path, record.version, mode=self.cfg.rollout.weight_sync)


# ---------------------------------------------------------------------------------------------------
# `rollstream eval`: once, offline


def resolve_weights(spec: str) -> tuple[Path, int]:
    """``DIR|RUN_DIR[:VERSION]`` -> (weights directory, policy version). A run directory gives its newest
    snapshot (``weights/v*``) or the one ``:VERSION`` names; raises SetupError naming what exists."""
    from pipeline.errors import SetupError

    base, sep, tail = spec.rpartition(":")
    path, version = (Path(base), int(tail)) if sep and tail.isdigit() else (Path(spec), None)
    path = path.expanduser()
    if (path / "weights").is_dir():  # a run directory
        snapshots = sorted(p for p in (path / "weights").glob("v*") if snapshot_version(p) is not None)
        if version is not None:
            snapshots = [p for p in snapshots if snapshot_version(p) == version]
        if not snapshots:
            kept = ", ".join(p.name for p in sorted((path / "weights").glob("v*"))) or "none"
            raise SetupError(
                f"--weights {spec}: no snapshot of that version in {path / 'weights'} (kept: {kept})"
            )
        path = snapshots[-1]
    if not (path / "model.safetensors").is_file():
        raise SetupError(
            f"--weights {spec}: {path} holds no model.safetensors; give a weights snapshot "
            f"(RUN_DIR/weights/v000004), a checkpoint-<step> directory, or a run directory"
        )
    found = snapshot_version(path)
    if found is None:
        raise SetupError(
            f"--weights {spec}: cannot tell which policy version {path} holds; give RUN_DIR[:VERSION], a "
            f"RUN_DIR/weights/v* snapshot or a checkpoint-<step> directory"
        )
    if version is not None and found != version:
        raise SetupError(f"--weights {spec}: {path} holds version {found}, not {version}")
    return path, found


async def run_offline(
    cfg: Any, weights: str, out: Path | None = None, *, engine: Any = None
) -> dict[str, Any]:
    """``rollstream eval``: load the weights into a fresh engine (or ``engine``, reset to the model's own
    weights first), evaluate the held-out set as the eval stage does (same prompts, seeds, sampling and
    rewards), print a table and write JSON. Returns the row."""
    from pipeline.plugins import load_plugins
    from stages import graph

    graph.quiet_libraries()
    load_plugins(cfg.run.external_plugins)
    path, version = resolve_weights(weights)
    rows = graph.load_eval_rows(cfg)
    model_dir = graph.resolve_model_dir(cfg.model.model)
    if engine is not None:
        await engine.reset_weights(model_dir)
    stage = Evaluate(cfg, model_dir, rows, output_dir=None, engine=engine, shared=False)

    class _Offline:  # the StageContext the stage's start() needs
        run, stage, worker, stopping = cfg.run.name, "evaluate", "offline", False

    await stage.prepare(_Offline())
    try:
        row = await stage.evaluate(WeightsPublished(version=version, path=str(path)), "offline")
    finally:
        await stage.close()
    row["weights"] = str(path)
    out = out or path.parent / f"eval-v{version:06d}.json"
    out.write_text(json.dumps(row, indent=2) + "\n")
    width = max(len(k) for k in row)
    for key, value in row.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    print(f"written: {out}")
    return row
