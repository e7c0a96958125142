"""TRL's GRPOConfig names (issue 39): the table (config/trl_args.py) covers every field of trl 1.16.0's
GRPOConfig, ``rollstream config from-trl`` carries a saved GRPOConfig over with TRL's defaults and refuses to
write a run that would train something else, TRL-only names work in a TOML / as flags / with --set, TRL's
importance-sampling correction is computed as TRL computes it, and metrics.jsonl carries TRL's metric names."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from config import ConfigError, config_from_dict, load_config, swift_args, trl_args
from grpo.loss import policy_loss
from grpo.stats import TRL_METRIC_ALIASES
from rollstream.cli import main

ROOT = Path(__file__).resolve().parents[1]
# GRPOConfig(**KWARGS).to_json_string() by the real trl 1.16.0 (tests/data_trl/make_grpo_config.py)
SAVED = ROOT / "tests" / "data_trl" / "grpo_config.json"
F64 = torch.float64


def nested(values):
    out = {}
    for dotted, value in values.items():
        section, field = dotted.split(".")
        out.setdefault(section, {})[field] = value
    return out


def converted(data, reward_funcs=("accuracy",)):
    """The Config from_trl makes of ``data`` (the reward functions are GRPOTrainer's, not GRPOConfig's)."""
    conv = trl_args.from_trl(data)
    config = nested(conv.values)
    config.setdefault("reward", {})["reward_funcs"] = list(reward_funcs)
    return conv, config_from_dict(config)


# ----------------------------------------------------------------------------- the table


def test_the_table_holds_every_field_of_a_saved_grpo_config_once():
    saved = json.loads(SAVED.read_text())
    assert list(trl_args.table()) == list(saved)  # every field, in the dataclass's order
    counts = trl_args.counts()
    assert sum(counts.values()) == len(saved) == 189
    assert counts[swift_args.ACCEPTED] > 30 and counts[swift_args.MAPPED] > 25 and counts[swift_args.REFUSED] > 20
    for arg in trl_args.table().values():
        assert arg.kind in swift_args.KINDS
        assert arg.why or arg.kind == swift_args.ACCEPTED, arg.name  # every refusal and mapping says why / how
        if arg.kind in (swift_args.ACCEPTED, swift_args.MAPPED):
            assert arg.targets, arg.name
        else:
            assert trl_args.translate(arg.name, arg.default) == {}, arg.name  # TRL's default asks for nothing


def test_the_page_is_generated_from_the_table():
    page = (ROOT / "docs" / "trl-arguments.md").read_text()
    assert page == trl_args.render_markdown(), "regenerate: .venv/bin/python -m config.trl_args > docs/trl-arguments.md"
    assert "trl-arguments.md" in (ROOT / "mkdocs.yml").read_text()
    assert "docs/trl-arguments.md" in (ROOT / "README.md").read_text()


def test_the_declared_defaults_are_trls_when_trl_is_installed():
    trl = pytest.importorskip("trl")  # the bench extra; the saved file above is its output either way
    assert trl.__version__ == trl_args.TRL_VERSION
    fields = dataclasses.fields(trl.GRPOConfig)
    assert {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in fields} == (
        trl_args._DEFAULTS)
    import runpy

    from transformers.utils import logging as hf_logging

    kwargs = runpy.run_path(str(SAVED.with_name("make_grpo_config.py")))["KWARGS"]
    # TrainingArguments derives disable_tqdm from the transformers logger's level, which tests run before this
    # one (vLLM, the engines) raise to error; the saved file was made at its default level (warning).
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    try:
        made = json.loads(trl.GRPOConfig(**kwargs).to_json_string())
    finally:
        hf_logging.set_verbosity(level)
    assert made == json.loads(SAVED.read_text())


# ----------------------------------------------------------------------------- from-trl


def test_a_saved_grpo_config_carries_over_field_by_field():
    conv, cfg = converted(json.loads(SAVED.read_text()))
    assert conv.changes == [] and conv.refused == [] and conv.unknown == []
    g, lr = cfg.grpo, cfg.learner
    # what the file set
    assert (g.num_generations, g.per_device_train_batch_size, g.steps_per_generation) == (4, 4, 2)
    assert g.generation_batch_size == 8 and g.gradient_accumulation_steps == 2
    assert (g.beta, g.loss_type, g.epsilon_high, g.temperature, g.top_k) == (0.04, "grpo", 0.28, 0.7, 20)
    assert (g.scale_rewards, g.overlong_filter, g.tau_pos, g.off_policy_sequence_mask_delta) == ("none", True, 2.0, 0.5)
    assert g.max_completion_length == 256 and cfg.run.seed == 7 and cfg.run.max_steps == 100
    assert g.rollout_importance_sampling_mode == "token_truncate"
    assert g.rollout_importance_sampling_threshold == 2.5 and g.rollout_importance_sampling_convention == "trl"
    assert lr.learning_rate == 3e-6 and lr.warmup_ratio == pytest.approx(0.1)  # 10 of 100 steps
    assert lr.device == "cpu"
    # TRL's defaults where they differ from rollstream's
    assert (lr.lr_scheduler_type, lr.weight_decay, lr.adam_beta2) == ("linear", 0.0, 0.999)
    assert cfg.data.num_train_epochs == 3 and cfg.eval.per_device_eval_batch_size == 8
    assert g.use_bias_correction_kl is True and g.max_staleness == 0
    assert cfg.run.output_dir == ""  # TRL's own directory is not carried (rollstream's default: runs/<name>-<time>)


def test_fields_left_out_take_trls_defaults_with_its_importance_sampling_correction():
    conv, cfg = converted({"bf16": False, "beta": 0.01})
    g = cfg.grpo
    assert len(conv.defaults) == 187
    assert (g.beta, g.loss_type, g.temperature, g.top_k, g.scale_rewards) == (0.01, "dapo", 1.0, 0, "group")
    assert cfg.learner.learning_rate == 1e-6
    # TRL's default: vllm_importance_sampling_correction on, sequence_mask, C_max 3.0, TRL's convention
    assert (g.rollout_importance_sampling_mode, g.rollout_importance_sampling_threshold) == ("sequence_mask", 3.0)
    assert g.rollout_importance_sampling_convention == "trl"
    _, off = converted({"bf16": False, "vllm_importance_sampling_correction": False})
    assert off.grpo.rollout_importance_sampling_mode is None


def test_a_saved_multi_process_run_keeps_its_global_mini_batch_and_says_so():
    saved = json.loads(SAVED.read_text())
    saved["generation_batch_size"] = 32  # 4 per device x 2 steps x 4 processes
    conv, cfg = converted(saved)
    assert cfg.grpo.per_device_train_batch_size == 16 and cfg.grpo.generation_batch_size == 32
    assert [name for name, _, _ in conv.changes] == ["world_size"]


@pytest.mark.parametrize("field, value, words", [
    ("loss_type", "vespo", "loss types"),
    ("entropy_coef", 0.01, "entropy bonus"),
    ("bf16", True, "autocast"),
    ("vllm_importance_sampling_clip_min", 0.5, "lower bound"),
    ("generation_kwargs", {"suppress_tokens": [1]}, "sampling keywords"),
    ("num_train_epochs", 0.5, "whole epochs"),
    ("a_field_of_trl_2", 1, "not a field"),
])
def test_a_field_that_would_train_differently_is_a_change(field, value, words):
    saved = json.loads(SAVED.read_text())
    saved[field] = value
    conv = trl_args.from_trl(saved)
    ((name, got, what),) = conv.changes
    assert (name, got) == (field, value) and words in what


def test_a_refused_field_that_changes_nothing_trained_is_listed_not_a_change():
    saved = {**json.loads(SAVED.read_text()), "report_to": ["trackio"], "use_vllm": True,
             "vllm_gpu_memory_utilization": 0.5}
    conv = trl_args.from_trl(saved)
    assert conv.changes == []
    assert {name for name, _, _ in conv.refused} == {"report_to", "vllm_gpu_memory_utilization"}


def test_the_command_writes_nothing_and_exits_3_on_a_change_unless_accepted(tmp_path, capsys):
    source = tmp_path / "grpo_config.json"
    source.write_text(json.dumps({**json.loads(SAVED.read_text()), "bf16": True}))
    out = tmp_path / "run.toml"
    assert main(["config", "from-trl", str(source), "-o", str(out)]) == 3
    assert not out.exists()
    err = capsys.readouterr().err
    assert "changes what trains: 1" in err and "bf16=true" in err and "--accept-changes" in err

    assert main(["config", "from-trl", str(source), "-o", str(out), "--accept-changes"]) == 0
    cfg = load_config(out, ['reward.reward_funcs=["accuracy"]'])
    assert (cfg.grpo.num_generations, cfg.grpo.beta, cfg.grpo.tau_pos, cfg.learner.learning_rate) == (4, 0.04, 2.0, 3e-6)
    assert cfg.grpo.rollout_importance_sampling_convention == "trl" and cfg.grpo.max_staleness == 0


def test_the_command_reads_the_yaml_trl_grpo_takes(tmp_path, capsys):
    source = tmp_path / "grpo.yaml"  # `trl grpo --config grpo.yaml`: the fields it sets, TRL's defaults for the rest
    source.write_text("bf16: false\nnum_generations: 4\nper_device_train_batch_size: 4\nloss_type: bnpo\n"
                      "vllm_importance_sampling_mode: token_mask\n")
    assert main(["config", "from-trl", str(source)]) == 0
    text = capsys.readouterr().out
    cfg = config_from_dict({**tomllib_loads(text), "reward": {"reward_funcs": ["accuracy"]}})
    assert (cfg.grpo.loss_type, cfg.grpo.rollout_importance_sampling_mode) == ("bnpo", "token_mask")
    assert cfg.grpo.rollout_importance_sampling_threshold == 3.0 and cfg.grpo.temperature == 1.0


def tomllib_loads(text):
    import tomllib

    return tomllib.loads(text)


def test_a_file_that_is_not_a_grpo_config_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert main(["config", "from-trl", str(bad)]) == 2
    assert "expected a JSON object of GRPOConfig fields" in capsys.readouterr().err


# ----------------------------------------------------------------------------- names in a TOML, flags, --set


def test_trl_only_names_in_a_toml_as_flags_and_with_set(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('vllm_importance_sampling_mode = "sequence_truncate"\noff_policy_mask_threshold = 0.3\n'
                    '[grpo]\nsapo_temperature_neg = 1.5\n[reward]\nreward_funcs = ["accuracy"]\n')
    cfg = load_config(toml, ["grpo.sapo_temperature_pos=1.25"],
                      swift=trl_args.parse_flags(["--vllm_max_model_length", "1024", "--num_generations", "4"]))
    g = cfg.grpo
    assert (g.rollout_importance_sampling_mode, g.rollout_importance_sampling_threshold) == ("sequence_truncate", 3.0)
    assert g.rollout_importance_sampling_convention == "trl" and g.off_policy_sequence_mask_delta == 0.3
    assert (g.tau_neg, g.tau_pos, g.num_generations, cfg.rollout.max_model_len) == (1.5, 1.25, 4, 1024)
    # A name ms-swift also has means ms-swift's there, with rollstream's defaults for the rest.
    plain = load_config(None, swift=trl_args.parse_flags(["--reward_funcs", "accuracy", "--beta", "0.0"]))
    assert plain.grpo.loss_type == "grpo" and plain.grpo.rollout_importance_sampling_mode is None


@pytest.mark.parametrize("text, words", [
    ("entropy_coef = 0.1", "entropy_coef=0.1 is refused: the entropy bonus is not available"),
    ("vllm_importance_sampling_clip_max = -1.0", "rollout_importance_sampling_threshold"),
    ("sapo_temperatur_pos = 1.0", "did you mean sapo_temperature_pos"),
])
def test_a_refused_or_misspelt_trl_name_is_an_error_naming_it(tmp_path, text, words):
    toml = tmp_path / "c.toml"
    toml.write_text(f'{text}\n[reward]\nreward_funcs = ["accuracy"]\n')
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        load_config(toml)


def test_trl_only_flags_parse_as_ms_swifts_and_refuse_repeats():
    flags = trl_args.parse_flags(["--model", "m", "--use_bias_correction_kl", "--sapo_temperature_pos=2",
                                  "--reward_funcs", "a", "b"])
    assert flags == {"model": "m", "reward_funcs": ["a", "b"], "use_bias_correction_kl": True,
                     "sapo_temperature_pos": 2}
    with pytest.raises(swift_args.SwiftArgError, match="given twice"):
        trl_args.parse_flags(["--entropy_coef", "0", "--entropy_coef", "0"])


# ----------------------------------------------------------------------------- TRL's IS correction, by its formula


def trl_is_weight(old, rollout, mask, mode, cap):
    """grpo_trainer.py (trl 1.16) _generate_and_score_completions: the ratio of the learner's to the engine's
    probability, per token or the product per sequence, clipped (truncate) or zeroed (mask) above C_max."""
    diff = (old - rollout) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True)) if mode.startswith("sequence") else torch.exp(diff)
    ratio = torch.clamp(ratio, max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)
    return ratio.expand_as(old)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_trls_correction_weights_the_policy_term_as_trl_and_leaves_the_kl_alone(mode):
    torch.manual_seed(0)
    logps = (torch.rand(3, 4, dtype=F64) * -2).requires_grad_()
    old = logps.detach() + 0.05 * torch.randn(3, 4, dtype=F64)
    rollout = old - torch.tensor([[0.1, 0.2, 0.3, 0.0], [-0.4, 0.5, 0.0, 0.0], [0.05, 0.05, 0.05, 0.05]], dtype=F64)
    ref = old - 0.1
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    adv = torch.tensor([1.0, -0.5, 0.25], dtype=F64)
    cap = 1.5
    loss, stats = policy_loss(logps, old, ref, adv, mask, loss_type="bnpo", beta=0.04, rollout_logps=rollout,
                              rollout_is_mode=mode, rollout_is_threshold=cap, rollout_is_convention="trl")
    weight = trl_is_weight(old, rollout, mask, mode, cap)
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    policy = -torch.min(ratio * adv[:, None], clipped * adv[:, None])
    x = ref - logps
    kl = torch.exp(x) - x - 1
    expected = ((policy * weight + 0.04 * kl) * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    assert stats["rollout_correction/is_weight_mean"].item() == pytest.approx(((weight * mask).sum() / mask.sum()).item())
    assert stats["rollout_correction/is_weight_min"].item() == pytest.approx(weight[mask > 0].min().item())
    assert stats["rollout_correction/is_weight_max"].item() == pytest.approx(weight[mask > 0].max().item())
    if mode.startswith("sequence"):  # the product of the token ratios, not ms-swift's geometric mean
        swift, _ = policy_loss(logps, old, ref, adv, mask, loss_type="bnpo", beta=0.04, rollout_logps=rollout,
                               rollout_is_mode=mode, rollout_is_threshold=cap)
        assert swift.item() != pytest.approx(loss.item(), rel=1e-6)


def test_bias_corrected_kl_is_the_kl_times_the_ratio():
    logps = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.2, -1.7]], dtype=F64)
    ref = torch.tensor([[-1.1, -2.2]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    adv = torch.zeros(1, dtype=F64)  # the KL term alone
    loss, _ = policy_loss(logps, old, ref, adv, mask, loss_type="bnpo", beta=0.5, use_bias_correction_kl=True)
    x = ref - logps.detach()
    expected = 0.5 * ((torch.exp(x) - x - 1) * torch.exp(logps.detach() - old)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    plain, _ = policy_loss(logps, old, ref, adv, mask, loss_type="bnpo", beta=0.5)
    assert plain.item() == pytest.approx(0.5 * (torch.exp(x) - x - 1).mean().item(), rel=1e-12)


# ----------------------------------------------------------------------------- TRL's metric names


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2):
    return tiny_qwen2  # conftest's one-layer random Qwen2


def test_the_learners_metrics_row_carries_trls_names_with_the_same_values(model_dir, tmp_path):
    import numpy as np

    from pipeline.records import ScoredTrajectory, TrainGroup, Trajectory, pack_f32, pack_i32
    from trainer.trainer import Trainer

    cfg = load_config("configs/demo.toml", [
        f"model.model={model_dir}", "grpo.beta=0", "grpo.num_generations=4", "grpo.generation_batch_size=8",
        "grpo.per_device_train_batch_size=8", "grpo.log_entropy=true",
        "grpo.vllm_importance_sampling_mode=token_truncate",  # TRL's name: its correction, cap 3.0
    ])
    trainer = Trainer(cfg, model_dir, tmp_path, num_batches=10)
    trainer.load()
    trainer.run = "t"
    rng = np.random.default_rng(0)
    records = []
    for i in range(8):
        completion = rng.integers(1, 64, size=int(rng.integers(2, 6)))
        traj = Trajectory(prompt_id=f"p{i // 4}", attempt=0, request_id=f"p{i // 4}/0/{i}", generation_batch=0,
                          prompt_ids=pack_i32(rng.integers(1, 64, size=3)), completion_ids=pack_i32(completion),
                          logprobs=pack_f32(np.full(len(completion), -3.0)), policy_version=0, max_policy_version=0)
        records.append(ScoredTrajectory(trajectory=traj, rewards={"accuracy": float(i % 2)}, reward=float(i % 2)))
    advantages = [1.0, -1.0, 0.5, -0.5, -1.0, 1.5, 0.25, -0.75]
    groups = [TrainGroup(prompt_id=f"p{g}", attempt=0, generation_batch=0, records=records[4 * g : 4 * g + 4],
                         advantages=advantages[4 * g : 4 * g + 4]) for g in (0, 1)]
    (row,) = trainer.train_generation_batch(groups, 0)
    assert set(TRL_METRIC_ALIASES) <= set(row)
    for ours, trls in TRL_METRIC_ALIASES.items():
        assert row[trls] == row[ours], trls
    assert 0.0 < row["sampling/importance_sampling_ratio/mean"] <= 3.0 and math.isfinite(row["entropy"])
    ratio = {k: row[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")}
    assert 0.0 < ratio["min"] <= ratio["mean"] <= ratio["max"] <= 3.0, ratio
