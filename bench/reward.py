"""Reward-stage throughput and event-loop health, measured in one invocation.

- ``throughput``: records/s of reward workers (separate processes, one Redis stream, one consumer group)
  scoring ``accuracy`` (math-verify) and ``code_execution`` (sandboxed subprocesses), with 1 and 2
  workers; ``speedup`` = 2 workers / 1 worker, the baseline measured in the same run. The clock starts
  when every worker is ready and the records are on the stream, and stops when the last scored record
  is on the output stream.
- ``loop_lag``: one in-process worker scoring records with ``format`` while one record's reward hangs (a
  sync function blocked past ``reward.timeout_s`` = 1 s); a 5 ms probe sleep measures how late the event
  loop wakes up (p50/p99/max), next to the same run without the hang (the baseline), and a run of
  ``accuracy`` in threads (CPU-bound Python: GIL contention) and in processes (``executor = "processes"``).

Prints JSON; writes it too with ``--json-out`` (e.g. bench/results/reward.json). Needs redis-server.

    .venv/bin/python bench/reward.py [--accuracy-records 1000] [--code-records 120] [--json-out bench/results/reward.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import signal
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_json import emit
from config import config_from_dict
from pipeline.records import GroupClosed, Trajectory, TrajectoryGroup, encode, pack_f32, pack_i32
from pipeline.transport import DEFAULT_REDIS_URL, connect
from pipeline.worker import Worker
from stages import SCORED, TRAJECTORIES

CODE = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TESTS = {"language": "python", "test_cases": [{"input": "2 3\n", "output": "5\n"}, {"input": "-1 1\n", "output": "0\n"}]}
ANSWERS = ["The answer is $\\boxed{42}$.", "<answer>41</answer>", "so it is 42", "$\\frac{84}{2}$"]


def alone(t: Trajectory) -> TrajectoryGroup:
    """A record as the rollout sends it: a group entry (here of one record, so records/s = entries/s)."""
    manifest = GroupClosed(prompt_id=t.prompt_id, attempt=0, generation_batch=0, record_ids=[t.record_id])
    return TrajectoryGroup(manifest=manifest, trajectories=[t])


def record(i: int, reward: str) -> Trajectory:
    completion = CODE if reward == "code_execution" else ANSWERS[i % len(ANSWERS)]
    data = {"verification_info": TESTS} if reward == "code_execution" else {"solution": "$42$"}
    return Trajectory(
        prompt_id=f"e0:{i}",
        attempt=0,
        request_id=f"e0:{i}/0/0",
        generation_batch=0,
        prompt_ids=pack_i32(range(40)),
        completion_ids=pack_i32(range(80)),
        logprobs=pack_f32([-0.1] * 80),
        messages=[{"role": "user", "content": "What is 17 + 25?"}],
        completion=completion,
        data_dict=data,
        policy_version=0,
        max_policy_version=0,
    )


def make_cfg(run: str, reward: str, url: str):
    return config_from_dict(
        {
            "run": {"name": run},
            "reward": {"reward_funcs": [reward], "executor_workers": 4},
            "transport": {"kind": "redis", "url": url},
        }
    )


def worker_process(run: str, reward: str, url: str, index: int, ready: multiprocessing.Event) -> None:
    """One reward worker over Redis until SIGTERM (as the Procfile runs it)."""
    from stages.reward import Reward

    async def main() -> None:
        cfg = make_cfg(run, reward, url)
        transport = await connect("redis", run=run, url=url)
        worker = Worker(Reward(cfg), transport, run=run, worker_id=f"bench-{index}", block_ms=50)
        worker.install_signal_handlers()
        serving = asyncio.create_task(worker.serve())
        await transport.stats(TRAJECTORIES, "reward")
        ready.set()
        await serving
        await transport.close()

    asyncio.run(main())


async def throughput(reward: str, workers: int, n: int, url: str) -> dict:
    run = f"bench-reward-{uuid.uuid4().hex[:8]}"
    transport = await connect("redis", run=run, url=url)
    ctx = multiprocessing.get_context("spawn")
    readies = [ctx.Event() for _ in range(workers)]
    procs = [ctx.Process(target=worker_process, args=(run, reward, url, i, readies[i])) for i in range(workers)]
    try:
        for p in procs:
            p.start()
        for e in readies:
            while not e.wait(timeout=0.1):  # poll: a crashed worker must not hang the bench
                if not all(p.is_alive() for p in procs):
                    raise RuntimeError("a bench worker died while starting")
        payloads = [encode(alone(record(i, reward))) for i in range(n)]
        started = time.perf_counter()
        for i in range(0, n, 500):
            await transport.produce(TRAJECTORIES, payloads[i : i + 500])
        while (await transport.stats(SCORED)).length < n:
            await asyncio.sleep(0.01)  # poll interval
        elapsed = time.perf_counter() - started
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():  # see the closing note: an idle Redis worker may not finish its drain
                p.kill()
                p.join()
        await transport.delete_run()
        await transport.close()
    return {"reward": reward, "workers": workers, "records": n, "seconds": round(elapsed, 3), "records_per_s": round(n / elapsed, 1)}


RELEASE = threading.Event()  # set when the bench ends: hung threads may then return


def hang_once(completions, solution, **kwargs):
    if "hang" in solution:
        RELEASE.wait()  # blocks its pool thread until reward.timeout_s gives up on it
    return [1.0] * len(completions)


async def loop_lag(n: int, hanging: bool, reward: str, executor: str = "threads") -> dict:
    from rewards import orms
    from stages.reward import Reward

    orms["bench_hang"] = hang_once
    run = f"bench-lag-{uuid.uuid4().hex[:8]}"
    cfg = config_from_dict(
        {
            "run": {"name": run},
            "reward": {
                "reward_funcs": [reward, "bench_hang"] if hanging else [reward],
                "timeout_s": 1.0,
                "max_retries": 0,
                "executor": executor,
                # one group per call: the loop's lag under one hung call, not a batch's groups zeroed with it
                "batch_groups": 1,
            },
        }
    )
    transport = await connect("memory", run=run)
    records = [record(i, "accuracy") for i in range(n)]
    if hanging:
        records[0] = _with_solution(records[0], "hang")
    await transport.produce(TRAJECTORIES, [encode(alone(r)) for r in records])
    stage = Reward(cfg)
    await stage.scorer.start((run, "reward", "bench"))  # warm a process pool
    worker = Worker(stage, transport, run=run, block_ms=20)
    serving = asyncio.create_task(worker.serve())
    lags: list[float] = []
    started = time.perf_counter()
    while (await transport.stats(SCORED)).length < n or len(lags) < 2:  # quantiles need two probes
        before = time.perf_counter()
        await asyncio.sleep(0.005)  # the probe
        lags.append(time.perf_counter() - before - 0.005)
    elapsed = time.perf_counter() - started
    worker.request_stop("bench done")
    await serving
    q = statistics.quantiles(lags, n=100, method="inclusive")
    return {
        "with": reward,
        "executor": executor,
        "hanging_reward": hanging,
        "records": n,
        "seconds": round(elapsed, 3),
        "lag_ms_p50": round(q[49] * 1000, 2),
        "lag_ms_p99": round(q[98] * 1000, 2),
        "lag_ms_max": round(max(lags) * 1000, 2),
    }


def _with_solution(t: Trajectory, solution: str) -> Trajectory:
    import msgspec

    return msgspec.structs.replace(t, data_dict={"solution": solution})


async def main(args: argparse.Namespace) -> dict:
    runs = []
    for reward, n in (("accuracy", args.accuracy_records), ("code_execution", args.code_records)):
        for workers in (1, 2):
            runs.append(await throughput(reward, workers, n, args.url))
            print(json.dumps(runs[-1]), file=sys.stderr)
    speedup = {
        reward: round(
            next(r for r in runs if r["reward"] == reward and r["workers"] == 2)["records_per_s"]
            / next(r for r in runs if r["reward"] == reward and r["workers"] == 1)["records_per_s"],
            2,
        )
        for reward in ("accuracy", "code_execution")
    }
    # format (a regex) isolates what a hang does to the loop; accuracy in threads adds GIL contention
    # from CPU-bound Python (the case for reward.executor = "processes").
    lag = [
        await loop_lag(args.lag_records, hanging=False, reward="format"),
        await loop_lag(args.lag_records, hanging=True, reward="format"),
        await loop_lag(args.lag_records, hanging=False, reward="accuracy"),
        await loop_lag(args.lag_records, hanging=False, reward="accuracy", executor="processes"),
    ]
    RELEASE.set()
    return {
        "bench": "reward",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "throughput": runs,
        "speedup_2_vs_1_workers": speedup,
        "loop_lag": lag,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--accuracy-records", type=int, default=1000)
    parser.add_argument("--code-records", type=int, default=120)
    parser.add_argument("--lag-records", type=int, default=300)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    emit(result, args.json_out)
