"""The tiny tool-use model ("tiny-agent"): the tiny model's build (tinymodels/text.py) on the ``add_tool``
task, whose pieces live here: the tool, the chat template that renders tools and tool calls, the warm
start's episodes, and the evaluation that plays whole episodes with the tool.

The task: "What is 482+391?" over three-digit operands. The model cannot add those, but it can copy
digits, so an episode that calls the tool is right: the user's question, an assistant reply that is one
Hermes-style call (``<tool_call>\\n{"name": "add", "arguments": {"a": 482, "b": 391}}\\n</tool_call>``), the
tool's response (rendered as a user turn, as Qwen2.5 does), and an assistant reply that copies it. The
warm start teaches that episode, then calibrates: an episode calls the tool only with probability
``calibrate_correct_prob`` and else answers a guessed number directly. Sampled at temperature 1 the model
then calls the tool in some episodes, almost always well-formed and followed by the right answer, and
answers wrong without it: the reward says "call the tool", and RL has to learn just that.
"""

from __future__ import annotations

import functools
import json
import random
import re
from typing import Any

from data.loading import ADD_TOOL_MAX_OPERAND, ADD_TOOL_MIN_OPERAND, arithmetic_prompt
from rewards.builtin import answer_matches
from tinymodels.recipes import EOS_TOKEN, PAD_TOKEN, TinyModelRecipe, padded_episodes, sample_completions


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        The sum of a and b.
    """
    return a + b


TOOLS = {"add": add}

# The tiny model's ChatML, extended for tools as Qwen2.5's template (Hermes tool calls), compact: the system
# turn names the tools instead of carrying their JSON schemas (the model knows its one tool), and a tool's
# response is a user turn in <tool_response> tags. Every message renders on its own, so appending a message
# only appends text (what a multi-turn rollout needs). transformers renders with trim_blocks: a newline
# right after a {% %} tag is dropped, hence the {{ '\n' }}.
AGENT_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "Tools:{% for t in tools %} {{ t.function.name if t.function is defined else t.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"  # merged into the tools' system turn
    "{% elif m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] + '\\n' }}{% endif %}"
    "{% for c in m.tool_calls %}{% set f = c.function if c.function is defined else c %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ f.name | tojson }}, "arguments": '
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ASSISTANT_REPLY = re.compile(re.escape("<|im_start|>assistant\n") + r"(.*?" + re.escape(EOS_TOKEN) + ")", re.DOTALL)


@functools.cache
def tool_schemas() -> tuple[dict[str, Any], ...]:
    """The tools as transformers' ``apply_chat_template(tools=...)`` and TRL see them (their JSON schemas)."""
    from transformers.utils.chat_template_utils import get_json_schema

    return tuple(get_json_schema(tool) for tool in TOOLS.values())


def _operands(rng: random.Random) -> tuple[int, int]:
    return rng.randint(ADD_TOOL_MIN_OPERAND, ADD_TOOL_MAX_OPERAND), rng.randint(ADD_TOOL_MIN_OPERAND, ADD_TOOL_MAX_OPERAND)


def episode_messages(a: int, b: int, *, guess: int | None = None) -> list[dict[str, Any]]:
    """One episode: the question, then the tool call, its response and the copied sum; or, with ``guess``,
    the question answered directly with that number."""
    question = {"role": "user", "content": arithmetic_prompt(a, b)}
    if guess is not None:
        return [question, {"role": "assistant", "content": str(guess)}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
    return [question, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "add", "content": str(add(a, b))}, {"role": "assistant", "content": str(add(a, b))}]


def _guess(rng: random.Random, a: int, b: int) -> int:
    """A plausible wrong answer: any other sum of two operands of the task."""
    low, high = 2 * ADD_TOOL_MIN_OPERAND, 2 * ADD_TOOL_MAX_OPERAND
    guess = rng.randint(low, high - 1)
    return guess + 1 if guess >= a + b else guess


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """``messages`` as the model sees them: with the tools, through the tokenizer's chat template."""
    return tokenizer.apply_chat_template(messages, tools=list(tool_schemas()), tokenize=False, **kwargs)


