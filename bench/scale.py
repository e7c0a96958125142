"""Scale-out with cost models: the real pipeline (worker processes, Redis, records) with simulated GPUs.

The feeder, reward and advantage stages are the real ones; every stage is its own process (``1 -> 16``
rollout workers, ``1 -> 4`` reward workers) on a Redis server this script starts on a free port. Two
things are replaced by cost models that plug in where the real ones do:

- ``CostModelEngine`` implements the rollout's engine protocol (``EngineBase``: ``generate``, weight
  loads behind the same gates) and sleeps (asyncio) the time a GPU engine would take: each request gets a
  completion length drawn from a long-tailed (log-normal, capped) distribution, waits for one of the
  engine's ``max_concurrent`` sequence slots, then takes ``ttft + length * itl`` seconds (decode is
  memory-bound, so a sequence's time per token barely depends on how many run beside it up to the slot
  limit). Its completions are real token-id/log-prob arrays of that length, so records have real sizes.
- ``CostModelLearner`` is the real learner stage (grouping, staleness checks, feedback, publishing,
  metrics.jsonl) whose training step sleeps ``tokens / learner_tokens_per_second`` and whose weight
  snapshot is a marker directory; the engine's reload sleeps ``weight_sync_seconds``.

Because the GPUs are simulated by sleeping, the figures hold on a loaded machine as long as the
pipeline's own CPU work keeps up (the JSON reports that CPU per sample).

Default figures, an H100 (989 TFLOP/s dense bf16, 3.35 TB/s HBM3) with a 7B model in bf16 (not measured
here; derived from the data sheet, override them with what you measure):
- rollout: ``itl`` 12 ms/token per sequence: one decode step reads the 14 GB of weights (4.2 ms at
  3.35 TB/s) plus the KV cache of up to ``max_concurrent`` = 256 sequences; ``ttft`` 50 ms;
- learner: 8 x 7e9 FLOPs per token (forward + backward 6P, reference forward 2P) at 40 % MFU
  -> 7,060 tokens/s per GPU, ``learner_gpus`` 8 (FSDP);
- lengths: log-normal, median 300 completion tokens, sigma 0.8, cap 2048; prompts of 200 tokens count
  for the learner's time.

Reported per configuration (rollout workers W, reward workers R, max_staleness k): steady samples/s;
the ideal ``1 / max(t_rollout / W, t_learn)`` with t_rollout the cost model's per-sample time of one
engine on one generation batch (its makespan / batch size, Monte Carlo) and t_learn the learner's; the
overlap efficiency = measured / ideal; the speedup over the synchronous schedule (the same W, R at
max_staleness 0, measured); the bottleneck stage from the mean queue depths (the edge whose consumers
have the most work waiting); the pipeline's CPU per sample by stage kind (everything but the sleeps:
transport, serialization, stage logic) and Redis's CPU per record, with the record rate at which one
Redis core saturates and the shards a higher rate would need. One extra ``balanced`` configuration at
W = 4 sets the learner's GPUs so that t_learn equals the batch's rollout makespan on 4 engines (where
overlap's limit is 2x). The longest request bounds a batch's makespan however many engines share it, so
at large W a bounded-staleness pipeline is tail-bound: the JSON gives the ideal both ways (see ``analyse``).

``--weight-sync`` sets ``rollout.weight_load`` for every run: ``pause`` (the pipeline's default) makes a weight
load wait for the requests in flight, so at W > 1 the next batch waits for the previous batch's longest request;
``in_flight`` loads beside them.

    .venv/bin/python bench/scale.py                     # W = 1, 2, 4, 8, 16, k = 1 and 0, plus balanced
    .venv/bin/python bench/scale.py --workers 1,4 --ks 1 --batches 3 --no-balanced --time-scale 0.2   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report_json import emit


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Simulated GPU time; ``time_scale`` multiplies every sleep (0.5 = the run takes half the simulated time)."""

    itl_seconds: float = 0.012
    ttft_seconds: float = 0.05
    max_concurrent: int = 256
    median_completion_tokens: float = 300.0
    sigma: float = 0.8
    max_completion_tokens: int = 2048
    prompt_tokens: int = 200
    learner_tokens_per_second_per_gpu: float = 7060.0
    learner_gpus: float = 8.0
    weight_sync_seconds: float = 1.0
    time_scale: float = 0.5

    def completion_length(self, rng: random.Random) -> int:
        n = round(rng.lognormvariate(math.log(self.median_completion_tokens), self.sigma))
        return max(1, min(self.max_completion_tokens, n))

    def request_seconds(self, tokens: int) -> float:
        return self.ttft_seconds + tokens * self.itl_seconds

    def learn_seconds(self, tokens: int) -> float:
        return tokens / (self.learner_tokens_per_second_per_gpu * self.learner_gpus)


