"""Rollout stage throughput and weight-sync time on the tiny model, against bare vLLM in the same run.

1. single_turn: the same seeded requests (prompts x num_generations, same sampling) through
   ``Rollout.handle`` and through bare ``AsyncLLM.generate``; tokens/s of each, interleaved rounds,
   medians, and the ratio stage/bare (goal >= 0.9).
2. multi_turn_tool: ``tool_call_scheduler`` with a tool turn per request (the calculator subprocess),
   model tokens/s and trajectories/s, next to the single-turn stage on the same prompts.
3. weight_sync: seconds to load a snapshot into the running engine, idle and with requests in flight,
   for ``rollout.weight_load`` pause and drain.
4. lora_sync (``--sections lora``): a LoRA-enabled engine hot-swapping the learner's adapter snapshots
   (peft, r=8, all-linear): swap seconds idle and with requests in flight, and tokens/s of the same
   requests with the adapter vs the base alone on that engine.

Prints JSON; ``--json-out bench/results/rollout.json`` writes it too.

    .venv/bin/python bench/rollout.py [--prompts 64] [--generations 8] [--max-tokens 64] [--rounds 7]
                                      [--sections stage,lora]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report_json import emit
from tests.fake_context import FakeContext  # the tests' whole StageContext: a stage driven without a worker


def stage_cfg(max_tokens: int, scheduler: str | None = None, weight_load: str = "pause"):
    from config import config_from_dict

    return config_from_dict({
        "grpo": {"max_completion_length": max_tokens},
        "rollout": {"max_concurrent_groups": 64, "max_model_len": 256, "multi_turn_scheduler": scheduler,
                    "max_turns": 3, "loss_scale": "default", "weight_load": weight_load},
        "reward": {"reward_funcs": ["accuracy"]},
    })


def tasks(prompts: int, generations: int, seed: int, prefill: bool = False):
    from pipeline.records import PromptTask

    out = []
    for p in range(prompts):
        a, b = p % 9 + 1, (p * 7) % 9 + 1
        messages = [{"role": "user", "content": f"What is {a}+{b}?"}]
        if prefill:
            messages.append({"role": "assistant", "content": f"Action: calculator\nAction Input: {a}+{b}\n"})
        out.append(PromptTask(prompt_id=f"e0:{p}", generation_batch=0, num_generations=generations,
                              messages=messages, data_dict={"solution": str(a + b)}, seed=seed + 1000 * p))
    return out


def bare_requests(engine, task_list) -> list[tuple[list[int], int]]:
    """(prompt ids, seed) of every request the stage would send, tokenized once, outside the timing."""
    out = []
    for t in task_list:
        ids = engine.encode_prompt(t.messages)
        out += [(ids, t.seed + i) for i in range(t.num_generations)]
    return out


async def bare_vllm(engine, requests, max_tokens: int) -> int:
    """The same requests straight into AsyncLLM: same prompt ids, seeds and sampling as the stage's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    async def one(prompt_ids, seed, rid):
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                max_tokens=max_tokens, logprobs=0, seed=seed, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in engine.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=rid):
            final = out
        return len(final.outputs[0].token_ids)

    tag = time.monotonic_ns()
    return sum(await asyncio.gather(*(one(ids, seed, f"bare-{tag}-{k}") for k, (ids, seed) in enumerate(requests))))


async def through_stage(stage, task_list) -> tuple[int, int]:
    from pipeline.records import trajectories_in

    outs = await asyncio.gather(*(stage.handle(t, FakeContext("bench", "rollout")) for t in task_list))
    trajectories = trajectories_in([entry for o in outs for entry in o.outputs])
    return sum(int(t.completion_loss_mask().sum()) for t in trajectories), len(trajectories)


async def timed(coro):
    started = time.perf_counter()
    result = await coro
    return result, time.perf_counter() - started


