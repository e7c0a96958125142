"""Learner throughput against a bare transformers loop on the same micro-batches, in the same run.

- ``bare``: for each mini-batch of the learner's shuffled order, the padded forward, log-softmax of the
  completion logits, a masked mean of -A * logp, backward; AdamW step every gradient_accumulation_steps.
  The least a GRPO step can do, with nothing of ours around it.
- ``learner``: ``Trainer.train_generation_batch`` on the same generation batch (the same mini-batches): Batch
  building, policy_loss, stats, clipping, the optimizer step and the metrics row. On-policy and beta = 0,
  so it runs no extra pass: the ratio ``learner / bare`` (tokens/s) is our overhead (goal >= 0.9).
- ``padding_free``: the learner with ``learner.max_tokens_per_batch``.
- ``old_pass`` / ``ref_pass``: the no-grad log-prob pass over the generation batch that num_iterations > 1
  (old) or beta != 0 (reference) adds, in seconds and as a fraction of the bare training time.

Tokens are the real (unpadded) prompt + completion tokens of the generation batch. Phases run
interleaved ``--repeats`` times after a warm-up; medians are reported. Prints JSON; writes it too with
``--json-out`` (default bench/results/learner.json).

    .venv/bin/python bench/learner.py [--model tiny|DIR] [--repeats 5] [--json-out bench/results/learner.json]

On a GPU (issue #15: a Qwen2.5-0.5B-shaped model in bf16, random weights built here, nothing downloaded;
``bench/gpu.sh`` runs it on the GPU machine):

    python3 bench/learner.py --model qwen2.5-0.5b --device cuda --dtype bfloat16 --per-device-train-batch-size 8 \
        --prompt-len 128,256 --completion-len 256,768 --json-out bench/results/learner_gpu.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.report_json import emit

# Model shapes a bench builds with random weights (the tiny model's tokenizer: ids are random anyway).
SHAPES = {
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
}


def shaped_config(shape: str, dtype: str) -> Any:
    """The Qwen2 config of one of ``SHAPES`` (pad id 0, eos id 1: the word-level tokenizer's below)."""
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, pad_token_id=0,
                       eos_token_id=1, dtype=dtype)


def build_shaped_model(shape: str, out: Path, dtype: str) -> Path:
    """A random-weight Qwen2 of a real model's shape in ``out``, with a word-level tokenizer (the bench's ids
    are random; the learner reads only its pad id)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(shaped_config(shape, dtype)).to(getattr(torch, dtype)).save_pretrained(out)
    words = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1}, unk_token="<pad>"))
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>").save_pretrained(out)
    return out


def make_groups(num_groups: int, group_size: int, vocab: int, seed: int, prompt_len: tuple[int, int] = (30, 60),
                completion_len: tuple[int, int] = (8, 96)) -> list:
    """TrainGroups with realistic spread: prompts and completions of lengths drawn uniformly from the ranges."""
    from pipeline.records import ScoredTrajectory, TrainGroup, Trajectory, pack_f32, pack_i32

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(3, vocab, size=int(rng.integers(prompt_len[0], prompt_len[1] + 1)))
        records = []
        for i in range(group_size):
            completion = rng.integers(3, vocab, size=int(rng.integers(completion_len[0], completion_len[1] + 1)))
            t = Trajectory(prompt_id=f"p{g}", attempt=0, request_id=f"p{g}/0/{i}", generation_batch=0,
                           prompt_ids=pack_i32(prompt), completion_ids=pack_i32(completion),
                           logprobs=pack_f32(np.full(len(completion), -1.0)), policy_version=0, max_policy_version=0)
            records.append(ScoredTrajectory(trajectory=t, rewards={"accuracy": float(i % 2)}, reward=float(i % 2)))
        advantages = rng.standard_normal(group_size).round(3).tolist()
        groups.append(TrainGroup(prompt_id=f"p{g}", attempt=0, generation_batch=0, records=records, advantages=advantages))
    return groups


def build_learner(model_dir: Path, out: Path, overrides: list[str]):
    from config import load_config
    from trainer.trainer import Trainer

    cfg = load_config("configs/demo.toml", [f"model.model={model_dir}", "grpo.beta=0", *overrides])
    trainer = Trainer(cfg, model_dir, out, num_batches=1000)
    trainer.load()
    trainer.run = "bench"
    return trainer


def minibatches_of(learner, groups):
    """The learner's own mini-batches (its shuffled order), as Batch objects."""
    from grpo.batching import shuffle_order
    from trainer.model import Batch

    records = [r for g in groups for r in g.records]
    advantages = [a for g in groups for a in g.advantages]
    order = shuffle_order(len(records), learner.cfg.run.seed, learner.version)
    records, advantages = [records[i] for i in order], [advantages[i] for i in order]
    size = learner.cfg.grpo.per_device_train_batch_size
    return [Batch(records[i : i + size], advantages[i : i + size], learner.pad_id, device=learner.device)
            for i in range(0, len(records), size)]


