"""Rollout throughput with TRL-style tools (the tool_calling scheduler) against plain single-turn rollout, on the
tiny-agent model and the same ``add_tool`` prompts, in one invocation on one vLLM engine.

- ``tools``: ``rollout.tools = ["tinymodels.agent:add"]``: each reply is parsed (transformers' response
  parser), a call runs ``add`` in the tool threads, its result's template tokens are appended, and the model
  replies again.
- ``single_turn``: the same prompts without tools (no tool schema in the prompt, one reply each).
- ``endpoint_openai`` / ``endpoint_openai_shared`` / ``endpoint_http``: ``rollout.agent`` programs that make one
  chat call each through the agent endpoint (with an ``openai`` client made per episode, one ``openai`` client kept
  per process with the episode's key per request, or one kept aiohttp session): the endpoint's cost
  against a direct scheduler making the same one call per request (``scheduler_one_call``; goal >= 0.9 of its
  trajectories/s) and against the single-turn path (one vLLM request with n = G per group).

Per variant: trajectories/s, sampled (model) tokens/s, engine calls per trajectory, tool calls per trajectory;
interleaved rounds, medians, and the ratio tools / single-turn of trajectories/s and model tokens/s. The
scheduler's own CPU per engine call (parsing, the tool suffix, re-render check) is the difference in cost per
model token. Prints JSON; ``--json-out bench/results/agent.json`` writes it.

    .venv/bin/python bench/agent.py [--prompts 32] [--generations 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_json import emit
from bench.rollout import through_stage
from tests.fake_context import FakeContext

VARIANTS = {  # name -> the rollout settings
    "tools": {"tools": ["tinymodels.agent:add"]},
    "single_turn": {},
    "scheduler_one_call": {"multi_turn_scheduler": "bench_one_call", "max_turns": 1},
    "endpoint_openai": {"agent": "bench.agent:one_call_openai"},
    "endpoint_openai_shared": {"agent": "bench.agent:one_call_openai_shared"},
    "endpoint_http": {"agent": "bench.agent:one_call_http"},
}


def register_one_call() -> None:
    """The direct-scheduler baseline of a single-call episode: a multi-turn scheduler that stops after one
    turn (one engine call per request, as the endpoint's agent makes; no n=G batching)."""
    from schedulers import MultiTurnScheduler, multi_turns

    class OneCall(MultiTurnScheduler):
        def step(self, infer_request, response_choice, current_turn):  # never reached: max_turns = 1
            raise AssertionError("one call only")

    multi_turns["bench_one_call"] = OneCall


async def one_call_openai(base_url: str, api_key: str, row: dict) -> None:
    """A single-call episode through the endpoint, as an openai-client program writes it."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    await client.chat.completions.create(model="policy", messages=row["prompt"])
    await client.close()


_HTTP: dict = {}


async def one_call_openai_shared(base_url: str, api_key: str, row: dict) -> None:
    """The openai client kept across episodes (one per process), the episode's key per request."""
    import openai

    client = _HTTP.get("openai")
    if client is None:
        client = _HTTP["openai"] = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model="policy", messages=row["prompt"],
                                         extra_headers={"Authorization": f"Bearer {api_key}"})


async def one_call_http(base_url: str, api_key: str, row: dict) -> None:
    """The same call with one shared aiohttp client session (what a program that keeps its client pays;
    httpx's connection pool costs O(requests x connections) per request at this concurrency)."""
    import aiohttp

    session = _HTTP.get("session")
    if session is None or session.closed:
        session = _HTTP["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=512))
    async with session.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                            json={"model": "policy", "messages": row["prompt"]}) as response:
        response.raise_for_status()
        await response.read()


def stage_cfg(variant: str, max_tokens: int):
    from config import config_from_dict

    return config_from_dict({
        "model": {"model": "tiny-agent"},
        "grpo": {"max_completion_length": max_tokens},
        "rollout": {"max_concurrent_groups": 64, "max_model_len": 256, **VARIANTS[variant]},
        "reward": {"reward_funcs": ["accuracy"]},
    })


