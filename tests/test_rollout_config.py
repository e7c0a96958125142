"""The rollout section of the config: derived max_num_seqs, and clear errors for what this build cannot run."""

from __future__ import annotations

import pytest

from config import ConfigError, format_config, load_config

BASE = ["reward.reward_funcs=[\"accuracy\"]"]


def cfg_with(*overrides):
    return load_config(None, [*BASE, *overrides])


def test_max_num_seqs_defaults_to_ms_swift_formula():
    cfg = cfg_with("grpo.per_device_train_batch_size=4", "grpo.steps_per_generation=4")
    assert cfg.rollout.max_num_seqs == 4 * 1 * 4
    assert cfg_with("rollout.max_num_seqs=7").rollout.max_num_seqs == 7
    assert "# max_num_seqs = 16  (derived" in format_config(cfg)


def test_scheduler_fields_and_defaults():
    cfg = cfg_with("rollout.multi_turn_scheduler=math_tip_trick", "rollout.max_turns=3",
                   "rollout.loss_scale=last_round", "rollout.weight_load=drain", "rollout.min_p=0.1",
                   "rollout.stop=[\"</answer>\"]")
    r = cfg.rollout
    assert (r.multi_turn_scheduler, r.max_turns, r.loss_scale, r.weight_load) == ("math_tip_trick", 3, "last_round", "drain")
    assert (r.min_p, r.stop) == (0.1, ["</answer>"])
    with pytest.raises(ConfigError, match="rollout.loss_scale='all' is not one of default, last_round"):
        cfg_with("rollout.loss_scale=all")


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.weight_transport=nccl", "rollout.weight_transport='nccl' is now"),
        ("rollout.colocate=true", "rollout.colocate=true needs a GPU"),
        ("rollout.tensor_parallel_size=2", "rollout.tensor_parallel_size=2: tensor parallelism needs several GPUs"),
        ("rollout.engine=server", 'rollout.engine="server" needs rollout.server_urls'),
    ],
)
def test_what_cannot_run_here_is_a_clear_error(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        cfg_with(override)


def test_engine_threads_default_to_the_cores_the_learner_leaves(monkeypatch):
    from engines.vllm_engine import engine_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert engine_threads(cfg_with()) == 4 - 1  # learner.torch_threads = 1
    assert engine_threads(cfg_with("learner.torch_threads=2")) == 2
    assert engine_threads(cfg_with("learner.torch_threads=8")) == 1  # never fewer than one
    assert engine_threads(cfg_with("rollout.engine_threads=3", "learner.torch_threads=8")) == 3
    with pytest.raises(ConfigError, match="rollout.engine_threads"):
        cfg_with("rollout.engine_threads=0")


def test_server_urls_must_be_http():
    with pytest.raises(ConfigError, match="must start with http:// or https://"):
        cfg_with("rollout.engine=server", "rollout.server_urls=[\"127.0.0.1:8000\"]")
    cfg = cfg_with("rollout.engine=server", "rollout.server_urls=[\"http://127.0.0.1:8000\"]")
    assert cfg.rollout.server_urls == ["http://127.0.0.1:8000"]


def test_unknown_scheduler_fails_when_the_stage_is_built(tiny_model_dir):
    from pipeline.errors import SetupError
    from stages.rollout import Rollout

    cfg = cfg_with("rollout.multi_turn_scheduler=math_tip_trik")
    with pytest.raises(SetupError, match="did you mean 'math_tip_trick'"):
        Rollout(cfg, tiny_model_dir)


def test_weight_transport_follows_the_learners_train_type():
    assert cfg_with().rollout.weight_transport == "file"
    assert cfg_with("learner.train_type=lora").rollout.weight_transport == "lora"
    assert "# weight_transport = " in format_config(cfg_with("learner.train_type=lora"))  # derived: a comment
    with pytest.raises(ConfigError, match="rollout.weight_transport='lora' needs learner.train_type"):
        cfg_with("rollout.weight_transport=lora")
    with pytest.raises(ConfigError, match="the learner publishes the adapter alone"):
        cfg_with("learner.train_type=lora", "rollout.weight_transport=file")
    server = ["rollout.engine=server", 'rollout.server_urls=["http://127.0.0.1:8000"]']
    with pytest.raises(ConfigError, match="weight_transport='lora' with rollout.engine=\"server\" is not"):
        cfg_with("learner.train_type=lora", *server)
    with pytest.raises(ConfigError, match="learner.lora_rank=600 is above vLLM's largest max_lora_rank 512"):
        cfg_with("learner.train_type=lora", "learner.lora_rank=600")


def test_vllm_max_lora_rank_is_the_smallest_allowed_that_fits():
    from config import vllm_max_lora_rank

    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]


@pytest.mark.parametrize(
    "overrides, what",
    [
        (["rollout.engine=server", 'rollout.server_urls=["http://127.0.0.1:8000"]'], 'rollout.engine = "server"'),
        (["learner.train_type=lora"], 'rollout.weight_transport = "lora"'),
    ],
)
def test_in_flight_weight_sync_needs_the_in_process_engine_with_full_weights(overrides, what):
    assert cfg_with("rollout.weight_load=in_flight").rollout.weight_load == "in_flight"
    with pytest.raises(ConfigError, match=f'rollout.weight_load="in_flight" with {what}: .*"pause" or "drain"'):
        cfg_with("rollout.weight_load=in_flight", *overrides)
