"""No silent truncation: rollout.max_model_len derives from the model (as ms-swift and vLLM read it), and a
configuration in which a completion could be cut below grpo.max_completion_length is an error with both numbers;
prompts are capped so a whole completion always fits; multi-turn requests that fill the context show it."""

from __future__ import annotations

import json

import pytest
from fake_context import FakeContext

from config import ConfigError, config_from_dict
from engines.base import kv_cache_max_len, max_prompt_length, model_max_len, resolve_max_model_len
from pipeline.records import PromptTask, TrajectoryGroup
from schedulers import MultiTurnScheduler, multi_turns


def config(max_model_len=None, max_length=None, max_completion_length=12, **rollout):
    return config_from_dict({
        "data": {"max_length": max_length},
        "grpo": {"max_completion_length": max_completion_length},
        "rollout": {"max_concurrent_groups": 4, "max_model_len": max_model_len, **rollout},
        "reward": {"reward_funcs": ["accuracy"]},
    })


def model_dir(tmp_path, tokenizer_max=None, **config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer_max is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": tokenizer_max}))
    return tmp_path


# ---------------------------------------------------------------------------------------- at load time


def test_a_prompt_cap_plus_a_completion_over_the_context_is_an_error_with_both_numbers():
    with pytest.raises(ConfigError) as err:
        config(max_model_len=4096, max_length=1024, max_completion_length=4000)
    message = str(err.value)
    assert "data.max_length=1024 + grpo.max_completion_length=4000 = 5024 tokens exceed rollout.max_model_len=4096" \
        in message
    assert "lower data.max_length to 96" in message and "raise rollout.max_model_len" in message
    with pytest.raises(ConfigError, match=r"grpo.max_completion_length=4096 leaves no room for a prompt in "
                                          r"rollout.max_model_len=4096"):
        config(max_model_len=4096, max_completion_length=4096)
    assert config(max_model_len=4096, max_length=96, max_completion_length=4000).rollout.max_model_len == 4096


def test_unset_is_the_default_and_checked_once_the_model_is_known():
    cfg = config(max_length=10_000, max_completion_length=4096)  # nothing to compare with yet
    assert cfg.rollout.max_model_len is None


# ------------------------------------------------------------------------------- derived from the model


def test_the_models_maximum_is_read_as_ms_swift_and_vllm_read_it(tmp_path):
    assert model_max_len(model_dir(tmp_path / "a", max_position_embeddings=32768)) == 32768
    # the smallest of the length keys wins (ms-swift's HfConfigFactory.get_max_model_len)
    assert model_max_len(model_dir(tmp_path / "b", max_position_embeddings=32768, seq_length=8192)) == 8192
    # an image-prompt model keeps it in its language model's sub-config
    assert model_max_len(model_dir(tmp_path / "c", text_config={"max_position_embeddings": 128000},
                                   vision_config={"max_position_embeddings": 1024})) == 128000
    # the tokenizer's model_max_length lowers it (vLLM); its "no limit" float sentinel does not
    assert model_max_len(model_dir(tmp_path / "d", tokenizer_max=4096, max_position_embeddings=32768)) == 4096
    assert model_max_len(model_dir(tmp_path / "e", tokenizer_max=1e30, max_position_embeddings=32768)) == 32768
    assert model_max_len(model_dir(tmp_path / "f", hidden_size=64)) is None


def test_unset_max_model_len_is_the_models_maximum_capped_by_a_cpu_kv_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # 7B-like: 28 layers * 4 kv heads * 128 dims * 2 (k, v) * 2 bytes = 57344 bytes a token
    big = model_dir(tmp_path, max_position_embeddings=32768, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, hidden_size=3584)
    cfg = config(max_completion_length=1024, kv_cache_gib=1.0, dtype="bfloat16")
    assert kv_cache_max_len(big, 1.0, "bfloat16") == 2**30 // 57344 == 18724
    assert resolve_max_model_len(cfg, big, cpu=False) == 32768  # a GPU engine: the model's maximum
    assert resolve_max_model_len(cfg, big, cpu=True) == 18724  # a CPU engine: what its KV cache holds
    assert max_prompt_length(cfg, 18724) == 18724 - 1024  # data.max_length unset: what a completion leaves
    assert resolve_max_model_len(config(max_model_len=2048, max_completion_length=1024), big, cpu=True) == 2048
    with pytest.raises(ConfigError) as err:
        resolve_max_model_len(config(max_length=32000, max_completion_length=1024), big, cpu=False)
    assert ("data.max_length=32000 + grpo.max_completion_length=1024 = 33024 tokens exceed rollout.max_model_len "
            "(unset: the model's maximum, 32768)=32768") in str(err.value)
    with pytest.raises(ConfigError, match=r"states no maximum length .* set rollout.max_model_len"):
        resolve_max_model_len(config(), model_dir(tmp_path / "x", hidden_size=64), cpu=True)


def test_the_tiny_models_maximum_is_the_demos_context(tiny_model_dir):
    # the demo's context does not change: its model states 512
    assert resolve_max_model_len(config(), tiny_model_dir, cpu=True) == 512


# -------------------------------------------------------------------------------- the real engine


def task(content="What is 3+4?", generations=4):
    return PromptTask(prompt_id="e0:2", generation_batch=0, num_generations=generations,
                      messages=[{"role": "user", "content": content}], data_dict={"solution": "7"}, seed=5)


@pytest.mark.e2e
async def test_a_config_that_fits_runs_and_long_prompts_leave_room_for_a_whole_completion(vllm_engine,
                                                                                          tiny_model_dir):
    from stages.rollout import Rollout

    await vllm_engine.reset_weights(tiny_model_dir)
    stage = Rollout(config(max_completion_length=12), tiny_model_dir, engine=vllm_engine)  # unset: the engine's 256
    await stage.start(FakeContext(run='ctx', stage='rollout'))
    assert (stage.sampler.max_model_len, stage.sampler.max_prompt_length) == (256, 244)
    long = "What is 3+4? " * 60  # ~ 360 tokens: over what the context leaves a prompt
    assert len(stage.sampler.encode_prompt(task(long))) > 244
    [(_, group)] = (await stage.handle(task(long), FakeContext(run='ctx', stage='rollout'))).outputs  # "left": keeps the last 244 tokens
    for t in group.trajectories:
        assert len(t.prompt_token_ids()) == 244 and 0 < len(t.completion_token_ids()) <= 12
    stage.cfg.grpo.truncation_strategy = "delete"
    [(edge, dropped)] = (await stage.handle(task(long), FakeContext(run='ctx', stage='rollout'))).outputs
    assert edge == "feedback" and dropped.reason == "truncated"


@pytest.mark.e2e
async def test_a_config_over_the_engines_context_is_refused_at_start(vllm_engine, tiny_model_dir):
    from stages.rollout import Rollout

    stage = Rollout(config(max_length=250, max_completion_length=12), tiny_model_dir, engine=vllm_engine)
    with pytest.raises(ConfigError) as err:
        await stage.start(FakeContext(run='ctx', stage='rollout'))
    assert "data.max_length=250 + grpo.max_completion_length=12 = 262 tokens exceed the engine's max_model_len" \
        in str(err.value) and "=256" in str(err.value)


class Again(MultiTurnScheduler):
    def step(self, infer_request, response_choice, current_turn):
        infer_request.messages.append({"role": "user", "content": "Again, please."})
        return {"infer_request": infer_request}


@pytest.mark.e2e
async def test_a_multi_turn_conversation_that_fills_the_context_ends_visibly(vllm_engine, tiny_model_dir):
    from stages.rollout import Rollout

    await vllm_engine.reset_weights(tiny_model_dir)
    multi_turns["ctx_again"] = Again
    try:
        stage = Rollout(config(max_model_len=64, max_completion_length=16, multi_turn_scheduler="ctx_again",
                               max_turns=12), tiny_model_dir, engine=vllm_engine)
        await stage.start(FakeContext(run='ctx', stage='rollout'))
        [(_, group)] = (await stage.handle(task(generations=2), FakeContext(run='ctx', stage='rollout'))).outputs
    finally:
        multi_turns.pop("ctx_again", None)
    assert isinstance(group, TrajectoryGroup)
    for t in group.trajectories:
        # every turn got what the context had left (each sampled token sits inside it); the turn that ran into
        # its end closed the request as ms-swift's check_finished does on "length", and the record shows it
        # (a truncated completion: completions/clipped_ratio, overlong_filter)
        prompt = len(t.prompt_token_ids())
        assert all(prompt + end <= 64 for start, end in t.message_spans if end > start)
        assert t.rollout_infos["num_turns"] > 1 and t.finish_reason == "length" and t.is_truncated


@pytest.mark.e2e
async def test_a_vllm_servers_own_context_is_the_limit_in_server_mode(tiny_model_dir, tmp_path):
    from engines.server_engine import ServerEngine
    from stages.rollout import Rollout
    from tests.test_rollout_server import running_server  # a real `vllm serve --max-model-len 256`

    with running_server(tiny_model_dir, tmp_path / "server") as (url, _proc):
        engine = await ServerEngine.start([url], tiny_model_dir)
        try:
            assert engine.max_model_len == 256  # its /v1/models answer
            fits = config(max_completion_length=12, engine="server", server_urls=[url])
            stage = Rollout(fits, tiny_model_dir, engine=engine)
            await stage.start(FakeContext(run='ctx', stage='rollout'))
            assert (stage.sampler.max_model_len, stage.sampler.max_prompt_length) == (256, 244)
            over = config(max_length=250, max_completion_length=12, engine="server", server_urls=[url])
            with pytest.raises(ConfigError, match=r"262 tokens exceed the engine's max_model_len \(ServerEngine\)=256"):
                await Rollout(over, tiny_model_dir, engine=engine).start(FakeContext(run='ctx', stage='rollout'))
        finally:
            engine.shutdown()
