"""How the five stages are wired from a config: one place that builds stages, workers and transport."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

from pipeline.worker import Worker


class SetupError(RuntimeError):
    """A problem the user fixes in their config or environment (printed as one line, no traceback)."""


def resolve_model_dir(spec: str, progress: Any = print) -> Path:
    """``"tiny"`` -> the project's tiny model (built on first use); else a local model directory."""
    if spec == "tiny":
        from stages.tiny_model import tiny_model_path

        return tiny_model_path(progress=progress)
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise SetupError(
            f"model.model = {spec!r}: no model there (expected a directory with config.json); "
            f'give a local model directory, or "tiny" for the built-in tiny model (models are never downloaded)'
        )
    return path.resolve()


def quiet_libraries() -> None:
    """No hub access, no per-file progress bars: the live display is ours."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def load_rows(cfg: Any) -> list[dict[str, Any]]:
    from stages.data import load_dataset

    d = cfg.data
    seed = d.data_seed if d.data_seed is not None else cfg.run.seed
    return load_dataset(d.dataset, columns=dict(d.columns), system=d.system, size=d.dataset_size, seed=seed)


def build_stage(
    name: str,
    cfg: Any,
    *,
    model_dir: Path | None = None,
    rows: list[dict[str, Any]] | None = None,
    output_dir: Path | None = None,
    engine: Any = None,
    on_step: Any = None,
) -> Any:
    if name == "feeder":
        from stages.feeder import Feeder

        prompt_length = None
        if feeder_tokenizes(cfg):
            from transformers import AutoTokenizer

            from stages.data import prompt_token_ids

            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
            prompt_length = lambda messages: len(prompt_token_ids(tokenizer, messages))
        return Feeder(cfg, rows, prompt_length)
    if name == "rollout":
        from stages.rollout import Rollout

        return Rollout(cfg, model_dir, engine=engine)
    if name == "reward":
        from stages.reward import Reward

        return Reward(cfg)
    if name == "advantage":
        from stages.advantage import Advantage

        return Advantage(cfg)
    if name == "learner":
        from stages.feeder import plan_batches
        from stages.learner import Learner

        return Learner(cfg, model_dir, output_dir, plan_batches(cfg, len(rows)).num_batches, on_step=on_step)
    raise SetupError(f"unknown stage {name!r}; choose one of feeder, rollout, reward, advantage, learner")


def feeder_tokenizes(cfg: Any) -> bool:
    """The feeder needs the tokenizer only to skip over-long prompts (truncation_strategy = "delete")."""
    return cfg.data.max_length is not None and cfg.grpo.truncation_strategy == "delete"


def make_worker(stage: Any, transport: Any, cfg: Any, **overrides: Any) -> Worker:
    from pipeline import metrics

    metrics.init_run(cfg.run.name, cfg.grpo.max_staleness)
    t = cfg.transport
    options = {
        "run": cfg.run.name,
        "batch_size": t.batch_size,
        "block_ms": t.block_ms,
        "min_idle_ms": t.min_idle_ms,
        "metrics_host": cfg.run.metrics_host,
    }
    options.update(overrides)
    return Worker(stage, transport, **options)


async def open_transport(cfg: Any) -> Any:
    from pipeline.transport import connect

    t = cfg.transport
    return await _maybe_await(
        connect(t.kind, run=cfg.run.name, url=t.url, max_deliveries=t.max_deliveries, maxlen=t.maxlen)
    )


async def _maybe_await(value: Any) -> Any:
    if hasattr(value, "__await__"):
        return await value
    return value


def train(cfg: Any, resume: str | None = None) -> int:
    """``rollstream train``: every stage in this process, live progress, a summary at the end.
    ``resume``: ``latest`` or a checkpoint / output directory (see ``stages.checkpoint.resolve``)."""
    import asyncio

    return asyncio.run(run_pipeline(cfg, resume=resume)).exit_code


def feeder_start_of(feeder: Any, batch: int) -> Any:
    """Where ``feeder`` must restart to produce generation batch ``batch`` (a FeederPosition), or None
    when it cannot tell. A released batch recorded its start; the next unreleased one starts at the
    feeder's current position (every replacement it took since was for an earlier, trained batch)."""
    start = feeder.batch_starts.get(batch)
    if start is None and feeder.position.batch == batch and feeder.position.slot == 0:
        start = feeder.position
    return start


