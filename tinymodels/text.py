"""The tiny model of the demo and the tests: a ~0.4 M-parameter Qwen2 that knows the arithmetic task a little.
Also the ``mid`` model of the benchmarks (see ``MODEL_RECIPES``): the same build, bigger, no warm start; and
the same build on other tasks (``TEXT_TASKS``): ``tiny-gym`` (guess_number episodes, below) and ``tiny-agent``
(``add`` tool calls, tinymodels/agent.py).

Built locally (nothing is downloaded) in three steps, cached under
``$XDG_CACHE_HOME/rollstream/tiny-model/<hash of the recipe and CODE_VERSION>``:

1. a byte-level BPE tokenizer trained on the task's chat text with exactly Qwen2's pre-tokenizer, so that
   transformers 5 and vLLM, which rebuild every "qwen2" tokenizer with that pipeline, keep its ids
   (a char- or word-level tokenizer is silently mangled there);
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
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from data.loading import ARITHMETIC_MAX_OPERAND, arithmetic_prompt
from rewards.builtin import answer_matches
from schedulers.gym_envs import GuessNumberEnv
from tinymodels import agent, vl
from tinymodels.recipes import (
    CODE_VERSION,
    EOS_TOKEN,
    MODEL_RECIPES,
    PAD_TOKEN,
    QWEN2_REGEX,
    RECIPE_FILE,
    TINY_MODEL_RECIPE,
    GymTinyModelRecipe,
    Progress,
    TinyModelRecipe,
    VLTinyModelRecipe,
    padded_episodes,
    recipe_hash,
    sample_completions,
    warm_start_loop,
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/rollstream/tiny-model`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollstream" / "tiny-model"


def tiny_model_path(*, progress: Progress | None = print, recipe: TinyModelRecipe = TINY_MODEL_RECIPE) -> Path:
    """The cached tiny model of ``recipe`` (the demo's by default), built on first use."""
    return build_tiny_model(progress=progress, recipe=recipe)


def model_path(name: str, *, progress: Progress | None = print) -> Path:
    """The cached model of ``MODEL_RECIPES[name]`` ("tiny", "tiny-gym", "tiny-agent", "mid", ...), built on first use."""
    return build_tiny_model(recipe=MODEL_RECIPES[name], progress=progress)


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
    n = ARITHMETIC_MAX_OPERAND + 1
    return [(arithmetic_prompt(a, b), a + b) for a in range(n) for b in range(n)]


def _answer_range(recipe: TinyModelRecipe) -> list[int]:
    """Every possible answer of the task (the wrong answers of the calibration phase come from here)."""
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
    task = TEXT_TASKS[recipe.task]
    corpus = task.corpus(recipe)
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
    fast.chat_template = task.chat_template
    return fast


def _arithmetic_corpus(recipe: TinyModelRecipe) -> list[str]:
    corpus = []
    for prompt, answer in task_examples(recipe):
        corpus.append(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n")
        corpus.append("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    return corpus


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
        head_dim=head_dim,  # pyright: ignore[reportCallIssue]  (a config keyword transformers' stub lacks)
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
    if isinstance(recipe, VLTinyModelRecipe):
        return vl.build(out, recipe, say)
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    started = time.monotonic()
    say(f"building the model {recipe_hash(recipe)} in {out.parent} ...")
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
    _add_chat_template_to_tokenizer_config(out, TEXT_TASKS[recipe.task].chat_template)
    elapsed = time.monotonic() - started
    info = {"hash": recipe_hash(recipe), "code_version": CODE_VERSION, "recipe": dataclasses.asdict(recipe)}
    info.update(accuracy, build_seconds=round(elapsed, 1))
    (out / RECIPE_FILE).write_text(json.dumps(info, indent=2) + "\n")
    say(
        f"model built in {elapsed:.0f}s: accuracy at temperature 1 = {accuracy['accuracy']:.2f} "
        f"(greedy {accuracy['greedy_accuracy']:.2f}), ends with {EOS_TOKEN} {accuracy['eos_rate']:.0%}"
    )


def _add_chat_template_to_tokenizer_config(out: Path, chat_template: str) -> None:
    """transformers 5 writes chat_template.jinja; older readers look in tokenizer_config.json."""
    path = out / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data["chat_template"] = chat_template
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
    data = TEXT_TASKS[recipe.task].sft_data(tokenizer, recipe)

    def batch(rng: random.Random, size: int, correct_prob: float) -> dict[str, Any]:
        ids, mask, labels = data.batch(rng, size, correct_prob)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return warm_start_loop(model, batch, recipe, say, reports=6)


def sample_accuracy(
    model: Any, tokenizer: Any, recipe: TinyModelRecipe, *, n: int, seed: int
) -> dict[str, float]:
    """The task's evaluation on ``n`` prompts or episodes (written into the recipe file): at least
    ``accuracy`` and ``greedy_accuracy`` (sampled at temperature 1, and greedily) and ``eos_rate``."""
    return TEXT_TASKS[recipe.task].evaluate(model, tokenizer, recipe, n=n, seed=seed)


def arithmetic_accuracy(
    model: Any, tokenizer: Any, recipe: TinyModelRecipe, *, n: int, seed: int
) -> dict[str, float]:
    """Accuracy of sampled (temperature 1) and greedy answers on ``n`` task prompts, and how often a
    sampled completion ends with <|im_end|>."""
    import torch

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


# ------------------------------------------------------------------------------ the gym task: guess_number


def _guess_number_env(recipe: GymTinyModelRecipe) -> Any:
    return GuessNumberEnv({"low": recipe.low, "high": recipe.high})


def _guess_number_start(recipe: GymTinyModelRecipe) -> list[dict[str, str]]:
    """The messages the env's reset gives (system prompt, first observation)."""
    env = _guess_number_env(recipe)
    return [{"role": "system", "content": env.system_prompt},
            {"role": "user", "content": f"Guess a number between {recipe.low} and {recipe.high}."}]


def _feedback(target: int, guess: int) -> str:
    return "Correct." if guess == target else ("higher" if target > guess else "lower")


def _guess_number_corpus(recipe: TinyModelRecipe) -> list[str]:
    assert isinstance(recipe, GymTinyModelRecipe), "the guess_number task's recipe"
    start = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in _guess_number_start(recipe))
    corpus = [start]
    for guess in range(recipe.low, recipe.high + 1):
        for word in ("higher", "lower", "Correct.", f"Reply with a number between {recipe.low} and {recipe.high}."):
            corpus.append(f"<|im_start|>assistant\n{guess}<|im_end|>\n<|im_start|>user\n{word}<|im_end|>\n")
    return corpus * 8  # BPE merges need repeats to form


class GuessNumberSFTData:
    """Whole episodes against a drawn target; loss on the guesses (+ <|im_end|>) only. Each guess is the
    bisection midpoint with probability ``correct_prob``, else any number of the range."""

    def __init__(self, tokenizer: Any, recipe: TinyModelRecipe) -> None:
        assert isinstance(recipe, GymTinyModelRecipe), "the guess_number task's recipe"
        self.recipe = recipe
        self.eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        self.pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
        # Encoded once: the start, every reply, and every observation between two replies.
        start = tokenizer.apply_chat_template(_guess_number_start(recipe), tokenize=False, add_generation_prompt=True)
        self.start = tokenizer.encode(start, add_special_tokens=False)
        numbers = range(recipe.low, recipe.high + 1)
        self.replies = {g: tokenizer.encode(str(g), add_special_tokens=False) + [self.eos] for g in numbers}
        self.between = {
            word: tokenizer.encode(f"\n<|im_start|>user\n{word}<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
            for word in ("higher", "lower")
        }

    def episode(self, rng: random.Random, correct_prob: float) -> tuple[list[int], list[int]]:
        r = self.recipe
        target = rng.randint(r.low, r.high)
        lo, hi = r.low, r.high
        ids = list(self.start)
        labels = [-100] * len(ids)
        for turn in range(r.max_turns):
            guess = (lo + hi) // 2 if rng.random() < correct_prob else rng.randint(r.low, r.high)
            ids += self.replies[guess]
            labels += self.replies[guess]
            if guess == target or turn == r.max_turns - 1:
                break
            if target > guess:
                lo = max(lo, guess + 1)
            else:
                hi = min(hi, guess - 1)
            between = self.between[_feedback(target, guess)]
            ids += between
            labels += [-100] * len(between)
        return ids, labels

    def batch(self, rng: random.Random, size: int, correct_prob: float) -> tuple[Any, Any, Any]:
        return padded_episodes([self.episode(rng, correct_prob) for _ in range(size)], self.pad)


def guess_number_success(model: Any, tokenizer: Any, recipe: GymTinyModelRecipe, *, n: int, seed: int) -> dict[str, float]:
    """Play ``n`` episodes at temperature 1 (and greedily) against the real env's rules: how often the number
    is found within ``max_turns``, and how often a reply is a well-formed number ending with <|im_end|>."""
    import torch

    rng = random.Random(seed)
    targets = [rng.randint(recipe.low, recipe.high) for _ in range(n)]
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    def play(temperature: float) -> tuple[float, float]:
        generator = torch.Generator().manual_seed(seed)
        conversations = [list(_guess_number_start(recipe)) for _ in targets]
        found, replies, well_formed = [False] * n, 0, 0
        for _ in range(recipe.max_turns):
            live = [i for i in range(n) if not found[i]]
            if not live:
                break
            prompts = [tokenizer.encode(tokenizer.apply_chat_template(conversations[i], tokenize=False,
                                                                      add_generation_prompt=True),
                                        add_special_tokens=False) for i in live]
            outs = sample_completions(model, tokenizer, prompts, max_new_tokens=4, temperature=temperature,
                                      generator=generator)
            for i, out in zip(live, outs):
                text = tokenizer.decode(out, skip_special_tokens=True).strip()
                replies += 1
                well_formed += bool(out and out[-1] == eos and text.isdigit())
                guess = int(text) if text.isdigit() else None
                found[i] = guess == targets[i]
                if guess is None:
                    observation = f"Reply with a number between {recipe.low} and {recipe.high}."
                else:
                    observation = _feedback(targets[i], guess)
                conversations[i] += [{"role": "assistant", "content": text}, {"role": "user", "content": observation}]
        return sum(found) / n, well_formed / max(1, replies)

    sampled, eos_rate = play(1.0)
    greedy, _ = play(0.0)
    return {"accuracy": sampled, "greedy_accuracy": greedy, "eos_rate": eos_rate}


# ----------------------------------------------------------------------------------------- the tasks


@dataclasses.dataclass(frozen=True)
class TextTask:
    """What a text task brings to the build: the tokenizer's training text, the warm start's batches
    (``sft_data(tokenizer, recipe).batch(rng, size, correct_prob)``), the evaluation written into the recipe
    file, and the chat template."""

    corpus: Callable[[TinyModelRecipe], list[str]]
    sft_data: Callable[[Any, TinyModelRecipe], Any]
    evaluate: Callable[..., dict[str, float]]
    chat_template: str = CHAT_TEMPLATE


# By ``recipe.task``.
TEXT_TASKS = {
    "arithmetic": TextTask(_arithmetic_corpus, _SFTData, arithmetic_accuracy),
    "guess_number": TextTask(_guess_number_corpus, GuessNumberSFTData, guess_number_success),
    "add_tool": TextTask(agent.agent_corpus, agent.AgentSFTData, agent.add_tool_success,
                         agent.AGENT_CHAT_TEMPLATE),
}