def bare_step(model, optimizer, minibatches, accumulation: int) -> None:
    """The baseline: plain transformers forward/backward on the same padded micro-batches."""
    for index, mb in enumerate(minibatches):
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids,
                    logits_to_keep=mb.width_c + 1, use_cache=False)
        logps = torch.log_softmax(out.logits[:, :-1].float(), -1).gather(-1, mb.completion_ids.unsqueeze(-1)).squeeze(-1)
        mask = mb.completion_mask
        loss = -((logps * mb.advantages[:, None]) * mask).sum() / mask.sum().clamp(min=1)
        (loss / accumulation).backward()
        if (index + 1) % accumulation == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def timed(fn, device: str) -> float:
    started = time.perf_counter()
    fn()
    if device.startswith("cuda"):  # the queued kernels are part of the phase
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(
    model_spec: str, repeats: int, generation_batch_size: int, per_device: int, threads: int, max_tokens: int,
    device: str = "cpu", dtype: str = "float32", prompt_len: tuple[int, int] = (30, 60),
    completion_len: tuple[int, int] = (8, 96), work_dir: Path | None = None,
) -> dict:
    from engines.models import resolve_model_dir
    from rollstream.train import quiet_libraries

    quiet_libraries()
    model_dir = (build_shaped_model(model_spec, work_dir / model_spec, dtype) if model_spec in SHAPES
                 else resolve_model_dir(model_spec))
    common = [f"grpo.generation_batch_size={generation_batch_size}", f"grpo.per_device_train_batch_size={per_device}",
              "grpo.num_generations=8", f"learner.torch_threads={threads}", "learner.learning_rate=1e-6",
              f"learner.device={device}", f"model.torch_dtype={dtype}",
              f"grpo.max_completion_length={completion_len[1]}"]
    accumulation = generation_batch_size // per_device  # one optimizer step per generation batch
    common.append(f"grpo.gradient_accumulation_steps={accumulation}")
    with tempfile.TemporaryDirectory() as tmp:
        learner = build_learner(model_dir, Path(tmp) / "l", common)
        packed = build_learner(model_dir, Path(tmp) / "p", [*common, f"learner.max_tokens_per_batch={max_tokens}"])
        bare = build_learner(model_dir, Path(tmp) / "b", common)  # its model and AdamW, used bare
        vocab = learner.model.config.vocab_size
        groups = make_groups(generation_batch_size // 8, 8, vocab, seed=0, prompt_len=prompt_len,
                             completion_len=completion_len)
        minibatches = minibatches_of(learner, groups)
        tokens = sum(len(seq) for mb in minibatches for seq in mb.sequences)
        padded_tokens = sum(mb.input_ids.numel() for mb in minibatches)

        def old_pass():
            with torch.no_grad():
                for mb in minibatches:
                    learner.logps(learner.model, mb)

        phases = {
            "bare": lambda: bare_step(bare.model, bare.optimizer, minibatches, accumulation),
            "learner": lambda: learner.train_generation_batch(groups, 0),
            "padding_free": lambda: packed.train_generation_batch(groups, 0),
            "old_pass": old_pass,  # the reference pass is the same computation on the frozen copy
        }
        for fn in phases.values():  # warm-up: allocator, kernels, first-call costs
            timed(fn, device)
        seconds: dict[str, list[float]] = {name: [] for name in phases}
        for _ in range(repeats):  # interleaved, so drift on a shared machine hits every phase alike
            for name, fn in phases.items():
                seconds[name].append(timed(fn, device))
    median = {name: statistics.median(values) for name, values in seconds.items()}
    per_second = {name: tokens / median[name] for name in ("bare", "learner", "padding_free")}
    return {
        "model": model_spec if model_spec in SHAPES else str(model_dir),
        "parameters": sum(p.numel() for p in learner.model.parameters()),
        "generation_batch_size": generation_batch_size,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": accumulation,
        "torch_threads": threads,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": dtype,
        "prompt_len": list(prompt_len),
        "completion_len": list(completion_len),
        "max_tokens_per_batch": max_tokens,
        "repeats": repeats,
        "tokens_per_generation_batch": tokens,
        "padded_tokens_per_generation_batch": padded_tokens,
        "seconds_median": {k: round(v, 4) for k, v in median.items()},
        "seconds_all": {k: [round(x, 4) for x in v] for k, v in seconds.items()},
        "tokens_per_second": {k: round(v, 1) for k, v in per_second.items()},
        "ratio_learner_vs_bare": round(per_second["learner"] / per_second["bare"], 3),
        # Each repeat's phases ran back to back: their ratio cancels drift common to both (clocks, neighbours).
        "ratio_learner_vs_bare_paired_median": round(
            statistics.median(b / v for b, v in zip(seconds["bare"], seconds["learner"], strict=True)), 3),
        "ratio_padding_free_vs_bare": round(per_second["padding_free"] / per_second["bare"], 3),
        "old_or_ref_pass_seconds": round(median["old_pass"], 4),
        "old_or_ref_pass_fraction_of_bare_step": round(median["old_pass"] / median["bare"], 3),
        "goal": "ratio_learner_vs_bare >= 0.9",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": ("bash bench/gpu.sh  # on the GPU machine" if device.startswith("cuda")
                    else "python bench/learner.py " + " ".join(sys.argv[1:])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help='"tiny" or a local model directory')
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--generation-batch-size", type=int, default=64)
    parser.add_argument("--per-device-train-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (learner.torch_threads)")
    parser.add_argument("--max-tokens-per-batch", type=int, default=256, help="token budget of the padding-free phase")
    parser.add_argument("--device", default="cpu", help='learner.device: "cpu", "cuda"')
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt-len", default="30,60", help="prompt tokens, min,max")
    parser.add_argument("--completion-len", default="8,96", help="completion tokens, min,max")
    parser.add_argument("--json-out", default="bench/results/learner.json")
    args = parser.parse_args()
    span = lambda text: tuple(int(x) for x in text.split(","))
    with tempfile.TemporaryDirectory() as work:
        result = measure(args.model, args.repeats, args.generation_batch_size, args.per_device_train_batch_size,
                         args.threads, args.max_tokens_per_batch, args.device, args.dtype, span(args.prompt_len),
                         span(args.completion_len), Path(work))
    emit(result, args.json_out)


if __name__ == "__main__":
    main()