def resume_checkpoint(cfg: Any, resume: str, num_batches: int) -> Any:
    """The checkpoint ``--resume`` names, checked to be one this run can continue from."""
    from stages import checkpoint as checkpoints

    given = Path(cfg.run.output_dir).expanduser() if cfg.run.output_dir else None
    found = checkpoints.resolve(resume, given, cfg.run.name)
    state = found.state
    if state.get("feeder_position") is None:
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


async def run_pipeline(cfg: Any, *, engine: Any = None, transport: Any = None, resume: str | None = None) -> RunResult:
    """All five stages in this process on one transport (memory by default). ``engine`` lets tests
    share one vLLM engine; ``transport`` lets them pass an open one. ``resume`` continues from a
    checkpoint (``latest`` or a directory) in the checkpoint's output directory."""
    import asyncio
    import os
    import signal
    import time

    from pipeline import log
    from pipeline.config import resolve_output_dir
    from pipeline.plugins import load_plugins
    from pipeline.progress import LiveProgress, summarize
    from pipeline.report import Reporters
    from pipeline.worker import run_together
    from stages.feeder import plan_batches

    quiet_libraries()
    load_plugins(cfg.run.external_plugins)
    rows = load_rows(cfg)
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
        model_dir = resolve_model_dir(cfg.model.model)
    except BaseException:
        if owns_transport:
            await transport.close()
        raise
    os.environ.setdefault("VLLM_CACHE_ROOT", str(output_dir / ".vllm-cache"))
    if engine is not None:
        await engine.reset_weights(model_dir)
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
        if checkpoint is not None:
            learner.resume_from = checkpoint
            feeder.restart_at(checkpoint.feeder_position)
        workers = {name: make_worker(stage, transport, cfg) for name, stage in stages.items()}
        for sig in (signal.SIGINT, signal.SIGTERM):  # one handler drains every stage
            loop.add_signal_handler(sig, lambda s=sig: [w.request_stop(f"signal {s.name}") for w in workers.values()])
        async with progress, serve_metrics(cfg, list(workers.values())):
            code = await run_together(list(workers.values()), main=workers["learner"])
        await write_outputs(transport, output_dir)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if reporters is not None:
            reporters.close()
        if owns_transport:
            await transport.close()
        log.configure(cfg.run.log_level)  # back to stderr before the file closes
        log_file.close()
    summary = summarize(output_dir, cfg, time.monotonic() - started)
    return RunResult(code, output_dir, summary)


def write_config(cfg: Any, output_dir: Path) -> None:
    """The resolved config next to the run's outputs (``rollstream inspect`` shows it)."""
    from pipeline.config import format_config
    from pipeline.inspect_run import CONFIG_FILE

    (output_dir / CONFIG_FILE).write_text(format_config(cfg))


class serve_metrics:
    """The in-process ``train`` serves ONE /metrics and /healthz for all its stages on
    ``run.metrics_port`` (0 = off); ready while every stage is."""

    def __init__(self, cfg: Any, workers: list[Worker]) -> None:
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
        from pipeline import metrics

        if self.cfg.run.metrics_port:
            self.server = await metrics.serve(self.cfg.run.metrics_host, self.cfg.run.metrics_port, self.health)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def write_outputs(transport: Any, output_dir: Path) -> None:
    """At the end of ``train``: the dead letters (a memory run's edges die with it) and plot.png."""
    import asyncio

    from pipeline import inspect_run, plot

    await inspect_run.write_dead_letters(transport, output_dir / inspect_run.DEAD_LETTERS_FILE)
    if (output_dir / "metrics.jsonl").exists():
        await asyncio.to_thread(plot.write, output_dir)
async def _check_fresh_for_resume(cfg: Any, transport: Any) -> None:
    """A resume restarts the feeder from the checkpoint: records an earlier run left on the edges would
    be trained a second time, so they must be gone."""
    from pipeline.transport.base import newest_payload
    from stages import PROMPTS

    if await newest_payload(transport, PROMPTS) is not None:
        raise SetupError(
            f"--resume: run {cfg.run.name!r} still has records on its streams; the checkpoint restarts the "
            f"feeder, so clear them first with `rollstream reset` (or resume under another run.name)"
        )
