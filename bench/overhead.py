"""The pipeline's own cost per sample (#38 item 1): core-milliseconds per sample that a one-process run
(``rollstream train``'s stages over the memory transport, then over Redis) spends outside the engine and the
learner's compute, where that time goes, and the ceiling it implies.

Each transport gets ``--repeats`` runs (in rounds; the run of median samples/s is reported, with every run's
samples/s and outside figure) of ``--steps`` optimizer steps on one shared vLLM engine, with bench/peer_trl.py's
settings for the workload (demo: the tiny model, 16-token completions; mid). CPU time is read per thread of
this process (``/proc/self/task/*/stat``), for the engine-core process (psutil) and for redis-server (INFO
cpu), at two points of the steady window: the end of the first ``--warm-batches`` generation batches (start-up,
model load and the engine's first batch excluded) and the last step (shut-down excluded). Threads by role:

- ``engine_process``: vLLM's engine core (scheduling, the forward passes, sampling, weight reloads);
- ``learner``: the asyncio executor threads, where the learner trains, publishes and snapshots;
- ``learner_passes``: the learner's ``ref-pass`` thread (reference and old-policy log-prob passes);
- ``native_threads``: threads Python did not start, but zmq's: torch's intra-op pool (the learner's, when
  ``learner.torch_threads`` > 1) and the tokenizers' pool;
- ``reward_scoring``: the reward functions' ``reward-N`` threads;
- ``event_loop``: the main thread: every stage's handlers, records, queues, the transport client, metrics,
  and vLLM's AsyncLLM client (its output handler runs on this loop);
- ``other_threads``: the rest of this process (threads that exited in the window included).

``outside_engine_and_learner`` is the sum of the last three: the pipeline's own work per sample (reward
functions included, shown apart). A second run per transport (``--profile``) profiles the event loop with
cProfile on thread CPU time over the same window: the shares by area (stage, transport, records, vLLM client,
asyncio, ...) and the top functions apply to the unprofiled run's event-loop figure. The machine's limit
(peer_trl's ``limit``: generation alone, then a bare learner step alone, core-ms per sample) runs first,
in this invocation, unless ``--no-limit``.

    .venv/bin/python bench/overhead.py [--workload demo|mid] [--steps 200] [--repeats 3] [--transports memory,redis]
        [--redis-url redis://127.0.0.1:6379/0] [--profile] [--json-out bench/results/overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import json
import os
import platform
import pstats
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peer_trl import SHARED, WORKLOADS, measure_limit, rollstream_config, rollstream_overrides
from bench.report_json import emit

ROLES = ("engine_process", "learner", "learner_passes", "native_threads", "reward_scoring", "event_loop",
         "other_threads")
OUTSIDE = ("reward_scoring", "event_loop", "other_threads")
_TICK = os.sysconf("SC_CLK_TCK")


def thread_role(name: str | None, comm: str) -> str:
    if name is None:  # not a Python thread: zmq's I/O threads (the AsyncLLM client), else a native pool
        return "other_threads" if comm.startswith("ZMQ") else "native_threads"
    if name == "MainThread":
        return "event_loop"
    if name.startswith("asyncio_"):
        return "learner"
    if name.startswith("ref-pass"):
        return "learner_passes"
    if name.startswith("reward-"):
        return "reward_scoring"
    return "other_threads"


def _stat_cpu(path: str) -> float:
    """utime + stime (fields 14 and 15 of a /proc stat file), in seconds."""
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_by_role(core_pids: list[int], redis_client: Any) -> dict[str, float]:
    """CPU seconds so far of this process's threads by role, the engine core and redis-server."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    roles: dict[str, float] = dict.fromkeys(ROLES, 0.0)
    live = 0.0
    for tid in os.listdir("/proc/self/task"):
        try:
            cpu = _stat_cpu(f"/proc/self/task/{tid}/stat")
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while listed: its time is in the process total below
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            comm = ""
        roles[thread_role(names.get(int(tid)), comm)] += cpu
        live += cpu
    roles["other_threads"] += max(0.0, _stat_cpu("/proc/self/stat") - live)  # threads that have exited
    roles["engine_process"] = sum(sum(process_cpu(pid)) for pid in core_pids)
    if redis_client is not None:
        roles["redis_server"] = redis_cpu(redis_client)
    return roles