def agent_corpus(recipe: TinyModelRecipe) -> list[str]:
    """The tokenizer's training text: episodes, half with the tool, half answered directly, rendered by the
    chat template (through a tokenizer without a vocabulary: the real one is trained on this text)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    renderer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), chat_template=AGENT_CHAT_TEMPLATE)
    rng = random.Random(recipe.seed)
    corpus = []
    for i in range(1000):
        a, b = _operands(rng)
        corpus.append(render(renderer, episode_messages(a, b, guess=_guess(rng, a, b) if i % 2 else None)))
    return corpus


class AgentSFTData:
    """Whole episodes rendered by the chat template; loss on the assistant replies (+ <|im_end|>) only. An
    episode calls the tool with probability ``correct_prob``, else answers a guessed number directly."""

    def __init__(self, tokenizer: Any, recipe: TinyModelRecipe) -> None:
        self.tokenizer = tokenizer
        self.pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    def episode(self, rng: random.Random, correct_prob: float) -> tuple[list[int], list[int]]:
        a, b = _operands(rng)
        guess = None if rng.random() < correct_prob else _guess(rng, a, b)
        text = render(self.tokenizer, episode_messages(a, b, guess=guess))
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        replies = [m.span(1) for m in _ASSISTANT_REPLY.finditer(text)]
        ids = encoded["input_ids"]
        labels = [
            token if any(start <= begin and end <= stop for start, stop in replies) else -100
            for token, (begin, end) in zip(ids, encoded["offset_mapping"])
        ]
        return ids, labels

    def batch(self, rng: random.Random, size: int, correct_prob: float) -> tuple[Any, Any, Any]:
        return padded_episodes([self.episode(rng, correct_prob) for _ in range(size)], self.pad)


def parse_tool_call(text: str) -> dict[str, Any] | None:
    """The first ``<tool_call>`` of a reply as ``{"name": ..., "arguments": {...}}``, or None when there is
    none or it is not a JSON object with a string name and an object of arguments (as Hermes parsers)."""
    found = _TOOL_CALL.search(text)
    if found is None:
        return None
    try:
        call = json.loads(found.group(1))
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
        return None
    return {"name": call["name"], "arguments": call["arguments"]}


def _run_tool(call: dict[str, Any] | None) -> str | None:
    """The tool's response to a parsed call, or None when the call names no tool or misses its arguments."""
    if call is None or call["name"] not in TOOLS:
        return None
    arguments = call["arguments"]
    if set(arguments) != {"a", "b"} or not all(type(v) is int for v in arguments.values()):
        return None
    return str(TOOLS[call["name"]](**arguments))


def add_tool_success(model: Any, tokenizer: Any, recipe: TinyModelRecipe, *, n: int, seed: int) -> dict[str, float]:
    """Play ``n`` episodes at temperature 1 (and greedily): sample the first reply; when it holds a tool call
    that runs, append the call and the tool's response and sample the second reply. Reports how often the
    tool is called, how often a call is well-formed (JSON, the right name, the question's a and b), how often
    the reply after a response copies it, the final answer's accuracy overall, with and without the tool,
    and how often a reply ends with <|im_end|>."""
    import torch

    rng = random.Random(seed)
    questions = [_operands(rng) for _ in range(n)]
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)

    def sample(conversations: list[list[dict[str, Any]]], max_new_tokens: int, temperature: float,
               generator: Any) -> list[tuple[str, bool]]:
        prompts = [tokenizer.encode(render(tokenizer, c, add_generation_prompt=True), add_special_tokens=False)
                   for c in conversations]
        outs = sample_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                  temperature=temperature, generator=generator)
        return [(tokenizer.decode(out, skip_special_tokens=True), bool(out and out[-1] == eos)) for out in outs]

    def play(temperature: float) -> dict[str, float]:
        generator = torch.Generator().manual_seed(seed)
        conversations = [[{"role": "user", "content": arithmetic_prompt(a, b)}] for a, b in questions]
        firsts = sample(conversations, 48, temperature, generator)
        final = [text for text, _ in firsts]
        ended = [done for _, done in firsts]
        called = ["<tool_call>" in text for text in final]
        well_formed, responses, continued = 0, {}, []
        for i, ((a, b), (text, _)) in enumerate(zip(questions, firsts)):
            call = parse_tool_call(text)
            well_formed += call == {"name": "add", "arguments": {"a": a, "b": b}}
            response = _run_tool(call) if called[i] else None
            if response is None:
                continue
            responses[i] = response
            assert call is not None  # a tool ran: the call parsed
            content = text[: text.index("<tool_call>")].strip()
            conversations[i] += [
                {"role": "assistant", "content": content, "tool_calls": [{"type": "function", "function": call}]},
                {"role": "tool", "name": call["name"], "content": response},
            ]
            continued.append(i)
        for i, (text, done) in zip(continued, sample([conversations[i] for i in continued], 8, temperature, generator)):
            final[i] = text
            ended.append(done)
        right = [answer_matches(text, a + b) for text, (a, b) in zip(final, questions)]
        calls = sum(called)

        def rate(hits: int, out_of: int) -> float:
            return hits / out_of if out_of else 0.0

        return {
            "accuracy": rate(sum(right), n),
            "tool_call_rate": rate(calls, n),
            "well_formed_call_rate": rate(well_formed, calls),
            "result_copy_rate": rate(sum(answer_matches(final[i], r) for i, r in responses.items()), len(responses)),
            "accuracy_with_tool": rate(sum(r for r, c in zip(right, called) if c), calls),
            "accuracy_without_tool": rate(sum(r for r, c in zip(right, called) if not c), n - calls),
            "eos_rate": rate(sum(ended), len(ended)),
        }

    sampled = play(1.0)
    greedy = play(0.0)
    return {**sampled, "greedy_accuracy": greedy["accuracy"], "greedy_tool_call_rate": greedy["tool_call_rate"]}
