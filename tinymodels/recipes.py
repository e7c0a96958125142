"""The recipes of the models the project builds (everything that decides a build; its hash names the cached
model) and what the text, agent and VL builds share: the tokens the chat format needs, the recipe file
written beside a model, the warm-start loop and the sampling their evaluations use."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from data import loading

# Bump when the build code (tinymodels/text.py, tinymodels/vl.py) changes what gets built (the recipe
# alone does not capture that).
CODE_VERSION = 1
# Bump when tinymodels/agent.py (the add_tool task's template, episodes) changes what gets built: it
# rebuilds the tiny-agent model only.
AGENT_CODE_VERSION = 1

QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
RECIPE_FILE = "rollstream_recipe.json"

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TinyModelRecipe:
    """Everything that decides the built model; its hash names the cache directory."""

    task: str = "arithmetic"
    seed: int = 0
    # tokenizer
    vocab_size: int = 320
    # Qwen2 config: head_dim = hidden_size // num_attention_heads must be >= 32 for vLLM on CPU
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    # warm start (SFT): loss on the completion tokens only, AdamW, constant lr
    sft_steps: int = 300  # on correct targets
    calibrate_steps: int = 100  # then on noisy targets:
    calibrate_correct_prob: float = 0.3  # how often such a target is the correct sum (else a wrong one)
    sft_batch_size: int = 64
    sft_lr: float = 1e-3
    sft_warmup_steps: int = 20
    calibrate_lr: float = 2e-4
    max_grad_norm: float = 1.0
    sft_threads: int = 1  # 2 threads on a busy 2-core box can be 10x slower (OpenMP spin-waits)
    # measured after the build (reported in rollstream_recipe.json, not part of the model)
    eval_prompts: int = 200


TINY_MODEL_RECIPE = TinyModelRecipe()

# The generation-heavier workload of bench/peer_trl.py (issue #15): ~18 M parameters, head_dim 64, the
# tiny model's tokenizer and task. Random-init (no warm start): it measures throughput, not learning,
# so its completions run to the length cap, which is what makes it generation-heavy.
MID_MODEL_RECIPE = TinyModelRecipe(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    sft_steps=0,
    calibrate_steps=0,
    eval_prompts=20,  # the build's accuracy check only shows it is untrained; keep the build short
)

# `model.model = "<name>"` builds (or reuses from the cache) one of these.


@dataclass(frozen=True)
class GymTinyModelRecipe(TinyModelRecipe):
    """The gym demo's model: the same architecture, warm-started on ``guess_number`` episodes (the env's
    prompts, "higher"/"lower" observations, one number per reply). The SFT phase imitates bisection (the
    midpoint of the numbers still possible); the calibration phase makes each guess bisection's only with
    probability ``calibrate_correct_prob`` (else any number of the range), so the model starts out finding
    the number sometimes and RL has to sharpen its use of the feedback."""

    task: str = "guess_number"
    vocab_size: int = 384  # more merges than the demo's: the env's sentences become fewer tokens
    low: int = 1
    high: int = 8
    max_turns: int = 3
    sft_steps: int = 150
    calibrate_steps: int = 60
    calibrate_correct_prob: float = 0.3
    sft_batch_size: int = 32
    eval_prompts: int = 100


GYM_TINY_MODEL_RECIPE = GymTinyModelRecipe()



@dataclass(frozen=True)
class AgentTinyModelRecipe(TinyModelRecipe):
    """The tool-use model (tinymodels/agent.py): the same architecture, warm-started on ``add_tool``
    episodes ("What is 482+391?" -> a Hermes-style ``<tool_call>`` of ``add`` -> the tool's response ->
    the sum copied). Three-digit sums are beyond the model, copying is not: the SFT phase always calls
    the tool; the calibration phase calls it only with probability ``calibrate_correct_prob`` and else
    answers a guessed number directly, so the model starts out calling the tool in some episodes, and
    doing it right when it does, and RL has to learn to always call it."""

    task: str = "add_tool"
    vocab_size: int = 384  # merges for the call's fixed strings (<tool_call>, "arguments", ...): shorter episodes
    sft_steps: int = 300
    calibrate_steps: int = 100
    calibrate_correct_prob: float = 0.3
    sft_batch_size: int = 32
    sft_lr: float = 2e-3
    eval_prompts: int = 200


AGENT_TINY_MODEL_RECIPE = AgentTinyModelRecipe()

VL_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class VLTinyModelRecipe(TinyModelRecipe):
    """A tiny VL model: the text tiny model's tower plus a 2-layer vision tower of ``arch``."""

    task: str = "shapes"
    arch: str = "qwen2_vl"
    vision_depth: int = 2
    vision_width: int = 64
    sft_steps: int = 250
    calibrate_steps: int = 80
    calibrate_correct_prob: float = 0.35
    sft_batch_size: int = 32
    sft_lr: float = 2e-3
    eval_prompts: int = 96


