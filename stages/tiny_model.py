"""The tiny model of the demo and the tests: a ~0.4 M-parameter Qwen2 that knows the arithmetic task a little.

Built locally (nothing is downloaded) in three steps, cached under
``$XDG_CACHE_HOME/rollstream/tiny-model/<hash of the recipe and CODE_VERSION>``:

1. a byte-level BPE tokenizer trained on the task's chat text with exactly Qwen2's pre-tokenizer, so that
   transformers 5 and vLLM, which rebuild every "qwen2" tokenizer with that pipeline, keep its ids
   (a char- or word-level tokenizer is silently mangled there; see NOTES-vllm.md);
2. a ``Qwen2ForCausalLM`` whose head_dim is 32 (vLLM's CPU attention needs >= 32, and vLLM derives it
   from hidden_size // num_attention_heads), untied embeddings (a weight reload in vLLM then needs no
   lm_head re-pack), float32;
3. a short supervised warm start on the task (loss on the completion only), in two phases: ``sft_steps``
   on correct answers teach the task, then ``calibrate_steps`` on answers that are correct only with
   probability ``calibrate_correct_prob`` (else a random wrong sum) flatten the answer distribution.
   Sampled at temperature 1 the model then answers right about 20 % of the time: GRPO has signal from
   the first step (neither always wrong nor solved), the format (digits, then ``<|im_end|>``) is
   already certain, and the right answer is often the likeliest one, so RL mostly has to sharpen it:
   with 8 prompts x 8 samples per step and lr 1e-4, accuracy goes from ~0.25 to ~0.85 in ~100 steps.
   (A warm start merely stopped early, at the same accuracy, learns several times slower under GRPO.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bump when the code below changes what gets built (the recipe alone does not capture that).
CODE_VERSION = 1

QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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


def recipe_hash(recipe: TinyModelRecipe = TINY_MODEL_RECIPE) -> str:
    from stages.data import ARITHMETIC_MAX_OPERAND  # the task's shape decides the model too

    fields = {"code_version": CODE_VERSION, "arithmetic_max_operand": ARITHMETIC_MAX_OPERAND}
    payload = json.dumps({**fields, **dataclasses.asdict(recipe)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/rollstream/tiny-model`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollstream" / "tiny-model"


def tiny_model_path(*, progress: Progress | None = print) -> Path:
    """The cached tiny model of ``TINY_MODEL_RECIPE``, built on first use."""
    return build_tiny_model(progress=progress)


def build_tiny_model(
    out: Path | None = None,
    *,
    force: bool = False,
    recipe: TinyModelRecipe = TINY_MODEL_RECIPE,
    progress: Progress | None = print,
) -> Path:
    """Build (or reuse) the tiny model; return its directory.

    Without ``out`` it lives in the cache under the recipe's hash and is rebuilt only when the recipe
    (or CODE_VERSION) changes, or with ``force``. With ``out`` it is built or copied there. Either
    way it is written to a temporary directory first and renamed into place, so a reader never sees
    half a model.
    """
    say = progress or (lambda _msg: None)
    key = recipe_hash(recipe)
    cached = cache_dir() / key
    if out is None:
        if force or not _is_built(cached, key):
            with _build_lock(cached):  # concurrent callers wait for one build instead of each building
                if force or not _is_built(cached, key):
                    for stale in cached.parent.glob(f".{cached.name}.tmp-*"):  # from a killed build
                        shutil.rmtree(stale, ignore_errors=True)
                    _publish(cached, lambda tmp: _build(tmp, recipe, say), replace=force)
        return cached
    out = Path(out).expanduser().resolve()
    if _is_built(out, key) and not force:
        return out
    if out.exists() and any(out.iterdir()) and not (out / RECIPE_FILE).is_file():
        raise FileExistsError(
            f"{out} exists and is not a tiny-model directory; choose an empty or new directory"
        )
    if not force and _is_built(cached, key):
        _publish(out, lambda tmp: shutil.copytree(cached, tmp, dirs_exist_ok=True), replace=True)
    else:
        _publish(out, lambda tmp: _build(tmp, recipe, say), replace=True)
    return out


@contextlib.contextmanager
def _build_lock(final: Path) -> Iterator[None]:
    """An exclusive lock file next to ``final`` (released by the OS if this process dies)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{final.name}.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_built(path: Path, key: str) -> bool:
    try:
        return json.loads((path / RECIPE_FILE).read_text())["hash"] == key
    except (OSError, ValueError, KeyError):
        return False