# --------------------------------------------------------------------------------- cost-model stages


def _engine_base() -> type:
    from engines.base import EngineBase

    return EngineBase


class CostModelEngine(_engine_base()):
    """The rollout's engine protocol with simulated time (see the module docstring)."""

    def __init__(self, cost: CostModel, seed: int, model_dir: Path) -> None:
        super().__init__(tokenizer=None, model_dir=model_dir)
        self.cost = cost
        self.seed = seed
        self._slots = asyncio.Semaphore(cost.max_concurrent)
        self._frozen_seconds = 0.0  # simulated time in-flight weight loads have frozen the engine so far

    def encode_prompt(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:  # no chat template here
        text = "".join(m["content"] for m in messages)
        return [b + 3 for b in text.encode()]  # byte ids: real prompt records, no tokenizer to load

    def decode(self, token_ids: list[int]) -> str:
        return str(len(token_ids))  # the reward functions run on a short text; the sizes are in the ids

    async def generate(
        self, prompt_ids: list[int], *, request_id: str, seed: int | None, max_tokens: int, **sampling: Any
    ) -> Any:
        import numpy as np

        from engines.base import Sample

        rng = random.Random(f"{self.seed}/{request_id}/{seed}")
        tokens = min(max_tokens, self.cost.completion_length(rng))
        async with self._slots, self.running("pause"):
            started_at = self.version
            frozen = self._frozen_seconds
            await asyncio.sleep(self.cost.request_seconds(tokens) * self.cost.time_scale)
            while self._frozen_seconds > frozen:  # in-flight loads froze it meanwhile: it ends that much later
                delay, frozen = self._frozen_seconds - frozen, self._frozen_seconds
                await asyncio.sleep(delay)
        ids = np.random.default_rng(rng.randrange(2**32)).integers(3, 150_000, size=tokens).tolist()
        finish = "length" if tokens >= max_tokens else "stop"
        return Sample(ids, [-1.0] * tokens, finish, started_at, self.version)

    async def _reload(self, file: Path, version: int) -> None:
        await asyncio.sleep(self.cost.weight_sync_seconds * self.cost.time_scale)

    async def _reload_in_flight(self, file: Path, version: int) -> None:
        """As vLLM's in-flight load: every running request is frozen for the load's duration."""
        seconds = self.cost.weight_sync_seconds * self.cost.time_scale
        self._frozen_seconds += seconds
        await asyncio.sleep(seconds)

    def shutdown(self) -> None:
        pass


def cost_model_learner(cost: CostModel) -> type:
    """The real Learner stage with its trainer's training step and snapshots replaced by the cost model."""
    from config import Config
    from stages.learner import Learner
    from trainer.trainer import Trainer

    class CostModelTrainer(Trainer):
        def load(self, resume_from: Any = None) -> None:
            pass  # no model: the cost model stands in for it

        def train_generation_batch(self, groups: list[Any], version: int, images: Any = None) -> list[dict[str, Any]]:
            records = [r for group in groups for r in group.records]
            tokens = sum(cost.prompt_tokens + len(r.trajectory.completion_ids) // 4 for r in records)
            time.sleep(cost.learn_seconds(tokens) * cost.time_scale)  # runs in a thread: the loop stays live
            rows = []
            for _ in range(self.cfg.grpo.steps_per_generation):
                self.step += 1
                rows.append(
                    {"step": self.step, "time": time.time(), "samples": len(records), "tokens": tokens}
                )
            return rows

        def publish(self, version: int, final: bool = False, leased: Any = (), snapshot: bool = True) -> Path:
            path = self.snapshot_dir(version)
            path.mkdir(parents=True, exist_ok=True)  # the rollout checks that a snapshot exists
            return path

        def save_checkpoint(self, state: Any = None) -> None:
            return None

    class CostModelLearner(Learner):
        def __init__(self, cfg: Config, model_dir: Path, output_dir: Path, num_batches: int, **kwargs: Any) -> None:
            super().__init__(cfg, model_dir, output_dir, num_batches, **kwargs)
            self.trainer = CostModelTrainer(cfg, Path(model_dir), Path(output_dir), num_batches)

    return CostModelLearner


# --------------------------------------------------------------------------------- one stage process


async def serve_stage(stage_name: str, spec: dict[str, Any]) -> int:
    from config import load_config
    from data import loading
    from pipeline.transport.base import TransportError
    from rollstream import train as graph
    from stages.feeder import plan_batches
    from stages.rollout import Rollout

    cfg = load_config(str(ROOT / "configs/demo.toml"), spec["overrides"])
    cost = CostModel(**spec["cost"])
    deadline = time.monotonic() + 120  # 20+ processes starting at once on a busy machine: connects time out
    while True:
        try:
            transport = await graph.open_transport(cfg)
            break
        except TransportError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)  # retry the connection until the deadline
    output_dir = Path(spec["output_dir"])
    try:
        if stage_name == "rollout":
            # The rollout reads the model's config.json (an image-prompt model?): a text model's, no weights.
            model_dir = output_dir / "cost-model"
            model_dir.mkdir(parents=True, exist_ok=True)
            (model_dir / "config.json").write_text('{"model_type": "qwen2"}')
            stage = Rollout(cfg, model_dir, engine=CostModelEngine(cost, seed=cfg.run.seed, model_dir=model_dir))
        elif stage_name == "learner":
            rows = loading.load_rows(cfg)
            stage = cost_model_learner(cost)(
                cfg, Path("."), output_dir, plan_batches(cfg, len(rows)).num_batches
            )
        else:
            rows = loading.load_rows(cfg) if stage_name == "feeder" else None
            stage = graph.build_stage(stage_name, cfg, rows=rows, output_dir=output_dir)
        worker = graph.make_worker(
            stage, transport, cfg, worker_id=f"{stage_name}-{os.getpid()}", metrics_port=0
        )
        worker.install_signal_handlers()
        return await worker.serve()
    finally:
        await transport.close()


# -------------------------------------------------------------------------------------- the parent


class RedisServer:
    """A redis-server of this benchmark's own, on a free loopback port, no persistence."""

    def __init__(self, directory: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("bench/scale.py needs redis-server on PATH (apt-get install redis-server)")
        self.process = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(directory),
            ],
            stdout=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        import redis.asyncio as redis

        client = redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    await client.ping()
                    return
                except (redis.ConnectionError, OSError):
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)  # poll until the server accepts connections
        finally:
            await client.aclose()

    async def info(self) -> dict[str, Any]:
        import redis.asyncio as redis

        client = redis.from_url(self.url)
        try:
            return await client.info()
        finally:
            await client.aclose()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def makespan(lengths: list[int], cost: CostModel) -> float:
    """Seconds one engine takes for these requests: each takes the next free slot (list scheduling)."""
    import heapq

    slots = [0.0] * min(cost.max_concurrent, len(lengths))
    for n in lengths:
        start = heapq.heappop(slots)
        heapq.heappush(slots, start + cost.request_seconds(n))
    return max(slots)


