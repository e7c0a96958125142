"""The tiny model: tokenizer survives transformers' Qwen2 rebuild, vLLM-compatible config, caching,
and the warm start lands where GRPO has signal (some answers right, format always right)."""

import dataclasses
import json

import pytest
import torch

from tinymodels.recipes import MID_MODEL_RECIPE
from tinymodels.text import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    RECIPE_FILE,
    TINY_MODEL_RECIPE,
    build_tiny_model,
    encode_prompt,
    make_config,
    recipe_hash,
    sample_accuracy,
    train_tokenizer,
)

# A few SFT steps only: enough to exercise the whole build in seconds.
CHEAP = dataclasses.replace(TINY_MODEL_RECIPE, sft_steps=4, calibrate_steps=2, eval_prompts=8, sft_threads=1)


@pytest.fixture(scope="module")
def cheap_model(tmp_path_factory):
    messages = []
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", recipe=CHEAP, progress=messages.append)
    assert any("warm start" in m for m in messages)
    return path


def test_recipe_hash_follows_the_recipe(monkeypatch):
    assert recipe_hash(TINY_MODEL_RECIPE) == recipe_hash(dataclasses.replace(TINY_MODEL_RECIPE))
    assert recipe_hash(CHEAP) != recipe_hash(TINY_MODEL_RECIPE)
    assert recipe_hash(dataclasses.replace(TINY_MODEL_RECIPE, calibrate_correct_prob=0.31)) != recipe_hash(
        TINY_MODEL_RECIPE
    )
    before = recipe_hash(TINY_MODEL_RECIPE)
    monkeypatch.setattr("data.loading.ARITHMETIC_MAX_OPERAND", 19)  # a different task needs a new model
    assert recipe_hash(TINY_MODEL_RECIPE) != before


def test_mid_model_has_the_benchmark_shape():
    """bench/peer_trl.py's `mid` workload (#15): hidden 512, 8 layers, 8 heads, 2 KV heads, head_dim 64, ~18 M."""
    from transformers import Qwen2ForCausalLM

    config = make_config(MID_MODEL_RECIPE, train_tokenizer(MID_MODEL_RECIPE))
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (512, 8, 8)
    assert (config.num_key_value_heads, config.head_dim) == (2, 64)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert 17e6 < parameters < 19e6
    assert recipe_hash(MID_MODEL_RECIPE) != recipe_hash(TINY_MODEL_RECIPE)


def test_config_needs_head_dim_of_at_least_32():
    tokenizer = train_tokenizer(CHEAP)
    config = make_config(TINY_MODEL_RECIPE, tokenizer)
    assert config.hidden_size // config.num_attention_heads == config.head_dim == 32
    with pytest.raises(ValueError, match="head_dim >= 32"):
        make_config(dataclasses.replace(TINY_MODEL_RECIPE, num_attention_heads=8), tokenizer)


def test_tokenizer_round_trips_through_auto_tokenizer(cheap_model):
    from transformers import AutoTokenizer

    ours = train_tokenizer(CHEAP)
    loaded = AutoTokenizer.from_pretrained(str(cheap_model))  # transformers 5 rebuilds it as Qwen2's
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12+7?"},
    ]
    text = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = loaded.encode(text, add_special_tokens=False)
    assert ids == ours.encode(text, add_special_tokens=False)
    assert loaded.decode(ids) == text
    assert ids[0] == loaded.convert_tokens_to_ids("<|im_start|>")
    odd = "Grüße, 3.5% of 1,024 — ok?"  # bytes outside the training corpus still round-trip
    assert loaded.decode(loaded.encode(odd, add_special_tokens=False)) == odd
    assert json.loads((cheap_model / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE


def test_saved_config_and_files(cheap_model):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(str(cheap_model))
    tokenizer = AutoTokenizer.from_pretrained(str(cheap_model))
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads == 32 == config.head_dim
    assert config.vocab_size == len(tokenizer)
    assert config.tie_word_embeddings is False
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids(EOS_TOKEN) == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id != config.eos_token_id
    assert GenerationConfig.from_pretrained(str(cheap_model)).eos_token_id == config.eos_token_id
    assert sorted(p.name for p in cheap_model.glob("*.safetensors")) == ["model.safetensors"]
    info = json.loads((cheap_model / RECIPE_FILE).read_text())
    assert info["hash"] == recipe_hash(CHEAP) and info["recipe"]["sft_steps"] == 4


def test_model_loads_and_generates(cheap_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(cheap_model))
    model = AutoModelForCausalLM.from_pretrained(str(cheap_model), dtype=torch.float32).eval()
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([encode_prompt(tokenizer, "What is 3+4?")])
    out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape == (1, ids.shape[1] + 4)
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()


def test_cache_reuses_and_rebuilds_by_recipe(tmp_path, monkeypatch, cheap_model):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    messages = []
    first = build_tiny_model(recipe=CHEAP, progress=messages.append)
    assert first == tmp_path / "cache" / "rollstream" / "tiny-model" / recipe_hash(CHEAP)
    assert (first / "model.safetensors").is_file()
    built = len(messages)
    assert built > 0
    assert build_tiny_model(recipe=CHEAP, progress=messages.append) == first
    assert len(messages) == built  # cached: nothing rebuilt
    copy = build_tiny_model(tmp_path / "copy", recipe=CHEAP, progress=messages.append)
    assert len(messages) == built  # copied from the cache, not rebuilt
    assert (copy / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
    other = dataclasses.replace(CHEAP, seed=1)
    second = build_tiny_model(recipe=other, progress=None)
    assert second != first and second.name == recipe_hash(other)
    assert (second / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert not [p for p in first.parent.iterdir() if ".tmp-" in p.name]  # no temp dirs left behind


def test_concurrent_callers_build_once(tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    messages = []
    paths = []
    threads = [
        threading.Thread(
            target=lambda: paths.append(build_tiny_model(recipe=CHEAP, progress=messages.append))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(paths) == 2 and paths[0] == paths[1]
    assert sum(m.startswith("building") for m in messages) == 1


def test_out_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_model(tmp_path, recipe=CHEAP, progress=None)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_shipped_model_starts_where_grpo_has_signal(tiny_model_dir):
    """The real recipe: sampled at temperature 1, some answers right but far from all, and the
    format (digits then <|im_end|>) already certain. Re-measured on the saved weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((tiny_model_dir / RECIPE_FILE).read_text())
    assert info["hash"] == recipe_hash(TINY_MODEL_RECIPE)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    measured = sample_accuracy(model, tokenizer, TINY_MODEL_RECIPE, n=200, seed=TINY_MODEL_RECIPE.seed + 1)
    assert measured == pytest.approx({k: info[k] for k in measured})  # the saved weights are the trained ones
    assert 0.1 <= measured["accuracy"] <= 0.5
    assert measured["greedy_accuracy"] > measured["accuracy"]  # the right answer is usually the likeliest
    assert measured["eos_rate"] >= 0.95 and measured["mean_completion_tokens"] <= 4
