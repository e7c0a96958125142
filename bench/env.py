"""Gym env rollout throughput: trajectories/s for an env with 50 ms of simulated latency per step, at 1, 8
and 64 concurrent envs, in process and behind ``rollstream env-serve`` (local vs remote).

Each trajectory is ``--turns`` steps of ``--step-latency-s`` (an ``asyncio.sleep`` in the env: I/O, a
sandbox, a game server), so one env alone gives at most 1 / (turns * latency) trajectories/s; with c
concurrent envs the ideal is c times that, and ``efficiency`` = measured / ideal says how much of the
latency the async loop hides (local and remote alternate for ``--rounds`` rounds; medians are reported).
At 64 envs the loop is CPU-bound on the token-level run's per-turn work (rendering the chat template,
tokenizing, copying messages: ~13 ms a turn on the loaded bench box), not on the env. The model side is a deterministic instant backend (each turn answers one
number, the real tokenizer and the real ``gym_scheduler`` token-level run): the bench measures the env
loop, not vLLM on this CPU (``--engine vllm`` uses the real engine and the tiny model instead).

Prints JSON; ``--json-out bench/results/env.json`` writes it too.

    .venv/bin/python bench/env.py [--turns 4] [--step-latency-s 0.05] [--concurrency 1 8 64] [--engine fake|vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from schedulers import Env, envs
from schedulers.remote_env import wait_healthy


class SleepyEnv(Env):
    """``sleepy``: every step waits ``latency_s`` and asks again; done after ``turns`` steps (reward 1)."""

    async def reset(self, config):
        self.steps = 0
        return "Say a number.", {}, "You count."

    async def step(self, action):
        await asyncio.sleep(float(self.env_config.get("latency_s", 0.05)))
        self.steps += 1
        done = self.steps >= int(self.env_config.get("turns", 4))
        return "Again.", 1.0 if done else 0.0, done, {}

    async def close(self):
        pass


envs["sleepy"] = SleepyEnv  # `rollstream env-serve bench/env.py:sleepy` loads this file as a plugin


@dataclass
class _Sample:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"
    min_version: int = 0
    max_version: int = 0


class InstantBackend:
    """A TokenBackend that answers every turn at once with the same number (then end of turn)."""

    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.reply = tokenizer.encode("4", add_special_tokens=False) + [tokenizer.eos_token_id]

    async def generate(self, prompt_ids, *, request_id, seed, max_tokens, **sampling):
        return _Sample(list(self.reply), [-0.1] * len(self.reply))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def measure(infer_engine, env_config: dict, concurrency: int, trajectories: int, turns: int) -> dict:
    from schedulers import GYMScheduler, RequestConfig, RolloutInferRequest
    from schedulers.engine import RequestContext, request_context

    scheduler = GYMScheduler(
        turns + 1,
        gym_env=env_config.get("name", "sleepy"),
        env_config=env_config,
        max_concurrent_envs=concurrency,
        env_timeout_s=60,
    )
    scheduler.infer_engine = infer_engine
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> list:
        config = RequestConfig(max_tokens=4, seed=i)
        request = RolloutInferRequest(
            messages=[{"role": "user", "content": "play"}], uuid=f"b/{i}", data_dict={"env_config": {}}
        )
        async with gate:
            with request_context(RequestContext(request_id=f"b/{i}", config=config)):
                return await scheduler.run(request, config)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(trajectories)))
    seconds = time.perf_counter() - started
    await scheduler.shutdown()
    assert all(r[-1]["rollout_infos"]["num_turns"] == turns for r in results), "every episode runs its turns"
    ideal = concurrency / (turns * float(env_config.get("latency_s", 0.05)))
    rate = trajectories / seconds
    return {
        "concurrency": concurrency,
        "trajectories": trajectories,
        "seconds": round(seconds, 3),
        "trajectories_per_s": round(rate, 2),
        "ideal_trajectories_per_s": round(ideal, 2),
        "efficiency": round(rate / ideal, 3),
    }


async def main(args: argparse.Namespace) -> dict:
    from schedulers.engine import InferEngine
    from tinymodels.text import tiny_model_path

    model_dir = tiny_model_path(progress=None)
    if args.engine == "vllm":
        from engines.vllm_engine import VLLMEngine

        backend = await VLLMEngine.start(model_dir, max_model_len=256, kv_cache_gib=1)
    else:
        from transformers import AutoTokenizer

        backend = InstantBackend(AutoTokenizer.from_pretrained(str(model_dir)))
    infer_engine = InferEngine(backend, max_model_len=256)
    env = {"latency_s": args.step_latency_s, "turns": args.turns}
    port = free_port()
    server = subprocess.Popen(  # noqa: ASYNC220 - the env server for the whole bench, stopped by PID
        [
            sys.executable,
            "-m",
            "rollstream.cli",
            "env-serve",
            f"{Path(__file__).resolve()}:sleepy",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    results: dict = {
        "step_latency_s": args.step_latency_s,
        "turns": args.turns,
        "engine": args.engine,
        "local": [],
        "remote": [],
    }
    try:
        await wait_healthy(url)
        for concurrency in args.concurrency:
            n = max(args.min_trajectories, 4 * concurrency)
            rounds: dict[str, list[dict]] = {"local": [], "remote": []}
            for _ in range(args.rounds):  # interleaved, medians: this box's load swings run to run
                rounds["local"].append(
                    await measure(infer_engine, {**env, "name": "sleepy"}, concurrency, n, args.turns)
                )
                rounds["remote"].append(
                    await measure(
                        infer_engine, {**env, "name": "remote", "url": url}, concurrency, n, args.turns
                    )
                )
            for mode, measured in rounds.items():
                median = sorted(measured, key=lambda r: r["trajectories_per_s"])[len(measured) // 2]
                results[mode].append(
                    {**median, "rounds_trajectories_per_s": [r["trajectories_per_s"] for r in measured]}
                )
    finally:
        server.terminate()
        server.wait(timeout=30)
        if args.engine == "vllm":
            backend.shutdown()
    results["remote_vs_local"] = [
        round(r["trajectories_per_s"] / loc["trajectories_per_s"], 3)
        for loc, r in zip(results["local"], results["remote"])
    ]
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--step-latency-s", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--min-trajectories", type=int, default=16)
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved local/remote rounds; medians reported"
    )
    parser.add_argument("--engine", choices=["fake", "vllm"], default="fake")
    parser.add_argument("--json-out", default=None)
    cli = parser.parse_args()
    from bench.report_json import emit

    emit(asyncio.run(main(cli)), cli.json_out)