def per_sample_costs(
    cost: CostModel, batch: int, max_tokens: int, workers: int = 1, trials: int = 200
) -> dict[str, float]:
    """Simulated seconds per sample: ``t_rollout`` of one engine generating a whole generation batch
    (its makespan / batch), ``t_rollout_w`` of ``workers`` engines sharing it group by group (the
    batch's makespan, the longest request included, / batch), and ``t_learn`` of the learner."""
    rng = random.Random(0)
    one, shared, learn = [], [], []
    for _ in range(trials):
        lengths = [min(max_tokens, cost.completion_length(rng)) for _ in range(batch)]
        one.append(makespan(lengths, cost))
        groups = [lengths[i : i + 8] for i in range(0, batch, 8)]
        shared.append(
            max(
                makespan([n for g in groups[w::workers] for n in g], cost) if groups[w::workers] else 0.0
                for w in range(workers)
            )
        )
        learn.append(cost.learn_seconds(sum(cost.prompt_tokens + n for n in lengths)))
    return {
        "t_rollout": sum(one) / trials / batch,
        "t_rollout_w": sum(shared) / trials / batch,
        "t_learn": sum(learn) / trials / batch,
    }


def stage_overrides(
    run: str, url: str, output_dir: Path, k: int, batches: int, batch: int, groups: int, max_tokens: int,
    weight_sync: str = "pause",
) -> list[str]:
    per_device = 16
    values = {
        "run.name": run,
        "run.output_dir": str(output_dir),
        "run.max_steps": batches * batch // per_device,
        "transport.kind": "redis",
        "transport.url": url,
        "grpo.generation_batch_size": batch,
        "grpo.per_device_train_batch_size": per_device,
        "grpo.max_staleness": k,
        "grpo.max_completion_length": max_tokens,
        "rollout.max_model_len": max_tokens + 512,
        "rollout.max_concurrent_groups": groups,
        "rollout.weight_load": weight_sync,
        "reward.reward_funcs": ["format"],
        "reward.reward_weights": [1.0],
    }
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