def tasks(prompts: int, generations: int, seed: int):
    from data.loading import add_tool_rows
    from pipeline.records import PromptTask

    return [PromptTask(prompt_id=f"e0:{p}", generation_batch=0, num_generations=generations,
                       messages=[{"role": "user", "content": row["prompt"]}], data_dict={"solution": row["solution"]},
                       seed=seed + 1000 * p)
            for p, row in enumerate(add_tool_rows(prompts, seed))]


async def measure(prompts: int, generations: int, rounds: int, max_tokens: int) -> dict:
    from engines.vllm_engine import VLLMEngine
    from pipeline.records import trajectories_in
    from stages.rollout import Rollout
    from tinymodels.text import model_path

    register_one_call()
    model_dir = model_path("tiny-agent")
    engine = await VLLMEngine.start(model_dir, max_model_len=256, kv_cache_gib=1)
    work = tasks(prompts, generations, seed=5)
    out: dict = {"model": "tiny-agent", "prompts": prompts, "generations": generations, "rounds": rounds,
                 "max_completion_length": max_tokens}
    try:
        stages = {}
        for name in VARIANTS:
            stages[name] = Rollout(stage_cfg(name, max_tokens), model_dir, engine=engine)
            await stages[name].start(FakeContext("bench", "rollout"))
            await through_stage(stages[name], work[:4])  # warm-up
        rates: dict = {name: {"trajectories": [], "tokens": []} for name in stages}
        shape: dict = {}
        for r in range(rounds):  # interleaved, order alternating: drift in the machine's load hits both alike
            for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
                stage = stages[name]
                started = time.perf_counter()
                outs = await asyncio.gather(*(stage.handle(t, FakeContext("bench", "rollout")) for t in work))
                seconds = time.perf_counter() - started
                trajectories = trajectories_in([entry for o in outs for entry in o.outputs])
                tokens = sum(int(t.completion_loss_mask().sum()) for t in trajectories)
                rates[name]["trajectories"].append(len(trajectories) / seconds)
                rates[name]["tokens"].append(tokens / seconds)
                infos = [t.rollout_infos for t in trajectories]
                shape[name] = {
                    "engine_calls_per_trajectory": round(sum(i.get("num_turns", 1) for i in infos) / len(infos), 3),
                    "tool_calls_per_trajectory": round(sum(i.get("num_tool_calls", 0) for i in infos) / len(infos), 3),
                    "model_tokens_per_trajectory": round(tokens / len(trajectories), 2),
                }
        for name in stages:
            out[name] = {
                "trajectories_per_second": round(statistics.median(rates[name]["trajectories"]), 1),
                "model_tokens_per_second": round(statistics.median(rates[name]["tokens"]), 1),
                **shape[name],
            }
        for name in ("endpoint_openai", "endpoint_openai_shared", "endpoint_http"):  # single-call episodes: the endpoint's own cost
            for base in ("scheduler_one_call", "single_turn"):
                out[f"ratio_{name}_vs_{base}"] = round(out[name]["trajectories_per_second"]
                                                      / out[base]["trajectories_per_second"], 3)
        out["ratio_tools_vs_single_turn"] = {
            "trajectories_per_second": round(out["tools"]["trajectories_per_second"]
                                             / out["single_turn"]["trajectories_per_second"], 3),
            "model_tokens_per_second": round(out["tools"]["model_tokens_per_second"]
                                             / out["single_turn"]["model_tokens_per_second"], 3),
        }
        for stage in stages.values():
            await stage.close()
    finally:
        session = _HTTP.pop("session", None)
        if session is not None:  # else aiohttp warns "Unclosed client session" at exit
            await session.close()
        engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    emit(asyncio.run(measure(args.prompts, args.generations, args.rounds, args.max_tokens)), args.json_out)


if __name__ == "__main__":
    main()