def _publish(final: Path, write: Callable[[Path], Any], *, replace: bool) -> None:
    """Write into a temp dir next to ``final``, then rename it into place (atomic on one filesystem)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        for file in tmp.iterdir():
            file.chmod(0o644)
        if final.exists() and replace:
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # Another process published the same build first: keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------------------- task


def task_examples(recipe: TinyModelRecipe) -> list[tuple[str, int]]:
    """Every (prompt, answer) of the task, in a fixed order."""
    if recipe.task != "arithmetic":
        raise ValueError(f"unknown tiny-model task {recipe.task!r}; only 'arithmetic' is built in")
    from stages.data import ARITHMETIC_MAX_OPERAND, arithmetic_prompt

    n = ARITHMETIC_MAX_OPERAND + 1
    return [(arithmetic_prompt(a, b), a + b) for a in range(n) for b in range(n)]


def _answer_range(recipe: TinyModelRecipe) -> list[int]:
    """Every possible answer of the task (the wrong answers of the calibration phase come from here)."""
    from stages.data import ARITHMETIC_MAX_OPERAND

    return list(range(2 * ARITHMETIC_MAX_OPERAND + 1))


# ---------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(recipe: TinyModelRecipe) -> Any:
    """Byte-level BPE with Qwen2's exact normalizer / pre-tokenizer / decoder, plus the chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = []
    for prompt, answer in task_examples(recipe):
        corpus.append(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
        corpus.append("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_config(recipe: TinyModelRecipe, tokenizer: Any) -> Any:
    from transformers import Qwen2Config

    head_dim = recipe.hidden_size // recipe.num_attention_heads
    if head_dim * recipe.num_attention_heads != recipe.hidden_size or head_dim < 32:
        raise ValueError(
            f"hidden_size {recipe.hidden_size} / num_attention_heads {recipe.num_attention_heads} must give an "
            f"integer head_dim >= 32 (vLLM's CPU attention), got {recipe.hidden_size / recipe.num_attention_heads}"
        )
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
        dtype="float32",
    )


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------------- build


def _build(out: Path, recipe: TinyModelRecipe, say: Progress) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    started = time.monotonic()
    say(f"building the tiny model ({recipe_hash(recipe)}) in {out.parent} ...")
    tokenizer = train_tokenizer(recipe)
    config = make_config(recipe, tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.sft_threads)
    try:
        torch.manual_seed(recipe.seed)
        model = Qwen2ForCausalLM(config).float()
        warm_start(model, tokenizer, recipe, say)
        model.eval()
        accuracy = sample_accuracy(model, tokenizer, recipe, n=recipe.eval_prompts, seed=recipe.seed + 1)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=True, temperature=1.0
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _add_chat_template_to_tokenizer_config(out)
    elapsed = time.monotonic() - started
    info = {"hash": recipe_hash(recipe), "code_version": CODE_VERSION, "recipe": dataclasses.asdict(recipe)}
    info.update(accuracy, build_seconds=round(elapsed, 1))
    (out / RECIPE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    say(
        f"tiny model built in {elapsed:.0f}s: accuracy at temperature 1 = {accuracy['accuracy']:.2f} "
        f"(greedy {accuracy['greedy_accuracy']:.2f}), ends with {EOS_TOKEN} {accuracy['eos_rate']:.0%}"
    )


def _add_chat_template_to_tokenizer_config(out: Path) -> None:
    """transformers 5 writes chat_template.jinja; older readers look in tokenizer_config.json."""
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(data, indent=2) + "\n")


class _SFTData:
    """The task's token ids, encoded once: prompts and every possible answer (+ <|im_end|>)."""

    def __init__(self, tokenizer: Any, recipe: TinyModelRecipe) -> None:
        self.eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        self.pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
        self.examples = [(encode_prompt(tokenizer, p), a) for p, a in task_examples(recipe)]
        self.answers = _answer_range(recipe)
        self.completions = {
            a: tokenizer.encode(str(a), add_special_tokens=False) + [self.eos] for a in self.answers
        }

    def batch(self, rng: random.Random, size: int, correct_prob: float) -> tuple[Any, Any, Any]:
        """Right-padded ids, attention mask and labels (-100 outside the completion). Each target is
        the correct answer with probability ``correct_prob``, else a uniformly drawn wrong one."""
        import torch

        rows = []
        for _ in range(size):
            prompt_ids, answer = self.examples[rng.randrange(len(self.examples))]
            if correct_prob < 1.0 and rng.random() >= correct_prob:
                answer = rng.choice([x for x in self.answers if x != answer])
            rows.append((prompt_ids, self.completions[answer]))
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.full((size, width), self.pad, dtype=torch.long)
        mask = torch.zeros((size, width), dtype=torch.long)
        labels = torch.full((size, width), -100, dtype=torch.long)
        for i, (p, c) in enumerate(rows):
            seq = p + c
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, len(p) : len(seq)] = torch.tensor(c)
        return ids, mask, labels


