"""Image prompts vs text-only prompts on the tiny Qwen2-VL, in the same run (ratios, not absolute numbers).

1. rollout: ``--prompts`` x ``--generations`` seeded requests of ``--max-tokens`` tokens (ignore_eos) on one
   AsyncLLM engine, each request with its group's 56 x 56 picture vs the same question without it;
   interleaved rounds, median tokens/s of each and the ratio image/text.
2. learner: forward + backward of a 16-row mini-batch (the learner's ``completion_logps`` path) with the
   images (pixel_values, image_grid_thw, mm_token_type_ids) vs the same rows without their image tokens;
   median tokens/s (prompt + completion tokens) and the ratio.

Prints JSON; ``--json-out bench/results/vl.json`` writes it too.

    .venv/bin/python bench/vl.py [--prompts 8] [--generations 8] [--max-tokens 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data.vl_compat  # noqa: F401  (CPU without torchvision; before transformers and vLLM load)
from bench.report_json import emit


async def rollout_round(engine, requests, max_tokens: int, seed: int) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    async def one(i: int, ids: list[int], images) -> int:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                                seed=seed + i, output_kind=RequestOutputKind.FINAL_ONLY)
        prompt = TokensPrompt(prompt_token_ids=ids)
        if images:
            prompt["multi_modal_data"] = {"image": images}
        final = None
        async for out in engine.engine.generate(prompt, params, request_id=f"bench-{seed}-{i}"):
            final = out
        return len(final.outputs[0].token_ids)

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(i, ids, images) for i, (ids, images) in enumerate(requests)))
    return sum(tokens) / (time.perf_counter() - started), sum(tokens)


async def bench_rollout(model_dir: Path, args) -> dict:
    from data.loading import load_dataset
    from data.media import pil_images
    from engines.vllm_engine import VLLMEngine

    rows = load_dataset("shapes", size=args.prompts, seed=5)
    engine = await VLLMEngine.start(model_dir, max_model_len=256, kv_cache_gib=1)
    try:
        image_requests, text_requests = [], []
        for row in rows:
            images = pil_images(row["images"])
            text_only = [{"role": "user", "content": [p for p in row["messages"][0]["content"] if p["type"] == "text"]}]
            for _ in range(args.generations):
                image_requests.append((engine.encode_prompt(row["messages"]), images))
                text_requests.append((engine.encode_prompt(text_only), None))
        await rollout_round(engine, image_requests[:8], 4, 1)  # warm-up: the first batch is slow
        await rollout_round(engine, text_requests[:8], 4, 1)
        rates: dict[str, list[float]] = {"image": [], "text": []}
        for r in range(args.rounds):
            for name, requests in (("image", image_requests), ("text", text_requests)):
                rate, _ = await rollout_round(engine, requests, args.max_tokens, 1000 * (r + 1))
                rates[name].append(rate)
    finally:
        engine.shutdown()
    image, text = statistics.median(rates["image"]), statistics.median(rates["text"])
    return {"requests": len(image_requests), "max_tokens": args.max_tokens, "image_tokens_per_s": round(image),
            "text_tokens_per_s": round(text), "ratio_image_over_text": round(image / text, 3),
            "rounds": {k: [round(v) for v in vs] for k, vs in rates.items()}}


def bench_learner(model_dir: Path, args) -> dict:
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from data.loading import load_dataset
    from data.media import image_key, pil_images
    from pipeline.records import ScoredTrajectory, Trajectory, pack_f32, pack_i32
    from trainer.model import Batch, VisionInputs, completion_logps, load_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model(model_dir, torch.float32).train()
    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    pad = model.config.image_token_id
    rows = load_dataset("shapes", size=16, seed=6)
    completion = tokenizer.encode("red", add_special_tokens=False) + [tokenizer.eos_token_id]
    images, with_image, without = {}, [], []
    for k, row in enumerate(rows):
        text = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        grid = processor(images=pil_images(row["images"]), return_tensors="pt")["image_grid_thw"]
        at = ids.index(pad)
        expanded = ids[:at] + [pad] * (int(grid.prod()) // 4) + ids[at + 1:]
        key = image_key(row["images"][0])
        images[key] = row["images"][0]
        for prompt, keys, out in ((expanded, [key], with_image), ([t for t in ids if t != pad], [], without)):
            t = Trajectory(prompt_id=f"p{k}", attempt=0, request_id=f"p{k}/0/0", generation_batch=0,
                           prompt_ids=pack_i32(prompt), completion_ids=pack_i32(completion),
                           logprobs=pack_f32([0.0] * len(completion)), images=keys, policy_version=0,
                           max_policy_version=0)
            out.append(ScoredTrajectory(trajectory=t, rewards={}, reward=0.0))
    vision = VisionInputs(processor, pad, images)
    batches = {"image": Batch(with_image, [1.0] * 16, pad_id=tokenizer.pad_token_id, vision=vision),
               "text": Batch(without, [1.0] * 16, pad_id=tokenizer.pad_token_id)}
    rates: dict[str, list[float]] = {"image": [], "text": []}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name, batch in batches.items():
            tokens = int(batch.attention_mask.sum())
            started = time.perf_counter()
            logps = completion_logps(model, batch, temperature=1.0)
            (-(logps * batch.completion_mask).sum()).backward()
            rates[name].append(tokens / (time.perf_counter() - started))
            model.zero_grad(set_to_none=True)
    image, text = statistics.median(rates["image"][1:]), statistics.median(rates["text"][1:])
    return {"rows": 16, "image_tokens_per_s": round(image), "text_tokens_per_s": round(text),
            "ratio_image_over_text": round(image / text, 3),
            "tokens_per_row": {name: int(b.attention_mask.sum()) // 16 for name, b in batches.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    from tinymodels.text import model_path

    model_dir = model_path("tiny-vl", progress=None)
    results = {"model": "tiny-vl (Qwen2-VL, 56 x 56 images = 4 image tokens)",
               "learner": bench_learner(model_dir, args),
               "rollout": asyncio.run(bench_rollout(model_dir, args))}
    emit(results, args.json_out)


if __name__ == "__main__":
    main()
