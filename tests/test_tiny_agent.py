"""The tiny tool-use model ("tiny-agent", tinymodels/agent.py): its chat template renders tools and tool
calls as Qwen2.5 does (compactly) and only appends when a message is appended, its tool is what
transformers and TRL take, the warm start trains on the assistant replies only, and the built model calls
the tool in some episodes, well-formed, and copies the result, while its direct answers are wrong."""

import dataclasses
import json
import random

import pytest
import torch

from data import loading
from tinymodels.agent import (
    AGENT_CHAT_TEMPLATE,
    AgentSFTData,
    add,
    add_tool_success,
    episode_messages,
    parse_tool_call,
    tool_schemas,
)
from tinymodels.recipes import (
    AGENT_TINY_MODEL_RECIPE,
    MODEL_RECIPES,
    RECIPE_FILE,
    TINY_MODEL_RECIPE,
    AgentTinyModelRecipe,
    recipe_hash,
)
from tinymodels.text import CHAT_TEMPLATE, train_tokenizer

RECIPE = AGENT_TINY_MODEL_RECIPE
QUESTION = {"role": "user", "content": "What is 482+391?"}
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 482, "b": 391}}}]}
RESPONSE = {"role": "tool", "name": "add", "content": "873"}


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(RECIPE)


def render(tokenizer, messages, tools=(add,), **kwargs):
    return tokenizer.apply_chat_template(messages, tools=list(tools) or None, tokenize=False, **kwargs)


def test_the_tool_is_what_transformers_and_trl_take():
    from transformers.utils import get_json_schema

    assert add(482, 391) == 873
    assert get_json_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "description": "The first number."},
                               "b": {"type": "integer", "description": "The second number."}},
                "required": ["a", "b"],
            },
            "return": {"type": "integer", "description": "The sum of a and b."},
        },
    }
    assert tool_schemas() == (get_json_schema(add),)


def test_template_renders_the_episode_in_hermes_style(tokenizer):
    assert tokenizer.chat_template == AGENT_CHAT_TEMPLATE
    assert render(tokenizer, [QUESTION, CALL, RESPONSE, {"role": "assistant", "content": "873"}]) == (
        "<|im_start|>system\nTools: add<|im_end|>\n"
        "<|im_start|>user\nWhat is 482+391?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 482, "b": 391}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n873\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n873<|im_end|>\n"
    )
    # the schema (a callable, or its JSON schema) names the tools; without tools it is the tiny model's ChatML
    multiply = {"type": "function", "function": {"name": "multiply", "parameters": {}}}
    assert render(tokenizer, [QUESTION], tools=[add, multiply]).startswith(
        "<|im_start|>system\nTools: add multiply<|im_end|>\n<|im_start|>user\n")
    assert render(tokenizer, [QUESTION], tools=list(tool_schemas())) == render(tokenizer, [QUESTION])
    plain = [{"role": "system", "content": "Be brief."}, QUESTION, {"role": "assistant", "content": "873"}]
    tokenizer.chat_template = CHAT_TEMPLATE
    try:
        as_tiny = render(tokenizer, plain, tools=())
    finally:
        tokenizer.chat_template = AGENT_CHAT_TEMPLATE
    assert render(tokenizer, plain, tools=()) == as_tiny
    # a system message merges into the tools' system turn
    assert render(tokenizer, plain, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.\nTools: add<|im_end|>\n<|im_start|>user\nWhat is 482+391?<|im_end|>\n"
        "<|im_start|>assistant\n873<|im_end|>\n<|im_start|>assistant\n"
    )
    # arguments given as a JSON string are rendered as they are; text before the calls; two calls
    calls = {"role": "assistant", "content": "Adding.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}},
        {"name": "add", "arguments": {"a": 3, "b": 4}},
    ]}
    assert render(tokenizer, [QUESTION, calls]).endswith(
        '<|im_start|>assistant\nAdding.\n<tool_call>\n{"name": "add", "arguments": {"a":1,"b":2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>\n'
    )


def test_template_only_appends_when_a_message_is_appended(tokenizer):
    """What a multi-turn rollout needs: the tokens of the turns so far stay the prefix of the next prompt."""
    conversation = [QUESTION, CALL, RESPONSE, {"role": "assistant", "content": "873"}]
    for system in ([], [{"role": "system", "content": "Be brief."}]):
        messages = system + conversation
        for k in range(1, len(messages)):
            shorter, longer = render(tokenizer, messages[:k]), render(tokenizer, messages[: k + 1])
            assert longer.startswith(shorter)
            prompt = render(tokenizer, messages[:k], add_generation_prompt=True)
            if messages[k]["role"] == "assistant":  # the reply continues the generation prompt
                assert longer.startswith(prompt)
            ids = tokenizer.encode(longer, add_special_tokens=False)
            assert ids[: len(tokenizer.encode(shorter, add_special_tokens=False))] == tokenizer.encode(
                shorter, add_special_tokens=False)


def test_the_tool_calls_fixed_strings_are_few_tokens_and_digits_single(tokenizer):
    text = render(tokenizer, episode_messages(482, 391))
    tokens = [tokenizer.decode([t]) for t in tokenizer.encode(text, add_special_tokens=False)]
    assert {"<tool", "_call", "name", "arguments", "_response"} <= set(tokens)
    assert tokens.count("4") >= 2 and tokens.count("8") >= 3  # 482 and 873 digit by digit
    assert len(tokens) <= 90