async def measure(prompts: int, generations: int, max_tokens: int, rounds: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from engines.vllm_engine import VLLMEngine
    from stages.rollout import Rollout
    from tinymodels.text import tiny_model_path
    from weights.snapshots import save_weights_atomically

    model_dir = tiny_model_path()
    engine = await VLLMEngine.start(model_dir, max_model_len=256, kv_cache_gib=1)
    results: dict = {"prompts": prompts, "generations": generations, "max_tokens": max_tokens, "rounds": rounds}
    try:
        single = Rollout(stage_cfg(max_tokens), model_dir, engine=engine)
        await single.start(FakeContext("bench", "rollout"))
        work = tasks(prompts, generations, seed=11)
        requests = bare_requests(engine, work)
        await through_stage(single, work)  # warm-up: the engine's first batches are slow
        await bare_vllm(engine, requests, max_tokens)
        stage_rates, bare_rates = [], []
        for r in range(rounds):  # interleaved, order alternating, so drift in the machine's load hits both alike
            if r % 2:
                tokens_b, secs_b = await timed(bare_vllm(engine, requests, max_tokens))
            (tokens_s, _), secs_s = await timed(through_stage(single, work))
            if not r % 2:
                tokens_b, secs_b = await timed(bare_vllm(engine, requests, max_tokens))
            assert tokens_s == tokens_b, f"the same seeded requests gave {tokens_s} vs {tokens_b} tokens"
            stage_rates.append(tokens_s / secs_s)
            bare_rates.append(tokens_b / secs_b)
        results["single_turn"] = {
            "tokens_per_round": tokens_s,
            "stage_tokens_per_second": round(statistics.median(stage_rates), 1),
            "bare_asyncllm_tokens_per_second": round(statistics.median(bare_rates), 1),
            "ratio_stage_vs_bare": round(statistics.median(s / b for s, b in zip(stage_rates, bare_rates)), 3),
            "ratio_per_round": [round(s / b, 3) for s, b in zip(stage_rates, bare_rates)],
        }

        tool = Rollout(stage_cfg(max_tokens, "tool_call_scheduler"), model_dir, engine=engine)
        await tool.start(FakeContext("bench", "rollout"))
        tool_work = tasks(prompts, generations, seed=23, prefill=True)
        await through_stage(tool, tool_work[:2])
        mt_rates, mt_traj, st_rates = [], [], []
        for r in range(rounds):
            (tokens_m, trajs), secs_m = await timed(through_stage(tool, tool_work))
            (tokens_1, _), secs_1 = await timed(through_stage(single, tool_work))
            mt_rates.append(tokens_m / secs_m)
            mt_traj.append(trajs / secs_m)
            st_rates.append(tokens_1 / secs_1)
        results["multi_turn_tool"] = {
            "scheduler": "tool_call_scheduler",
            "trajectories": trajs,
            "model_tokens_per_round": tokens_m,
            "model_tokens_per_second": round(statistics.median(mt_rates), 1),
            "trajectories_per_second": round(statistics.median(mt_traj), 1),
            "single_turn_same_prompts_tokens_per_second": round(statistics.median(st_rates), 1),
            "ratio_multi_vs_single_tokens_per_second": round(statistics.median(mt_rates) / statistics.median(st_rates), 3),
        }

        # Two snapshots to alternate between (a load of the version already there is skipped).
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        with tempfile.TemporaryDirectory() as tmp:
            paths = [save_weights_atomically(model, Path(tmp) / "a")]
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            paths.append(save_weights_atomically(model, Path(tmp) / "b"))
            version = engine.version
            sync: dict = {}
            for mode in ("pause", "drain"):
                stage = Rollout(stage_cfg(max_tokens, weight_load=mode), model_dir, engine=engine)
                await stage.start(FakeContext("bench", "rollout"))
                version, sync[mode] = await swap_times(engine, stage, paths, version, work, mode)
            results["weight_sync"] = {"model": "tiny (fp32, untied)", **sync}
        await engine.reset_weights(model_dir)
    finally:
        engine.shutdown()
    return results


async def swap_times(engine, stage, paths, version, work, mode):
    """Adapter swaps alternating between ``paths``: 8 idle, then 4 while a batch of requests runs."""
    idle, busy = [], []
    for _ in range(8):
        version += 1
        idle.append(await engine.load_weights(paths[version % 2], version, mode=mode))
    for _ in range(4):
        running = asyncio.create_task(through_stage(stage, work[:8]))
        deadline = time.monotonic() + 30
        while engine.running_count("pause") == 0 and not running.done():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.001)  # poll until a turn runs
        version += 1
        busy.append(await engine.load_weights(paths[version % 2], version, mode=mode))
        await running
    return version, {
        "idle_median_seconds": round(statistics.median(idle), 4),
        "idle_max_seconds": round(max(idle), 4),
        "in_flight_median_seconds": round(statistics.median(busy), 4),
        "in_flight_max_seconds": round(max(busy), 4),
    }