VL_RECIPES = {arch: VLTinyModelRecipe(arch=arch) for arch in VL_ARCHS}
"""The tiny VL models by architecture (``rollstream tiny-model build --vl ARCH``); built by tinymodels/vl.py."""

# The models the project builds, by the name `model.model` and `rollstream tiny-model build --recipe` take.
MODEL_RECIPES = {
    "tiny": TINY_MODEL_RECIPE, "tiny-gym": GYM_TINY_MODEL_RECIPE, "tiny-agent": AGENT_TINY_MODEL_RECIPE,
    "mid": MID_MODEL_RECIPE,
    **{f"tiny-vl-{arch}" if arch != "qwen2_vl" else "tiny-vl": recipe for arch, recipe in VL_RECIPES.items()},
}


def recipe_hash(recipe: TinyModelRecipe = TINY_MODEL_RECIPE) -> str:
    # The task's shape decides the model too (read when called: a changed task means a new model).
    fields: dict[str, Any] = {"code_version": CODE_VERSION, "arithmetic_max_operand": loading.ARITHMETIC_MAX_OPERAND}
    if recipe.task == "add_tool":  # only this task's hash carries its fields: the other models keep theirs
        fields.update(agent_code_version=AGENT_CODE_VERSION,
                      add_tool_operands=[loading.ADD_TOOL_MIN_OPERAND, loading.ADD_TOOL_MAX_OPERAND])
    payload = json.dumps({**fields, **dataclasses.asdict(recipe)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def warm_start_loop(
    model: Any, batch: Callable[[random.Random, int, float], dict[str, Any]], recipe: Any, say: Progress, reports: int
) -> list[float]:
    """The warm start's optimization, for every built model (text and VL): ``sft_steps`` on correct targets
    (lr warmed up over ``sft_warmup_steps``), then ``calibrate_steps`` at ``calibrate_lr`` on targets correct
    with probability ``calibrate_correct_prob``. ``batch(rng, size, correct_prob)`` gives the model's kwargs
    (labels included). Returns the loss of every step; reports the mean ``reports`` times."""
    import torch

    rng = random.Random(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    total = recipe.sft_steps + recipe.calibrate_steps
    report_every = max(1, total // reports)
    for step in range(1, total + 1):
        learning = step <= recipe.sft_steps
        correct_prob = 1.0 if learning else recipe.calibrate_correct_prob
        lr = recipe.sft_lr * min(1.0, step / max(1, recipe.sft_warmup_steps)) if learning else recipe.calibrate_lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(**batch(rng, recipe.sft_batch_size, correct_prob)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
        if step % report_every == 0 or step == total:
            recent = losses[-report_every:]
            say(f"  warm start {step}/{total}: loss {sum(recent) / len(recent):.3f}")
    return losses


def sample_completions(
    model: Any,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 8,
    temperature: float = 1.0,
    generator: Any = None,
) -> list[list[int]]:
    """Sample (``temperature`` > 0) or decode greedily (0) one completion per prompt, stopping at
    <|im_end|> (included). Prompts of one length are batched together, so no padding is involved."""
    import torch

    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    results: list[list[int]] = [[] for _ in prompt_ids]
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompt_ids):
        by_length.setdefault(len(p), []).append(i)
    with torch.no_grad():
        for indices in by_length.values():
            seqs = torch.tensor([list(prompt_ids[i]) for i in indices], dtype=torch.long)
            done = torch.zeros(len(indices), dtype=torch.bool)
            for _ in range(max_new_tokens):
                logits = model(input_ids=seqs).logits[:, -1, :].float()
                if temperature > 0:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                else:
                    nxt = logits.argmax(dim=-1)
                nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
                seqs = torch.cat([seqs, nxt[:, None]], dim=1)
                for row, i in enumerate(indices):
                    if not done[row]:
                        results[i].append(int(nxt[row]))
                done |= nxt == eos
                if bool(done.all()):
                    break
    return results


def padded_episodes(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[Any, Any, Any]:
    """Whole-episode warm-start rows ``(ids, labels)`` as right-padded ``(input_ids, attention_mask, labels)``."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (seq, lab) in enumerate(rows):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, mask, labels