def test_warm_start_trains_on_the_replies_only(tokenizer):
    sft = AgentSFTData(tokenizer, RECIPE)
    rng = random.Random(0)
    with_tool = 0
    for _ in range(200):
        ids, labels = sft.episode(rng, correct_prob=0.3)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        a, b = (int(x) for x in text.split("What is ")[1].split("?")[0].split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999
        trained = tokenizer.decode([t for t, label in zip(ids, labels) if label != -100], skip_special_tokens=False)
        replies = trained.split("<|im_end|>")[:-1]
        if len(replies) == 2:
            with_tool += 1
            assert parse_tool_call(replies[0]) == {"name": "add", "arguments": {"a": a, "b": b}}
            assert replies[0].startswith("<tool_call>") and replies[1] == str(a + b)
        else:
            assert len(replies) == 1 and replies[0].isdigit() and int(replies[0]) != a + b  # a wrong guess
            assert 200 <= int(replies[0]) <= 1998
        assert trained.endswith("<|im_end|>")
    assert 40 <= with_tool <= 80  # about correct_prob of 200
    assert all(len(sft.episode(rng, 1.0)[0]) > 60 for _ in range(5))


def test_parse_tool_call():
    call = {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert parse_tool_call('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>') == call
    assert parse_tool_call('Let me.\n<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>') == call
    assert parse_tool_call("873") is None
    assert parse_tool_call('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}\n</tool_call>') is None
    assert parse_tool_call('<tool_call>\n{"name": "add", "arguments": "a=1"}\n</tool_call>') is None
    assert parse_tool_call('<tool_call>\n{"name": "add", "arguments": {"a": 1}}') is None  # never closed


def test_add_tool_dataset_is_seeded():
    rows = loading.builtin_dataset("add_tool", 50, seed=3)
    assert rows == loading.add_tool_rows(50, seed=3) != loading.add_tool_rows(50, seed=4)
    for row in rows:
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").removesuffix("?").split("+"))
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["solution"] == str(a + b)
    loaded = loading.load_dataset("add_tool", builtin_size=8, seed=1)
    assert len(loaded) == 8 and all("solution" in r for r in loaded)


def test_recipe_is_registered_with_its_own_hash(monkeypatch):
    assert MODEL_RECIPES["tiny-agent"] is RECIPE and isinstance(RECIPE, AgentTinyModelRecipe)
    assert RECIPE.task == "add_tool"
    assert recipe_hash(RECIPE) != recipe_hash(TINY_MODEL_RECIPE)
    tiny, agent = recipe_hash(TINY_MODEL_RECIPE), recipe_hash(RECIPE)
    monkeypatch.setattr("data.loading.ADD_TOOL_MAX_OPERAND", 99)  # the task's range decides only this model
    assert recipe_hash(RECIPE) != agent and recipe_hash(TINY_MODEL_RECIPE) == tiny
    monkeypatch.setattr("tinymodels.recipes.AGENT_CODE_VERSION", 99)
    assert recipe_hash(TINY_MODEL_RECIPE) == tiny


def test_built_agent_model_starts_where_rl_has_signal(tiny_agent_model_dir):
    """Sampled at temperature 1 the built model calls the tool in some episodes, well-formed, and copies the
    response; its direct answers are wrong. Re-measured on the saved weights (200 seeded episodes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((tiny_agent_model_dir / RECIPE_FILE).read_text())
    assert info["hash"] == recipe_hash(RECIPE)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_agent_model_dir))
    assert tokenizer.chat_template == AGENT_CHAT_TEMPLATE
    assert json.loads((tiny_agent_model_dir / "tokenizer_config.json").read_text())["chat_template"] == (
        AGENT_CHAT_TEMPLATE)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_agent_model_dir), dtype=torch.float32).eval()
    measured = add_tool_success(model, tokenizer, RECIPE, n=200, seed=RECIPE.seed + 1)
    assert measured == pytest.approx({k: info[k] for k in measured})  # the saved weights are the trained ones
    assert 0.15 <= measured["tool_call_rate"] <= 0.5
    assert measured["well_formed_call_rate"] >= 0.85
    assert measured["result_copy_rate"] >= 0.8
    assert measured["accuracy_with_tool"] >= 0.75
    assert measured["accuracy_without_tool"] <= 0.05
    assert 0.1 <= measured["accuracy"] <= 0.45 and measured["eos_rate"] >= 0.95


def test_a_cheap_agent_build_runs_end_to_end(tmp_path):
    from tinymodels.text import build_tiny_model

    cheap = dataclasses.replace(RECIPE, sft_steps=3, calibrate_steps=1, eval_prompts=4)
    messages = []
    path = build_tiny_model(tmp_path / "model", recipe=cheap, progress=messages.append)
    info = json.loads((path / RECIPE_FILE).read_text())
    assert info["recipe"]["task"] == "add_tool" and set(info) >= {
        "tool_call_rate", "well_formed_call_rate", "result_copy_rate", "accuracy", "accuracy_with_tool",
        "accuracy_without_tool", "build_seconds"}
    assert any("warm start" in m for m in messages)