def warm_start(model: Any, tokenizer: Any, recipe: TinyModelRecipe, say: Progress) -> list[float]:
    """Supervised warm start, loss on the completion tokens (answer + <|im_end|>) only: ``sft_steps``
    on correct targets teach the task, then ``calibrate_steps`` on targets that are correct only with
    probability ``calibrate_correct_prob`` flatten the answer distribution to about that accuracy."""
    import torch

    rng = random.Random(recipe.seed)
    data = _SFTData(tokenizer, recipe)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.sft_lr, weight_decay=0.0)
    model.train()
    losses: list[float] = []
    total = recipe.sft_steps + recipe.calibrate_steps
    report_every = max(1, total // 6)
    for step in range(1, total + 1):
        learning = step <= recipe.sft_steps
        correct_prob = 1.0 if learning else recipe.calibrate_correct_prob
        lr = (
            recipe.sft_lr * min(1.0, step / max(1, recipe.sft_warmup_steps))
            if learning
            else recipe.calibrate_lr
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, mask, labels = data.batch(rng, recipe.sft_batch_size, correct_prob)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
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


def sample_accuracy(
    model: Any, tokenizer: Any, recipe: TinyModelRecipe, *, n: int, seed: int
) -> dict[str, float]:
    """Accuracy of sampled (temperature 1) and greedy answers on ``n`` task prompts, and how often a
    sampled completion ends with <|im_end|>."""
    import torch

    from rewards.builtin import answer_matches

    rng = random.Random(seed)
    examples = task_examples(recipe)
    picked = [examples[rng.randrange(len(examples))] for _ in range(n)]
    prompts = [encode_prompt(tokenizer, p) for p, _ in picked]
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    generator = torch.Generator().manual_seed(seed)
    sampled = sample_completions(model, tokenizer, prompts, temperature=1.0, generator=generator)
    greedy = sample_completions(model, tokenizer, prompts, temperature=0.0)

    def accuracy(completions: list[list[int]]) -> float:
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        return sum(answer_matches(t, a) for t, (_, a) in zip(texts, picked)) / n

    return {
        "accuracy": accuracy(sampled),
        "greedy_accuracy": accuracy(greedy),
        "eos_rate": sum(1 for c in sampled if c and c[-1] == eos) / n,
        "mean_completion_tokens": sum(len(c) for c in sampled) / n,
    }