async def run_configuration(
    redis_server: RedisServer,
    cost: CostModel,
    *,
    rollout_workers: int,
    reward_workers: int,
    k: int,
    batches: int,
    batch: int,
    max_tokens: int,
    tmp: Path,
    timeout_s: float,
    weight_sync: str = "pause",
) -> dict[str, Any]:
    """One pipeline run: start every stage process, watch the queues, collect the figures."""
    from config import load_config
    from rollstream import train as graph
    from rollstream.top import snapshot

    run = f"scale-{os.getpid()}-{rollout_workers}x{reward_workers}-k{k}-{time.monotonic_ns()}"
    output_dir = tmp / run
    groups = batch // 8
    overrides = stage_overrides(run, redis_server.url, output_dir, k, batches, batch, groups, max_tokens, weight_sync)
    spec = tmp / f"{run}.json"
    spec.write_text(
        json.dumps({"overrides": overrides, "cost": dataclasses.asdict(cost), "output_dir": str(output_dir)})
    )
    stages = ["learner", "advantage", "feeder"] + ["reward"] * reward_workers + ["rollout"] * rollout_workers
    info_before = await redis_server.info()
    started = time.monotonic()
    children = []
    for name in stages:
        log = open(tmp / f"{run}-{name}-{len(children)}.log", "w")  # noqa: SIM115, ASYNC230 - closed below
        command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--spec", str(spec)]
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)  # noqa: ASYNC220 - returns at once
        children.append((name, child, log))
    cfg = load_config(str(ROOT / "configs/demo.toml"), overrides)
    transport = await graph.open_transport(cfg)
    depths: dict[str, list[int]] = {}
    usage: dict[int, float] = {}
    try:
        while any(p.returncode is None for _, p, _ in children):
            crashed = any(p.returncode not in (None, 0) for _, p, _ in children)
            if crashed or time.monotonic() - started > timeout_s:  # the others would wait for it forever
                for _, p, _ in children:
                    if p.returncode is None:
                        p.kill()
            try:
                snap = await snapshot(transport)
                if snap["weights"] is not None and not snap["weights"]["final"]:  # count while training runs
                    for edge in snap["edges"]:
                        depths.setdefault(edge["edge"], []).append(edge["lag"] + edge["pending"])
            except (OSError, TimeoutError):
                pass  # a slow refresh on a loaded machine: the next one counts
            for _, p, _ in children:
                if p.returncode is None:
                    pid, status, rusage = os.wait4(p.pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
                    if pid:
                        p.returncode = os.waitstatus_to_exitcode(status)
                        usage[p.pid] = rusage.ru_utime + rusage.ru_stime
            await asyncio.sleep(0.5)  # the queue-depth sampling interval
        info_after = await redis_server.info()
        added = 0
        client = getattr(transport, "_client", None)
        for edge in ("prompts", "trajectories", "scored", "train", "feedback", "weights"):
            if client is not None and await client.exists(f"rollstream:{run}:{edge}"):
                added += int((await client.xinfo_stream(f"rollstream:{run}:{edge}"))["entries-added"])
    finally:
        await transport.close()
        for _, _, log in children:
            log.close()
    exit_codes = {f"{name}-{i}": p.returncode for i, (name, p, _) in enumerate(children)}
    metrics_file = output_dir / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    )
    steps_per_generation = batch // 16
    if not rows or rows[-1]["step"] <= steps_per_generation:  # no steady window: say why, go on
        failed = [name for name, code in exit_codes.items() if code != 0] or ["learner"]
        tails = {
            name: Path(log.name).read_text(errors="replace").strip().splitlines()[-8:]
            for (stage, _, log), name in zip(children, exit_codes)
            if name in failed or name.startswith(tuple(failed))
        }
        return {
            "rollout_workers": rollout_workers,
            "reward_workers": reward_workers,
            "max_staleness": k,
            "error": f"{len(rows)} optimizer steps written",
            "exit_codes": exit_codes,
            "log_tails": tails,
        }
    t_first = next(r["time"] for r in rows if r["step"] >= steps_per_generation)
    steady = (rows[-1]["step"] - steps_per_generation) * 16 / max(rows[-1]["time"] - t_first, 1e-9)
    cpu_by_stage: dict[str, float] = {}
    for name, p, _ in children:
        cpu_by_stage[name] = cpu_by_stage.get(name, 0.0) + usage.get(p.pid, 0.0)
    samples = rows[-1]["step"] * 16
    redis_cpu = (info_after["used_cpu_sys"] + info_after["used_cpu_user"]) - (
        info_before["used_cpu_sys"] + info_before["used_cpu_user"]
    )
    mean_depth = {edge: round(sum(v) / len(v), 1) for edge, v in depths.items() if v}
    return {
        "rollout_workers": rollout_workers,
        "reward_workers": reward_workers,
        "max_staleness": k,
        "exit_codes": exit_codes,
        "samples": samples,
        "wall_seconds": round(time.monotonic() - started, 1),
        "steady_samples_per_second": round(steady / 1, 3),
        "mean_queue_depth": mean_depth,
        "cpu_seconds_per_sample": {name: round(v / samples, 5) for name, v in cpu_by_stage.items()},
        "redis_records": added,
        "redis_cpu_seconds_per_record": round(redis_cpu / added, 7) if added else None,
    }