async def measure_lora(prompts: int, generations: int, max_tokens: int, rounds: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engines.vllm_engine import VLLMEngine
    from stages.rollout import Rollout
    from tinymodels.text import tiny_model_path
    from weights.snapshots import save_weights_atomically

    model_dir = tiny_model_path()
    engine = await VLLMEngine.start(model_dir, max_model_len=256, kv_cache_gib=1, max_lora_rank=8)
    results: dict = {"model": "tiny (fp32) + peft LoRA r=8 alpha=32 all-linear", "max_lora_rank": 8}
    try:
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32),
            LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
        )
        work = tasks(prompts, generations, seed=11)
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for name in ("a", "b"):
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if "lora_B" in n:
                            p.add_(0.05 * torch.randn_like(p))
                paths.append(save_weights_atomically(model, Path(tmp) / name, adapter_only=True))
            results["adapter_bytes"] = (paths[0] / "adapter_model.safetensors").stat().st_size
            version = 0
            for mode in ("pause", "drain"):
                stage = Rollout(stage_cfg(max_tokens, weight_load=mode), model_dir, engine=engine)
                await stage.start(FakeContext("bench", "rollout"))
                version, results[mode] = await swap_times(engine, stage, paths, version, work, mode)
            # Throughput with an adapter vs the base alone, same engine, same seeded requests, interleaved.
            stage = Rollout(stage_cfg(max_tokens), model_dir, engine=engine)
            await stage.start(FakeContext("bench", "rollout"))
            await through_stage(stage, work)  # warm-up
            with_adapter, base = [], []
            for _ in range(rounds):
                version += 1
                await engine.load_weights(paths[version % 2], version)
                (tokens, _), secs = await timed(through_stage(stage, work))
                with_adapter.append(tokens / secs)
                await engine.reset_weights(model_dir)
                version = 0
                (tokens, _), secs = await timed(through_stage(stage, work))
                base.append(tokens / secs)
            results["adapter_tokens_per_second"] = round(statistics.median(with_adapter), 1)
            results["base_tokens_per_second"] = round(statistics.median(base), 1)
            ratios = [a / b for a, b in zip(with_adapter, base)]
            results["ratio_adapter_vs_base"] = round(statistics.median(ratios), 3)
        await engine.reset_weights(model_dir)
    finally:
        engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--sections",
        default="stage,lora",
        help="comma-separated: stage (sections 1-3, one engine), lora (section 4, a LoRA engine)",
    )
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    sections = set(args.sections.split(","))
    unknown = sections - {"stage", "lora"}
    if unknown:
        parser.error(f"--sections: unknown {', '.join(sorted(unknown))}; choose from stage, lora")
    shape = (args.prompts, args.generations, args.max_tokens, args.rounds)
    results = asyncio.run(measure(*shape)) if "stage" in sections else {}
    if "lora" in sections:
        results.update(dict(zip(("prompts", "generations", "max_tokens", "rounds"), shape)))
        results["lora_sync"] = asyncio.run(measure_lora(*shape))
    emit(results, args.json_out)


if __name__ == "__main__":
    main()