def process_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of a process and of its descendants (the rollout worker's engine core)."""
    import psutil

    process = psutil.Process(pid)
    own = sum(process.cpu_times()[:2])
    return own, sum(sum(child.cpu_times()[:2]) for child in process.children(recursive=True))


def redis_cpu(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class StepCounter:
    """Rows of a metrics.jsonl so far, reading only the bytes written since the last call: it is polled on
    the loop being measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rows = path, 0, 0

    def __call__(self) -> int:
        if self.path.exists():
            with self.path.open("rb") as file:
                file.seek(self.offset)
                new = file.read()
            self.offset += len(new)
            self.rows += new.count(b"\n")
        return self.rows


Mark = tuple[float, dict[str, float], int]  # (monotonic time, CPU seconds by name, steps done)


def window(start: Mark, end: Mark, samples_per_step: int) -> tuple[dict[str, Any], dict[str, float], float]:
    """The steady window between two marks: its figures (steps, samples, seconds, rate), core-ms per sample
    by name, and the unrounded samples per second."""
    (t0, cpu0, step0), (t1, cpu1, step1) = start, end
    samples = (step1 - step0) * samples_per_step
    rate = samples / (t1 - t0)
    figures = {"window_steps": [step0, step1], "samples": samples, "seconds": round(t1 - t0, 3),
               "samples_per_second": round(rate, 2)}
    return figures, {name: round(1000 * (cpu1[name] - cpu0[name]) / samples, 4) for name in cpu1}, rate


def cores(ms_per_sample: float, rate: float) -> float:
    """Cores busy on average for ``ms_per_sample`` core-ms per sample at ``rate`` samples per second."""
    return round(ms_per_sample * rate / 1000, 3)


def area(filename: str, function: str) -> str:
    """Where a profiled function lives, for the shares of the event loop's time."""
    path = filename.replace("\\", "/")
    for package in ("stages", "grpo", "rewards", "schedulers", "weights", "trainer", "data", "engines"):
        if f"/{package}/" in path and str(ROOT) in path:
            return f"{package}/{Path(path).stem}" if package == "stages" else package
    if str(ROOT) in path and "/pipeline/" in path:
        if "/transport/" in path:
            return "pipeline/transport"
        return f"pipeline/{Path(path).stem}"
    for library in ("vllm", "redis", "msgspec", "prometheus_client", "structlog", "numpy", "torch", "asyncio",
                    "selectors", "transformers", "tokenizers"):
        if f"/{library}/" in path or path.endswith(f"/{library}.py"):
            return library
    if filename == "~":  # a C function: msgspec's, the socket's, a builtin
        for library in ("msgspec", "numpy", "torch", "select", "socket"):
            if library in function:
                return library
        return "builtins"
    return "other python"


def profile_summary(profile: cProfile.Profile, event_loop_ms: float, top: int = 25) -> dict[str, Any]:
    """The event loop's profiled thread time by area and its top functions, scaled to the unprofiled run's
    event-loop ms per sample (cProfile's own cost inflates the profiled run; its shares are what carry)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]  # pstats keeps its table there
    total = sum(row[2] for row in stats.values()) or 1e-9  # tottime
    areas: dict[str, float] = collections.defaultdict(float)
    entries = []
    for (filename, line, function), (_, calls, tottime, cumtime, callers) in stats.items():
        areas[area(filename, function)] += tottime
        entries.append((tottime, cumtime, calls, f"{Path(filename).name}:{line}({function})"))
    # A stage's entry points (called by the worker) with their cumulative time: the stage's share.
    stages: dict[str, float] = collections.defaultdict(float)
    for (filename, _, function), (_, _, _, cumtime, callers) in stats.items():
        if f"{ROOT}/stages/" in filename and any(c[0].endswith("pipeline/worker.py") for c in callers):
            stages[f"{Path(filename).stem}.{function}"] += cumtime
    scale = event_loop_ms / total

    def ms(seconds: float) -> float:
        return round(seconds * scale, 4)

    entries.sort(reverse=True)
    return {
        "profiled_thread_seconds": round(total, 3),
        "event_loop_ms_per_sample_by_area": {k: ms(v) for k, v in sorted(areas.items(), key=lambda x: -x[1]) if ms(v)},
        "stage_entry_points_ms_per_sample_cumulative": {k: ms(v) for k, v in sorted(stages.items(), key=lambda x: -x[1])},
        "top_functions": [
            {"function": name, "ms_per_sample_own": ms(t), "ms_per_sample_cumulative": ms(c), "calls": n}
            for t, c, n, name in entries[:top]
        ],
    }


async def measure_run(cfg: Any, engine: Any, warm_steps: int, redis_client: Any,
                      profiler: cProfile.Profile | None = None) -> dict[str, Any]:
    """One pipeline run; the CPU counters at the end of the warm-up steps and at the last step (``profiler``
    runs on the event loop's thread between them)."""
    from rollstream import train as graph

    steps_done = StepCounter(Path(cfg.run.output_dir) / "metrics.jsonl")
    marks: dict[str, Mark] = {}

    async def watch() -> None:
        # Polled on the event loop's own thread: cProfile then profiles that thread from the first mark on.
        while True:
            done = steps_done()
            if "start" not in marks and done >= warm_steps:
                marks["start"] = (time.monotonic(), cpu_by_role(engine.core_pids(), redis_client), done)
                if profiler is not None:
                    profiler.enable()
            if "start" in marks and done >= cfg.run.max_steps:
                if profiler is not None:
                    profiler.disable()
                marks["end"] = (time.monotonic(), cpu_by_role(engine.core_pids(), redis_client), done)
                return
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        result = await graph.run_pipeline(cfg, engine=engine)
    finally:
        if not watcher.done():
            watcher.cancel()
    if result.exit_code != 0 or "end" not in marks:
        return {"error": f"the run ended with exit code {result.exit_code} after {steps_done()} steps"}
    figures, per_sample, rate = window(marks["start"], marks["end"], samples_per_step(cfg))
    outside = round(sum(per_sample[r] for r in OUTSIDE), 4)
    total = round(sum(per_sample[r] for r in ROLES), 4)
    return {
        **figures,
        "core_ms_per_sample": {"total_this_process_and_engine": total, **per_sample,
                               "outside_engine_and_learner": outside},
        "busy_cores": cores(total, rate),
        # Every stage, the learner included, shares this process's one interpreter lock: near 1.0, that lock is
        # what caps the rate, whatever the cores.
        "this_process_cores": cores(total - per_sample["engine_process"], rate),
        # The rate one core of orchestration could feed if nothing else were in the way.
        "samples_per_second_per_orchestration_core": round(1000 / outside, 1) if outside else None,
    }


def samples_per_step(cfg: Any) -> int:
    return cfg.grpo.per_device_train_batch_size * cfg.grpo.gradient_accumulation_steps


PROCFILE_STAGES = ("feeder", "rollout", "reward", "advantage", "learner")
PROCFILE_TIMEOUT_S = 900


async def measure_procfile(workload: Any, steps: int, warm_steps: int, redis_url: str,
                           step_samples: int) -> dict[str, Any]:
    """The Procfile's five workers as processes over Redis (one copy each, as `honcho start` runs them):
    core-ms per sample of each process, the rollout's engine core and redis-server, over the same window."""
    import redis

    client = redis.Redis.from_url(redis_url)
    rollstream = Path(sys.executable).parent / "rollstream"
    with tempfile.TemporaryDirectory() as out:
        run = f"overhead-procfile-{uuid.uuid4().hex[:6]}"
        sets = [*rollstream_overrides(workload, 1, steps, out), 'transport.kind="redis"',
                f"transport.url={json.dumps(redis_url)}", f"run.name={json.dumps(run)}"]
        flags = [x for o in sets for x in ("--set", o)]
        steps_done = StepCounter(Path(out) / "metrics.jsonl")
        procs: dict[str, subprocess.Popen] = {}
        # Blocking calls are fine here: this loop runs nothing else while the workers do.
        logs = {stage: open(Path(out) / f"{stage}.log", "wb") for stage in PROCFILE_STAGES}  # noqa: SIM115, ASYNC230
        marks: dict[str, Mark] = {}

        def snapshot() -> dict[str, float]:
            cpu = {}
            for stage, proc in procs.items():
                own, children = process_cpu(proc.pid)
                cpu[f"{stage}_worker" if stage == "rollout" else stage] = own
                if stage == "rollout":
                    cpu["engine_process"] = children
            cpu["redis_server"] = redis_cpu(client)
            return cpu

        try:
            for stage in PROCFILE_STAGES:
                procs[stage] = subprocess.Popen(  # noqa: ASYNC220
                    [str(rollstream), "worker", stage, "-c", "configs/demo.toml", *flags],
                    cwd=ROOT, stdout=logs[stage], stderr=subprocess.STDOUT)
            deadline = time.monotonic() + PROCFILE_TIMEOUT_S
            while "end" not in marks:
                failed = [s for s, p in procs.items() if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    stage = failed[0] if failed else "learner"
                    tail = (Path(out) / f"{stage}.log").read_text(errors="replace")[-2000:]
                    return {"error": f"{stage} {'failed' if failed else 'did not finish'}: {tail}"}
                done = steps_done()
                if "start" not in marks and done >= warm_steps:
                    marks["start"] = (time.monotonic(), snapshot(), done)
                if "start" in marks and done >= steps:
                    marks["end"] = (time.monotonic(), snapshot(), done)
                await asyncio.sleep(0.02)
            for proc in procs.values():
                proc.wait(timeout=120)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs.values():
                log.close()
            client.close()
    figures, per_sample, rate = window(marks["start"], marks["end"], step_samples)
    outside = [name for name in per_sample if name not in ("engine_process", "learner")]
    total = sum(per_sample.values())
    return {
        **figures,
        "core_ms_per_sample": {"total": round(total, 4), **per_sample,
                               "outside_engine_and_learner": round(sum(per_sample[n] for n in outside), 4)},
        "busy_cores": cores(total, rate),
        # Each process's share of one core: the one nearest 1.0 is what saturates.
        "cores_by_process": {name: cores(ms, rate) for name, ms in per_sample.items()},
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import redis

    from engines.models import resolve_model_dir
    from engines.vllm_engine import start_engine
    from rollstream import train as graph

    graph.quiet_libraries()
    workload = WORKLOADS[args.workload]
    transports = args.transports.split(",")
    results: dict[str, Any] = {
        "workload": {"name": args.workload, **vars(workload)},
        "settings": SHARED,
        "steps": args.steps,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": "python bench/overhead.py " + " ".join(sys.argv[1:]),
    }
    if not args.no_limit:
        limit = await measure_limit(workload, args.limit_rounds or workload.limit_rounds)
        results["limit_core_ms_per_sample"] = {
            "generate": round(1000 * limit["generate_core_seconds_per_sample"], 4),
            "learner": round(1000 * limit["learner_core_seconds_per_sample"], 4),
            "compute_bound_samples_per_second": limit["compute_bound_samples_per_second"],
        }
    steps_per_batch = SHARED["generation_batch_size"] // SHARED["per_device_train_batch_size"]
    warm_steps = args.warm_batches * steps_per_batch
    with tempfile.TemporaryDirectory() as scratch:
        cfg = rollstream_config(workload, 1, args.steps, scratch)
        engine = await start_engine(cfg, resolve_model_dir(workload.model, progress=None))
        try:
            clients = {kind: redis.Redis.from_url(args.redis_url) if kind == "redis" else None for kind in transports}

            async def run(kind: str, profiler: cProfile.Profile | None = None) -> dict[str, Any]:
                client = clients[kind]
                extra = [f"transport.kind={kind}"] + ([f"transport.url={args.redis_url}"] if client else [])
                with tempfile.TemporaryDirectory() as out:
                    cfg = rollstream_config(workload, 1, args.steps, out, *extra,
                                            f"run.name=overhead-{kind}-{uuid.uuid4().hex[:6]}")
                    return await measure_run(cfg, engine, warm_steps, client, profiler)

            # Rounds of every transport in turn, so a drift in the machine's load reaches each alike.
            runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in transports}
            for _ in range(args.repeats):
                for kind in transports:
                    runs[kind].append(await run(kind))
            for kind, measured in runs.items():
                failed = [m for m in measured if "error" in m]
                if failed:
                    results[kind] = failed[0]
                    continue
                # The run of median samples/s stands for the transport (its figures belong together).
                ordered = sorted(measured, key=lambda m: m["samples_per_second"])
                results[kind] = median = ordered[(len(ordered) - 1) // 2]
                median["repeats_samples_per_second"] = [m["samples_per_second"] for m in measured]
                median["repeats_outside_engine_and_learner"] = [
                    m["core_ms_per_sample"]["outside_engine_and_learner"] for m in measured]
                if args.profile:
                    profiler = cProfile.Profile(time.thread_time)
                    profiled = await run(kind, profiler)
                    median["event_loop_profile"] = profiled if "error" in profiled else profile_summary(
                        profiler, median["core_ms_per_sample"]["event_loop"])
            for client in clients.values():
                if client is not None:
                    client.close()
            if args.procfile:
                engine.shutdown()  # its cores go to the workers' own engine
                results["procfile"] = await measure_procfile(workload, args.steps, warm_steps, args.redis_url,
                                                             samples_per_step(cfg))
        finally:
            engine.shutdown()
    if "limit_core_ms_per_sample" in results:
        bound = results["limit_core_ms_per_sample"]
        for kind in [*transports, *(["procfile"] if args.procfile else [])]:
            cores = results[kind].get("core_ms_per_sample")
            if cores:
                results[kind]["over_the_limit_ms_per_sample"] = {
                    "engine_process_minus_generate": round(cores["engine_process"] - bound["generate"], 4),
                    "learner_minus_bare_learner": round(
                        cores["learner"] + cores.get("learner_passes", 0.0) - bound["learner"], 4),
                }
                results[kind]["fraction_of_compute_bound"] = round(
                    results[kind]["samples_per_second"] / bound["compute_bound_samples_per_second"], 3
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="demo")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run (16 samples each)")
    parser.add_argument("--warm-batches", type=int, default=2, help="generation batches before the window")
    parser.add_argument("--transports", default="memory,redis")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--repeats", type=int, default=1, help="runs per transport (the median run is reported)")
    parser.add_argument("--profile", action="store_true", help="one more, cProfiled run per transport")
    parser.add_argument("--procfile", action="store_true",
                        help="also the Procfile's workers as processes over Redis (per-process figures)")
    parser.add_argument("--no-limit", action="store_true", help="skip the machine's limit")
    parser.add_argument("--limit-rounds", type=int, default=None,
                        help="generation batches the limit times (default: bench/peer_trl.py's per workload)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    emit(asyncio.run(measure(args)), args.json_out)


if __name__ == "__main__":
    main()