# Which stage consumes each edge: a deep queue on an edge means its consumer is behind.
CONSUMER_OF = {"prompts": "rollout", "trajectories": "reward", "scored": "advantage", "train": "learner"}


def bottleneck(result: dict[str, Any], batch: int) -> str:
    """The stage whose input queue is deepest, relative to a generation batch. The learner holds a
    whole batch by design, so its queue counts only beyond one batch."""
    depth = dict(result["mean_queue_depth"])
    depth["train"] = max(0.0, depth.get("train", 0.0) * 8 - batch) / 8  # train entries are groups of 8
    depth["prompts"] = depth.get("prompts", 0.0) * 8  # prompt tasks are groups of 8 requests
    edge = max(CONSUMER_OF, key=lambda e: depth.get(e, 0.0))
    return CONSUMER_OF[edge] if depth.get(edge, 0.0) > 0 else "none"


def analyse(result: dict[str, Any], ideal: dict[str, float], cost: CostModel, batch: int) -> None:
    """Add the ideals, the overlap efficiencies and the bottleneck to one configuration's result (in place).

    ``ideal_samples_per_second`` is the issue's 1 / max(t_rollout / W, t_learn): it assumes W engines cut
    a batch's makespan W-fold, which the longest request forbids. ``ideal_tail_aware_samples_per_second``
    uses the makespan of the batch on W engines instead (t_rollout_w); above 1.0 against it means the
    pipeline filled the engines' idle tail with the next batch's requests (max_staleness >= 1)."""
    w = result["rollout_workers"]
    scale = cost.time_scale
    rate_ideal = 1.0 / max(ideal["t_rollout"] / w, ideal["t_learn"]) / scale
    rate_tail = 1.0 / max(ideal["t_rollout_w"], ideal["t_learn"]) / scale
    result["simulated_seconds_per_sample"] = {k: round(v, 6) for k, v in ideal.items()}
    result["ideal_samples_per_second"] = round(rate_ideal, 3)
    result["overlap_efficiency"] = round(result["steady_samples_per_second"] / rate_ideal, 3)
    result["ideal_tail_aware_samples_per_second"] = round(rate_tail, 3)
    result["overlap_efficiency_tail_aware"] = round(result["steady_samples_per_second"] / rate_tail, 3)
    result["ideal_bound"] = "learner" if ideal["t_learn"] >= ideal["t_rollout"] / w else "rollout"
    result["bottleneck_from_queues"] = bottleneck(result, batch)


