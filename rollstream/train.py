"""How the five stages are wired from a config: the composition root that builds stages, workers and
transport, and ``train`` (every stage in one process)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Self, TypeVar

from config import Config, format_config, resolve_output_dir
from data.loading import (
    load_eval_rows,
    load_rows,
)
from engines.base import EngineBase
from engines.models import model_dir_of
from pipeline import ledger, log, metrics
from pipeline.edges import PROMPTS
from pipeline.errors import SetupError
from pipeline.plugins import load_plugins
from pipeline.records import FeederPosition
from pipeline.run_dir import CONFIG_FILE, DEAD_LETTERS_FILE, write_dead_letters
from pipeline.stage import Stage
from pipeline.transport import connect
from pipeline.transport.base import Transport, newest_payload
from pipeline.worker import Worker, run_together
from rewards import UnknownRewardError, get_reward
from rollstream import plot
from rollstream.progress import LiveProgress, summarize
from rollstream.report import Reporters
from schedulers import SchedulerError, scheduler_class
from stages.advantage import Advantage
from stages.feeder import Feeder, plan_batches
from stages.reward import Reward

_T = TypeVar("_T")
# The rollout and evaluate stages and the engine are imported where they are built: they import torch and
# vLLM, which a feeder, reward or advantage worker never needs (about 1 CPU-second of each one's start).


def quiet_libraries() -> None:
    """No per-file progress bars: the live display is ours. Hub access stays as the user's environment says
    (HF_HUB_OFFLINE): a Hub model or dataset id is resolved once, to a local directory every consumer reads.
    transformers is not imported for this (0.8 s of every worker's start): it reads both settings as it loads
    (Hub's progress-bar switch, TRANSFORMERS_VERBOSITY); only where it is already loaded is it told directly."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


def check_registered(cfg: Config) -> None:
    """Every reward and scheduler name resolves (call it after the plugins load): a typo fails in a second,
    before a model loads, an engine starts or Redis is dialled. Rewards are built here, once (cached)."""
    for name in cfg.reward.reward_funcs:
        try:
            get_reward(name, cfg, model_dir=lambda: model_dir_of(cfg))  # for `tokenizer=`
        except UnknownRewardError as exc:
            raise SetupError(f"reward.reward_funcs: {exc}") from None
    if cfg.rollout.multi_turn_scheduler:
        try:
            scheduler_class(cfg.rollout.multi_turn_scheduler)
        except SchedulerError as exc:
            raise SetupError(str(exc)) from None


def build_stage(
    name: str,
    cfg: Config,
    *,
    model_dir: Path | None = None,
    rows: list[dict[str, Any]] | None = None,
    output_dir: Path | None = None,
    engine: EngineBase | None = None,
    on_step: Any = None,
    shared: bool | None = None,
) -> Any:
    """One stage. ``engine``: a vLLM engine to use instead of starting one (rollout, evaluate);
    ``shared``: for evaluate, whether that engine is also the rollout's."""

    def given(value: _T | None, what: str) -> _T:  # what the caller must pass for this stage
        if value is None:
            raise TypeError(f"build_stage({name!r}) needs {what}")
        return value
    if name == "feeder":
        tokenizer = None
        if feeder_tokenizes(cfg):  # counts prompts as the rollout renders them (chat template, kwargs, tools)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return Feeder(cfg, given(rows, "rows"), tokenizer=tokenizer)
    if name == "rollout":
        from stages.rollout import Rollout

        return Rollout(cfg, given(model_dir, "model_dir"), engine=engine)
    if name == "reward":  # trainer_state.max_steps: the planned optimizer steps (a lone reward worker: run.max_steps)
        plan = plan_batches(cfg, len(rows)) if rows else None
        return Reward(cfg, max_steps=plan.num_batches * plan.optimizer_steps_per_batch if plan else 0,
                      model_dir=lambda: model_dir or model_dir_of(cfg))
    if name == "advantage":
        return Advantage(cfg)
    if name == "learner":
        from stages.learner import Learner  # late: it imports torch, which only the learner's worker needs

        return Learner(cfg, given(model_dir, "model_dir"), given(output_dir, "output_dir"),
                       plan_batches(cfg, len(given(rows, "rows"))).num_batches, on_step=on_step)
    if name == "evaluate":  # rows: the held-out set (load_eval_rows)
        from stages.evaluate import Evaluate

        return Evaluate(cfg, given(model_dir, "model_dir"), given(rows, "rows"), output_dir, engine=engine,
                        shared=shared)
    raise SetupError(f"unknown stage {name!r}; choose one of feeder, rollout, reward, advantage, learner, evaluate")


def feeder_tokenizes(cfg: Config) -> bool:
    """The feeder needs the tokenizer only to skip over-long prompts (truncation_strategy = "delete")."""
    return cfg.data.max_length is not None and cfg.grpo.truncation_strategy == "delete"


def make_worker(stage: Stage, transport: Transport, cfg: Config, **overrides: Any) -> Worker:
    metrics.init_run(cfg.run.name, cfg.grpo.max_staleness)
    t = cfg.transport
    options = {
        "run": cfg.run.name,
        "batch_size": t.batch_size,
        "block_ms": t.block_ms,
        "min_idle_ms": t.min_idle_ms,
        "metrics_host": cfg.run.metrics_host,
        "ledger": cfg.run.ledger,
    }
    options.update(overrides)
    return Worker(stage, transport, **options)


async def open_transport(cfg: Config) -> Transport:
    t = cfg.transport
    return await _maybe_await(
        connect(
            t.kind,
            run=cfg.run.name,
            url=t.url,
            max_deliveries=t.max_deliveries,
            maxlen=t.maxlen,
            reconnect_s=t.reconnect_s,
            min_replicas_acked=t.min_replicas_acked,
            replica_wait_ms=t.replica_wait_ms,
        )
    )


async def _maybe_await(value: Any) -> Any:
    if hasattr(value, "__await__"):
        return await value
    return value


def train(cfg: Config, resume: str | None = None) -> int:
    """``rollstream train``: every stage in this process, live progress, a summary at the end.
    ``resume``: ``latest`` or a checkpoint / output directory (see ``trainer.checkpoint.resolve``)."""
    return asyncio.run(run_pipeline(cfg, resume=resume)).exit_code


def feeder_start_of(feeder: Feeder, batch: int) -> FeederPosition | None:
    """Where ``feeder`` must restart to produce generation batch ``batch`` (a FeederPosition), or None
    when it cannot tell. A released batch recorded its start; the next unreleased one starts at the
    feeder's current position (every replacement it took since was for an earlier, trained batch)."""
    start = feeder.batch_starts.get(batch)
    if start is None and feeder.position.batch == batch and feeder.position.slot == 0:
        start = feeder.position
    return start


def resume_checkpoint(cfg: Config, resume: str, num_batches: int, *, worker: bool = False) -> Any:
    """The checkpoint ``--resume`` names, checked to be one this run can continue from. ``worker``: for a
    learner worker (`rollstream worker learner --resume`), which needs no feeder position: the feeder
    worker continues from its prompts edge, and the transport redelivers what the checkpoint did not cover."""
    from trainer import checkpoint as checkpoints  # late: it imports torch

    given = Path(cfg.run.output_dir).expanduser() if cfg.run.output_dir else None
    found = checkpoints.resolve(resume, given, cfg.run.name)
    state = found.state
    if not worker and state.get("feeder_position") is None:
        raise SetupError(
            f"checkpoint {found.path} has no feeder position (written by a separate learner worker); "
            f"resume it with `rollstream train` only from checkpoints that `rollstream train` wrote"
        )
    if state["batches_trained"] >= num_batches or 0 < cfg.run.max_steps <= state["step"]:
        raise SetupError(
            f"checkpoint {found.path} is already at the end of the run (step {state['step']}, "
            f"{state['batches_trained']} of {num_batches} generation batches); raise run.max_steps to train on"
        )
    return found


class RunResult:
    def __init__(self, exit_code: int, output_dir: Path, summary: dict[str, float]) -> None:
        self.exit_code = exit_code
        self.output_dir = output_dir
        self.summary = summary


async def run_pipeline(
    cfg: Config, *, engine: EngineBase | None = None, transport: Transport | None = None, resume: str | None = None
) -> RunResult:
    """All five stages in this process on one transport (memory by default), and the evaluate stage when
    evaluation is on (with its own engine, or the rollout's: eval.share_rollout_engine). ``engine`` lets tests share one vLLM engine;
    ``transport`` lets them pass an open one. ``resume`` continues from a checkpoint (``latest`` or a
    directory) in the checkpoint's output directory."""
    quiet_libraries()
    load_plugins(cfg.run.external_plugins)
    check_registered(cfg)
    rows = load_rows(cfg)
    evaluating = cfg.eval.eval_strategy != "no"
    eval_rows = load_eval_rows(cfg) if evaluating else []
    plan = plan_batches(cfg, len(rows))
    checkpoint = resume_checkpoint(cfg, resume, plan.num_batches) if resume is not None else None
    output_dir = checkpoint.path.parent if checkpoint is not None else resolve_output_dir(cfg)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_config(cfg, output_dir)
    log_file = open(output_dir / "train.log", "a", buffering=1)  # noqa: SIM115, ASYNC230 - the run's log, closed below
    log.configure(cfg.run.log_level, stream=log_file)
    owns_transport = transport is None
    if owns_transport:  # before the model: an unreachable Redis should fail in a second, not after a build
        transport = await open_transport(cfg)
    try:
        if checkpoint is not None:
            await _check_fresh_for_resume(cfg, transport)
        model_dir = model_dir_of(cfg)
    except BaseException:
        if owns_transport:
            await transport.close()
        raise
    # vLLM's cache stays where vLLM keeps it (~/.cache/vllm): a run-scoped one made every run inspect the
    # model's architecture again in a fresh `python -m` subprocess (4 s quiet, 40 s+ on a busy machine).
    if engine is not None:
        await engine.reset_weights(model_dir)
    sharing = evaluating and cfg.eval.share_rollout_engine
    owned = []  # engines this run starts (and stops): evaluation's own, or the one it shares with rollout
    if evaluating:
        from engines.vllm_engine import start_engine
        from stages.evaluate import eval_completions_in_flight

        if sharing and engine is None:  # one engine, evaluation at a lower priority with its own slots
            engine = await start_engine(
                cfg, model_dir, priority_scheduling=True, extra_num_seqs=eval_completions_in_flight(cfg)
            )
            owned.append(engine)
        elif not sharing:  # started before training, so its start-up does not compete with the first steps
            owned.append(await start_engine(cfg, model_dir, nice=cfg.eval.engine_nice))
    eval_engine = engine if sharing else (owned[0] if owned else None)
    started = time.monotonic()
    progress = LiveProgress(cfg, plan, output_dir, transport)
    loop = asyncio.get_running_loop()
    reporters = None
    try:
        reporters = Reporters(cfg, output_dir)  # run.report_to: tensorboard / wandb

        def on_step(row: dict[str, Any]) -> None:
            progress.on_step(row)
            reporters.log(row)

        stages = {
            name: build_stage(
                name, cfg, model_dir=model_dir, rows=rows, output_dir=output_dir, engine=engine, on_step=on_step
            )
            for name in ("feeder", "rollout", "reward", "advantage", "learner")
        }
        feeder, learner = stages["feeder"], stages["learner"]
        learner.feeder_position = lambda batch: feeder_start_of(feeder, batch)
        learner.on_completions = progress.on_completions  # run.num_completions_to_print
        if checkpoint is not None:
            learner.resume_from = checkpoint
            feeder.restart_at(checkpoint.feeder_position)
        workers = {name: make_worker(stage, transport, cfg) for name, stage in stages.items()}
        evaluator = None
        if evaluating:
            evaluate = build_stage(
                "evaluate", cfg, model_dir=model_dir, rows=eval_rows, output_dir=output_dir, engine=eval_engine,
                shared=sharing,
            )
            evaluator = make_worker(evaluate, transport, cfg)
        everyone = [*workers.values(), *([evaluator] if evaluator else [])]
        for sig in (signal.SIGINT, signal.SIGTERM):  # one handler drains every stage
            loop.add_signal_handler(sig, lambda s=sig: [w.request_stop(f"signal {s.name}") for w in everyone])
        async with progress, serve_metrics(cfg, everyone):
            code = await run_with_evaluator(list(workers.values()), workers["learner"], evaluator)
        await write_outputs(transport, output_dir)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if reporters is not None:
            reporters.close()
        if owns_transport:
            await transport.close()
        for started_engine in owned:
            started_engine.shutdown()
        log.configure(cfg.run.log_level)  # back to stderr before the file closes
        log_file.close()
    summary = summarize(output_dir, cfg, time.monotonic() - started)
    return RunResult(code, output_dir, summary)


async def run_with_evaluator(workers: list[Worker], learner: Worker, evaluator: Worker | None) -> int:
    """``run_together`` for the training stages; the evaluator beside them, outside their stop-all: when
    the learner finishes it still evaluates the final version and then stops by itself (within
    FINISH_TIMEOUT_S). Training never waits for it; a failed run stops it at once."""
    if evaluator is None:
        return await run_together(workers, main=learner)
    from stages.evaluate import FINISH_TIMEOUT_S

    evaluating = asyncio.create_task(evaluator.serve(), name="evaluate")
    try:
        code = await run_together(workers, main=learner)
    except BaseException:
        evaluator.request_stop("training failed")
        await asyncio.gather(evaluating, return_exceptions=True)
        raise
    if code:
        evaluator.request_stop("training failed")
    done, _ = await asyncio.wait({evaluating}, timeout=FINISH_TIMEOUT_S)
    if not done:
        evaluator.request_stop(f"the final evaluation took over {FINISH_TIMEOUT_S:.0f} s")
    return code or await evaluating


def write_config(cfg: Config, output_dir: Path) -> None:
    """The resolved config next to the run's outputs (``rollstream inspect`` shows it)."""
    (output_dir / CONFIG_FILE).write_text(format_config(cfg))


class serve_metrics:
    """The in-process ``train`` serves ONE /metrics and /healthz for all its stages on
    ``run.metrics_port`` (0 = off); ready while every stage is."""

    def __init__(self, cfg: Config, workers: list[Worker]) -> None:
        self.cfg = cfg
        self.workers = workers
        self.server: Any = None

    def health(self) -> dict[str, Any]:
        states = [w.health() for w in self.workers]
        return {
            "ready": all(s["ready"] for s in states),
            "last_progress": max(s["last_progress"] for s in states),
            "stages": {s["stage"]: s["ready"] for s in states},
        }

    async def __aenter__(self) -> Self:
        if self.cfg.run.metrics_port:
            self.server = await metrics.serve(self.cfg.run.metrics_host, self.cfg.run.metrics_port, self.health)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def write_outputs(transport: Transport, output_dir: Path) -> None:
    """At the end of ``train``: the dead letters and the ledger (a memory run's edges die with it) and plot.png."""
    await write_dead_letters(transport, output_dir / DEAD_LETTERS_FILE)
    await ledger.write_run_dir(transport, output_dir)
    if (output_dir / "metrics.jsonl").exists():
        await asyncio.to_thread(plot.write, output_dir)


async def _check_fresh_for_resume(cfg: Config, transport: Transport) -> None:
    """A resume restarts the feeder from the checkpoint: records an earlier run left on the edges would
    be trained a second time, so they must be gone."""
    if await newest_payload(transport, PROMPTS) is not None:
        raise SetupError(
            f"--resume: run {cfg.run.name!r} still has records on its streams; the checkpoint restarts the "
            f"feeder, so clear them first with `rollstream reset` (or resume under another run.name)"
        )
