"""rollstream's defaults against ms-swift's (3.12.6, ``swift rlhf --rlhf_type grpo``, read from its source):
the aligned ones are equal, and the README's table of those that differ states the config's real values."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pipeline.config import FIELDS, config_from_dict
from tests import test_learner_loop
from tests.test_learner_loop import StageCtx, new_learner

model_dir = test_learner_loop.model_dir  # the tiny model fixture

ROOT = Path(__file__).resolve().parents[1]

# ms-swift's values (RLHFArguments._init_grpo / _set_default, GRPOArgumentsMixin, RolloutTrainerArgumentsMixin,
# TrainArgumentsMixin, Seq2SeqTrainingOverrideArguments, TunerArguments) that rollstream takes as its defaults.
ALIGNED = {
    "grpo.num_generations": 8,
    "grpo.max_completion_length": 512,
    "grpo.gradient_accumulation_steps": 1,
    "grpo.num_iterations": 1,
    "grpo.beta": 0.04,
    "grpo.epsilon": 0.2,
    "grpo.epsilon_high": None,
    "grpo.delta": None,
    "grpo.loss_type": "grpo",
    "grpo.importance_sampling_level": "token",
    "grpo.advantage_estimator": "grpo",
    "grpo.scale_rewards": "group",
    "grpo.kl_in_reward": False,
    "grpo.repetition_penalty": 1.0,
    "grpo.truncation_strategy": "left",
    "grpo.dynamic_sample": False,
    "grpo.max_resample_times": 3,
    "grpo.overlong_filter": False,
    "grpo.top_entropy_quantile": 1.0,
    "grpo.log_entropy": False,
    "grpo.tau_pos": 1.0,
    "grpo.tau_neg": 1.05,
    "grpo.rollout_importance_sampling_threshold": 2.0,
    "learner.learning_rate": 1e-5,
    "learner.weight_decay": 0.1,
    "learner.adam_beta1": 0.9,
    "learner.adam_beta2": 0.95,
    "learner.adam_epsilon": 1e-8,
    "learner.max_grad_norm": 1.0,
    "learner.lr_scheduler_type": "cosine",
    "learner.warmup_ratio": 0.0,
    "learner.lora_rank": 8,
    "learner.lora_alpha": 32,
    "learner.lora_dropout": 0.05,
    "learner.target_modules": ["all-linear"],
    "learner.sync_ref_model": False,
    "learner.ref_model_mixup_alpha": 0.6,
    "learner.ref_model_sync_steps": 512,
    "run.seed": 42,
    "data.dataset_shuffle": True,
    "data.split_dataset_ratio": 0.0,
}


def defaults():
    return config_from_dict({"reward": {"reward_funcs": ["accuracy"]}})


def value(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def test_aligned_defaults_are_ms_swifts():
    cfg = defaults()
    assert {name: value(cfg, name) for name in ALIGNED} == ALIGNED
    lora = config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "learner": {"train_type": "lora"}})
    assert lora.learner.learning_rate == 1e-4  # ms-swift: 1e-4 for tuners


def test_readme_table_of_differing_defaults_states_the_config():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Defaults that differ from ms-swift", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| `")]
    cfg, checked = defaults(), []
    for setting, swift, ours, why in rows:
        assert swift and why, setting
        fields = re.findall(r"`([^`]+)`", setting)
        if not all("." in f for f in fields):  # a behaviour, not a field (logging_steps)
            continue
        values = re.findall(r"`([^`]+)`", ours)
        assert len(values) == len(fields), setting
        for name, shown in zip(fields, values):
            section_name, key = name.split(".")
            assert key in FIELDS[section_name], name
            assert tomllib.loads(f"v = {shown}")["v"] == value(cfg, name), name
            assert name not in ALIGNED, name
            checked.append(name)
    assert len(checked) >= 10


async def test_weight_decay_skips_biases_and_norm_weights_as_transformers(model_dir, tmp_path):
    learner = new_learner(model_dir, tmp_path / "run", "learner.weight_decay=0.1")
    await learner.start(StageCtx())
    try:
        names = {id(p): n for n, p in learner.trainer.model.named_parameters()}
        decayed, plain = learner.trainer.optimizer.param_groups
        assert (decayed["weight_decay"], plain["weight_decay"]) == (0.1, 0.0)
        assert decayed["params"] and all(p.ndim == 2 for p in decayed["params"])
        assert any("norm" in names[id(p)] for p in plain["params"]) and all(p.ndim == 1 for p in plain["params"])
        assert len(decayed["params"]) + len(plain["params"]) == sum(1 for _ in learner.trainer.model.parameters())
    finally:
        await learner.close()