def redis_limits(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Where one Redis core saturates, from the measured Redis CPU per record, and what sharding needs."""
    per_record = [r["redis_cpu_seconds_per_record"] for r in results if r.get("redis_cpu_seconds_per_record")]
    if not per_record:
        return {}
    cpu = sorted(per_record)[len(per_record) // 2]
    records_per_sample = sorted(r["redis_records"] / r["samples"] for r in results if r.get("samples"))
    per_sample = records_per_sample[len(records_per_sample) // 2]
    saturation = 1.0 / cpu
    return {
        "redis_cpu_seconds_per_record_median": cpu,
        "records_per_sample": round(per_sample, 2),
        "saturation_records_per_second": round(saturation),
        "saturation_samples_per_second": round(saturation / per_sample),
        "sharding": (
            "Redis runs each command on one core, so one server tops out near saturation_records_per_second. "
            "Every edge is its own stream key: a Redis Cluster with each edge on its own shard (hash tags per "
            "edge) lifts the cap to the busiest edge's share (trajectories + scored carry most records); beyond "
            "that, split the trajectories/scored edges into N streams keyed by hash(prompt_id) with one consumer "
            "group each, N = ceil(target records/s on that edge / saturation_records_per_second)."
        ),
    }


async def measure(
    cost: CostModel,
    workers: list[int],
    ks: list[int],
    batches: int,
    batch: int,
    max_tokens: int,
    balanced: bool,
    timeout_s: float,
    partial_out: str | None = None,
    weight_sync: str = "pause",
) -> dict[str, Any]:
    configurations = [(w, max(1, min(4, w // 4)), k, cost) for w in workers for k in ks]
    if balanced:  # learner GPUs such that t_learn = the batch's makespan on 4 engines: overlap's 2x limit
        four = per_sample_costs(cost, batch, max_tokens, workers=4)
        gpus = cost.learner_gpus * four["t_learn"] / four["t_rollout_w"]
        balanced_cost = dataclasses.replace(cost, learner_gpus=round(gpus, 3))
        configurations = [(4, 1, k, balanced_cost) for k in ks] + configurations  # the 2x goal's runs first
    results = []
    with tempfile.TemporaryDirectory(prefix="rollstream-scale-") as tmp:
        redis_server = RedisServer(Path(tmp))
        try:
            await redis_server.wait_ready()
            for w, r, k, c in configurations:
                result = await run_configuration(
                    redis_server,
                    c,
                    rollout_workers=w,
                    reward_workers=r,
                    k=k,
                    batches=batches,
                    batch=batch,
                    max_tokens=max_tokens,
                    tmp=Path(tmp),
                    timeout_s=timeout_s,
                    weight_sync=weight_sync,
                )
                result["weight_sync"] = weight_sync
                result["learner_gpus"] = c.learner_gpus
                result["balanced"] = c is not cost
                if "error" not in result:
                    analyse(result, per_sample_costs(c, batch, max_tokens, workers=w), c, batch)
                results.append(result)
                print(json.dumps(result), file=sys.stderr)
                if partial_out:  # a sweep cut short still leaves the runs it finished
                    Path(partial_out).write_text(
                        json.dumps(report(cost, batch, batches, max_tokens, results)) + "\n"
                    )
        finally:
            redis_server.stop()
    return report(cost, batch, batches, max_tokens, results)


def report(cost: CostModel, batch: int, batches: int, max_tokens: int, results: list[dict[str, Any]]) -> dict:
    """The JSON of a sweep from its per-configuration results (also usable on a partial sweep's lines)."""
    ideal = per_sample_costs(cost, batch, max_tokens)
    for result in results:  # speedup over the synchronous schedule on the same simulated resources
        if "error" in result:
            continue
        sync = next(
            (
                s
                for s in results
                if s["max_staleness"] == 0
                and "error" not in s
                and s["rollout_workers"] == result["rollout_workers"]
                and s["balanced"] == result["balanced"]
            ),
            None,
        )
        if sync is not None and result["max_staleness"] != 0:
            result["speedup_over_sync"] = round(
                result["steady_samples_per_second"] / sync["steady_samples_per_second"], 3
            )
    return {
        "cost_model": dataclasses.asdict(cost),
        "generation_batch_size": batch,
        "generation_batches": batches,
        "max_completion_length": max_tokens,
        "simulated_seconds_per_sample": {k: round(v, 6) for k, v in ideal.items()},
        "runs": results,
        "redis": redis_limits(results),
        "goals": "overlap_efficiency >= 0.9 until the learner is the bottleneck; speedup_over_sync >= 1.8 where "
        "t_rollout / W = t_learn (the balanced runs)",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "command": " ".join(["python", "bench/scale.py", *sys.argv[1:]]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = CostModel()
    for field in dataclasses.fields(CostModel):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}",
            type=type(getattr(defaults, field.name)),
            default=getattr(defaults, field.name),
        )
    parser.add_argument(
        "--workers", default="1,2,4,8,16", help="rollout worker counts (reward workers: W // 4, 1..4)"
    )
    parser.add_argument("--ks", default="1,0", help="max_staleness values (0 = the synchronous baseline)")
    parser.add_argument(
        "--batches", type=int, default=4, help="generation batches per run (the first is not timed)"
    )
    parser.add_argument("--generation-batch-size", type=int, default=256)
    parser.add_argument("--no-balanced", action="store_true", help="skip the t_rollout / 4 = t_learn runs")
    parser.add_argument("--weight-sync", default="pause", choices=["pause", "drain", "in_flight"],
                        help="rollout.weight_load of every run (pause, the pipeline's default: a load waits for "
                        "the running requests; in_flight: it does not)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before one run's processes are killed"
    )
    parser.add_argument("--json-out", default="bench/results/scale.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        sys.exit(asyncio.run(serve_stage(args.child, json.loads(Path(args.spec).read_text()))) or 0)
    cost = CostModel(**{f.name: getattr(args, f.name) for f in dataclasses.fields(CostModel)})
    results = asyncio.run(
        measure(
            cost,
            [int(w) for w in args.workers.split(",")],
            [int(k) for k in args.ks.split(",")],
            args.batches,
            args.generation_batch_size,
            cost.max_completion_tokens,
            not args.no_balanced,
            args.timeout,
            args.json_out,
            args.weight_sync,
        )
    )
    emit(results, args.json_out)


if __name__ == "__main__":
    main()
