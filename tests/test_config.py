"""Config: TOML + --set overrides -> validated structs, ms-swift batch derivations, helpful errors."""

from __future__ import annotations

import ast
import inspect
import math
import tomllib
import typing
from datetime import datetime
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import config.schema as config_schema
from config import (
    SECTIONS,
    Config,
    ConfigError,
    GrpoConfig,
    config_from_dict,
    derive_batch_sizes,
    format_config,
    load_config,
    nearest_multiples,
    parse_override,
    replace,
    resolve_output_dir,
    resolved,
)
from config.render import toml_value

REPO = Path(__file__).resolve().parents[1]
REWARD = 'reward.reward_funcs=["accuracy"]'


def cfg_with(*overrides: str) -> Config:
    """Defaults plus one reward (a reward source is required) plus ``overrides``."""
    return load_config(None, [REWARD, *overrides])


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        cfg_with(*overrides)
    message = str(info.value)
    assert "\n" not in message  # one paragraph
    return message


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


# --- the shipped configs --------------------------------------------------------------------------


def test_demo_toml_loads_with_its_derived_batch_sizes():
    cfg = load_config(REPO / "configs" / "demo.toml")
    g = cfg.grpo
    assert (g.num_generations, g.generation_batch_size, g.per_device_train_batch_size) == (8, 64, 16)
    assert g.steps_per_generation == 4
    assert g.prompt_batch_size == 8
    assert g.gradient_accumulation_steps == 1
    assert g.max_completion_length == 16 and g.temperature == 1.0 and g.beta == 0.04
    assert g.max_staleness == 1 and g.drop_last is True
    assert cfg.reward.reward_funcs == ["accuracy", "format"]
    assert cfg.reward.reward_weights == [1.0, 0.2]
    assert cfg.learner.learning_rate == 1e-4
    assert (cfg.run.name, cfg.run.max_steps, cfg.transport.kind) == ("demo", 400, "memory")
    assert (cfg.model.model, cfg.data.dataset) == ("tiny", "arithmetic")


def test_demo_redis_toml_is_the_demo_over_redis():
    demo = load_config(REPO / "configs" / "demo.toml")
    redis = load_config(REPO / "configs" / "demo-redis.toml")
    assert (redis.transport.kind, redis.run.name) == ("redis", "demo-redis")
    assert redis.transport.url.startswith("redis://")
    assert (redis.grpo, redis.reward, redis.learner, redis.model, redis.data) == (
        demo.grpo,
        demo.reward,
        demo.learner,
        demo.model,
        demo.data,
    )


def test_defaults_plus_a_reward_source():
    cfg = cfg_with()
    g = cfg.grpo
    assert (g.num_generations, g.num_iterations, g.beta, g.epsilon, g.epsilon_high) == (8, 1, 0.04, 0.2, None)
    assert (g.loss_type, g.scale_rewards, g.truncation_strategy, g.kl_in_reward) == (
        "grpo",
        "group",
        "left",
        False,
    )
    assert (g.temperature, g.top_p, g.top_k, g.repetition_penalty) == (1.0, 1.0, -1, 1.0)
    # generation_batch_size unset: per_device 8 * world 1 * steps_per_generation (= grad accum 1)
    assert (g.generation_batch_size, g.steps_per_generation, g.gradient_accumulation_steps) == (8, 1, 1)
    assert g.prompt_batch_size == 1
    assert cfg.reward.reward_weights == [1.0]
    assert (cfg.run.seed, cfg.run.max_steps, cfg.run.output_dir, cfg.run.metrics_port) == (42, 0, "", 0)
    assert (cfg.transport.kind, cfg.transport.max_deliveries) == ("memory", 5)
    assert (cfg.learner.learning_rate, cfg.learner.lr_scheduler_type, cfg.learner.ref_model) == (
        1e-5,
        "cosine",
        None,
    )
    # ms-swift's optimizer defaults (RLHFArguments / TrainArgumentsMixin); lr 1e-4 under LoRA
    assert (cfg.learner.weight_decay, cfg.learner.adam_beta1, cfg.learner.adam_beta2) == (0.1, 0.9, 0.95)
    assert cfg_with("learner.train_type=lora").learner.learning_rate == 1e-4
    assert (cfg.rollout.weight_load, cfg.rollout.max_concurrent_groups) == ("pause", 16)
    assert (cfg.data.num_train_epochs, cfg.data.data_seed, cfg.data.columns) == (1, None, {})


# --- batch sizes ----------------------------------------------------------------------------------


def test_generation_batch_size_takes_precedence():
    g = cfg_with(
        "grpo.generation_batch_size=96",
        "grpo.per_device_train_batch_size=4",
        "grpo.world_size=2",
        "grpo.gradient_accumulation_steps=3",
    ).grpo
    assert g.steps_per_generation == 96 // (4 * 2) == 12
    assert g.gradient_accumulation_steps == 3
    assert g.prompt_batch_size == 12


def test_steps_per_generation_defaults_to_gradient_accumulation_steps():
    g = cfg_with(
        "grpo.per_device_train_batch_size=8", "grpo.world_size=2", "grpo.gradient_accumulation_steps=3"
    ).grpo
    assert g.steps_per_generation == 3
    assert g.generation_batch_size == 8 * 2 * 3 == 48
    assert g.prompt_batch_size == 6


def test_explicit_steps_per_generation():
    g = cfg_with("grpo.per_device_train_batch_size=4", "grpo.steps_per_generation=6").grpo
    assert (g.generation_batch_size, g.steps_per_generation, g.gradient_accumulation_steps) == (24, 6, 1)
    assert g.prompt_batch_size == 3


def test_generation_batch_size_and_steps_per_generation_are_exclusive():
    message = error_of("grpo.generation_batch_size=64", "grpo.steps_per_generation=4")
    assert "grpo.generation_batch_size=64 and grpo.steps_per_generation=4 are both set" in message


def test_effective_batch_size_rounds_gradient_accumulation_up():
    g = cfg_with("grpo.per_device_train_batch_size=16", "grpo.effective_batch_size=100").grpo
    assert g.gradient_accumulation_steps == math.ceil(100 / 16) == 7
    assert g.steps_per_generation == 7 and g.generation_batch_size == 112
    g = cfg_with(
        "grpo.per_device_train_batch_size=8", "grpo.world_size=4", "grpo.effective_batch_size=64"
    ).grpo
    assert g.gradient_accumulation_steps == 2


def test_effective_batch_size_and_gradient_accumulation_are_exclusive():
    message = error_of("grpo.effective_batch_size=64", "grpo.gradient_accumulation_steps=2")
    assert "grpo.gradient_accumulation_steps=2 and grpo.effective_batch_size=64 are both set" in message


def test_indivisible_by_num_generations_shows_the_nearest_valid_values():
    message = error_of("grpo.generation_batch_size=60", "grpo.num_generations=8")
    assert (
        "grpo.generation_batch_size=60 must be divisible by num_generations=8; nearest valid: 56 or 64"
        in message
    )


def test_indivisible_by_the_mini_batch_shows_the_nearest_valid_values():
    message = error_of("grpo.generation_batch_size=72", "grpo.per_device_train_batch_size=16")
    assert (
        "grpo.generation_batch_size=72 must be divisible by per_device_train_batch_size * world_size"
        in message
    )
    assert "= 16; nearest valid: 64 or 80" in message


def test_nearest_valid_values_satisfy_both_divisors():
    # 60 is neither a multiple of 8 nor of 16: the suggestions are multiples of lcm(8, 16) = 16.
    message = error_of("grpo.generation_batch_size=60", "grpo.per_device_train_batch_size=16")
    assert "nearest valid: 48 or 64" in message


def test_a_derived_generation_batch_size_is_checked_too():
    message = error_of("grpo.per_device_train_batch_size=4", "grpo.steps_per_generation=3")
    assert (
        "grpo.generation_batch_size=12 (= per_device_train_batch_size * world_size * steps_per_generation"
        in message
    )
    assert "num_generations=8; nearest valid: 8 or 16" in message


def test_below_the_smallest_valid_value_suggests_only_that():
    message = error_of("grpo.generation_batch_size=4")
    assert message.endswith("nearest valid: 8 (whole prompt groups per batch)")


@given(
    num_generations=st.integers(1, 32),
    per_device=st.integers(1, 32),
    world_size=st.integers(1, 8),
    multiple=st.integers(1, 16),
    grad_accum=st.none() | st.integers(1, 8),
)
def test_valid_generation_batch_sizes_derive_consistently(
    num_generations, per_device, world_size, multiple, grad_accum
):
    mini_batch = per_device * world_size
    gbs = math.lcm(num_generations, mini_batch) * multiple
    sizes = derive_batch_sizes(
        num_generations=num_generations,
        per_device_train_batch_size=per_device,
        world_size=world_size,
        generation_batch_size=gbs,
        gradient_accumulation_steps=grad_accum,
    )
    assert sizes.generation_batch_size == gbs
    assert sizes.steps_per_generation * mini_batch == gbs
    assert sizes.prompt_batch_size * num_generations == gbs
    assert sizes.gradient_accumulation_steps == (grad_accum or 1)


@given(
    num_generations=st.integers(1, 16),
    per_device=st.integers(1, 16),
    world_size=st.integers(1, 4),
    steps=st.none() | st.integers(1, 8),
    grad_accum=st.integers(1, 8),
)
def test_without_generation_batch_size_it_is_a_whole_number_of_mini_batches(
    num_generations, per_device, world_size, steps, grad_accum
):
    kwargs = {
        "num_generations": num_generations,
        "per_device_train_batch_size": per_device,
        "world_size": world_size,
    }
    expected_steps = steps if steps is not None else grad_accum
    gbs = per_device * world_size * expected_steps
    if gbs % num_generations:
        with pytest.raises(ConfigError, match="nearest valid"):
            derive_batch_sizes(**kwargs, steps_per_generation=steps, gradient_accumulation_steps=grad_accum)
        return
    sizes = derive_batch_sizes(**kwargs, steps_per_generation=steps, gradient_accumulation_steps=grad_accum)
    assert (sizes.generation_batch_size, sizes.steps_per_generation) == (gbs, expected_steps)
    assert sizes.prompt_batch_size == gbs // num_generations


@given(per_device=st.integers(1, 64), world_size=st.integers(1, 8), effective=st.integers(1, 4096))
def test_effective_batch_size_is_covered_by_the_fewest_mini_batches(per_device, world_size, effective):
    mini_batch = per_device * world_size
    sizes = derive_batch_sizes(
        num_generations=1,
        per_device_train_batch_size=per_device,
        world_size=world_size,
        effective_batch_size=effective,
    )
    steps = sizes.gradient_accumulation_steps
    assert (steps - 1) * mini_batch < effective <= steps * mini_batch


@given(
    num_generations=st.integers(1, 32),
    per_device=st.integers(1, 32),
    gbs=st.integers(1, 2048),
)
def test_every_invalid_generation_batch_size_names_valid_neighbours(num_generations, per_device, gbs):
    step = math.lcm(num_generations, per_device)
    kwargs = {
        "num_generations": num_generations,
        "per_device_train_batch_size": per_device,
        "generation_batch_size": gbs,
    }
    if gbs % step == 0:
        assert derive_batch_sizes(**kwargs).generation_batch_size == gbs
        return
    with pytest.raises(ConfigError) as info:
        derive_batch_sizes(**kwargs)
    suggested = str(info.value).split("nearest valid: ")[1].split(" (")[0].split(" or ")
    for value in map(int, suggested):
        assert derive_batch_sizes(**{**kwargs, "generation_batch_size": value}).generation_batch_size == value
        assert abs(value - gbs) < step


@given(value=st.integers(1, 10_000), step=st.integers(1, 500))
def test_nearest_multiples_bracket_the_value(value, step):
    found = nearest_multiples(value, step)
    assert all(m > 0 and m % step == 0 for m in found)
    if value % step == 0:
        assert found == [value]
    else:
        assert found[-1] - step < value < found[-1]
        assert len(found) == (2 if value > step else 1)


# --- unknown keys, types, ranges, choices ---------------------------------------------------------


def test_unknown_key_suggests_the_closest_one(tmp_path):
    path = write(tmp_path, '[grpo]\nnum_generation = 8\n[reward]\nreward_funcs = ["accuracy"]\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "unknown key grpo.num_generation; did you mean num_generations?" in str(info.value)
    assert str(path) in str(info.value)


def test_unknown_key_in_an_override_suggests_the_closest_one():
    message = error_of("grpo.num_generation=8")
    assert "grpo.num_generation" in message and "did you mean num_generations?" in message


def test_a_key_in_the_wrong_section_points_to_its_home():
    assert "did you mean learner.learning_rate?" in error_of("grpo.learning_rate=1e-5")


def test_an_unknown_key_without_a_close_match_lists_the_valid_ones():
    message = error_of("transport.zzz=1")
    assert "unknown key transport.zzz; valid keys in [transport]: kind, url," in message


def test_section_typo_suggests_the_section(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[gpro\]; did you mean \[grpo\]\?"):
        load_config(write(tmp_path, "[gpro]\nbeta = 0.1\n"))
    assert "did you mean [learner]?" in error_of("lerner.learning_rate=1e-5")


def test_a_setting_outside_any_section_points_to_its_section(tmp_path):
    # (ms-swift's names are taken at the top level, tests/test_swift_args.py; rollstream's own are not)
    with pytest.raises(ConfigError, match=r"did you mean grpo\.max_staleness\?"):
        load_config(write(tmp_path, "max_staleness = 1\n"))


@pytest.mark.parametrize("key", ["prompt_batch_size", "drop_last"])
def test_derived_values_cannot_be_set(key):
    message = error_of(f"grpo.{key}=4")
    assert f"grpo.{key} is" in message and ("derived" in message or "always true" in message)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("grpo.num_generations=abc", "grpo.num_generations: expected int, got str ('abc')"),
        ("grpo.num_generations=8.0", "grpo.num_generations: expected int, got float"),
        ("grpo.num_generations=true", "grpo.num_generations: expected int, got bool"),
        ("grpo.beta=high", "grpo.beta: expected float, got str"),
        ("grpo.generation_batch_size=[64]", "grpo.generation_batch_size: expected int | none, got list"),
        ("run.ledger=1", "run.ledger: expected bool, got int"),
        ('reward.reward_weights=[1.0, "x"]', "reward.reward_weights[1]: expected float, got str"),
        ("reward.reward_funcs=accuracy", "reward.reward_funcs: expected list, got str"),
        ('data.columns={query = "prompt", answer = 1}', "data.columns.answer: expected str, got int"),
    ],
)
def test_type_errors_name_the_field(override, expected):
    assert expected in error_of(override)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("grpo.max_staleness=-1", "grpo.max_staleness=-1 is out of range; valid range: max_staleness >= 0"),
        (
            "grpo.num_generations=0",
            "grpo.num_generations=0 is out of range; valid range: num_generations >= 1",
        ),
        ("grpo.top_p=1.5", "grpo.top_p=1.5 is out of range; valid range: top_p > 0 and top_p <= 1"),
        (
            "learner.learning_rate=0",
            "learner.learning_rate=0 is out of range; valid range: learning_rate > 0",
        ),
        ("learner.adam_beta2=1.0", "valid range: adam_beta2 >= 0 and adam_beta2 < 1"),
        ("transport.max_deliveries=0", "transport.max_deliveries=0 is out of range"),
        ("run.metrics_port=70000", "valid range: metrics_port >= 0 and metrics_port <= 65535"),
        ("data.num_train_epochs=0", "data.num_train_epochs=0 is out of range"),
        ("grpo.generation_batch_size=0", "grpo.generation_batch_size=0 is out of range"),
    ],
)
def test_range_errors_name_the_field_and_its_range(override, expected):
    assert expected in error_of(override)


@pytest.mark.parametrize("strategy", ["left", "delete"])
def test_truncation_strategy_accepts_left_and_delete(strategy):
    assert cfg_with(f"grpo.truncation_strategy={strategy}").grpo.truncation_strategy == strategy


@pytest.mark.parametrize("strategy", ["right", "split", "none_"])
def test_truncation_strategy_rejects_the_rest(strategy):
    assert f"grpo.truncation_strategy='{strategy}' is not one of left, delete" in error_of(
        f"grpo.truncation_strategy={strategy}"
    )


def test_choice_typos_are_suggested():
    assert "did you mean dr_grpo?" in error_of("grpo.loss_type=dr-grpo")
    assert "is not one of grpo, bnpo, dr_grpo, dapo, cispo, sapo" in error_of("grpo.loss_type=ppo")
    assert "is not one of group, batch, none, gdpo" in error_of("grpo.scale_rewards=global")
    assert "transport.kind='kafka' is not one of memory, redis" in error_of("transport.kind=kafka")


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
def test_loss_types(loss_type):
    assert cfg_with(f"grpo.loss_type={loss_type}").grpo.loss_type == loss_type


def test_msgspec_itself_rejects_unknown_fields():
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"num_generation": 8}, GrpoConfig)


# --- cross-field rules ----------------------------------------------------------------------------


def test_greedy_sampling_with_groups_is_rejected():
    message = error_of("grpo.temperature=0")
    assert "grpo.temperature=0 with grpo.num_generations=8" in message and "advantage is zero" in message
    assert cfg_with("grpo.temperature=0", "grpo.num_generations=1").grpo.temperature == 0


def test_a_reward_source_is_required():
    with pytest.raises(ConfigError, match="no reward source: set reward.reward_funcs"):
        load_config(None)
    cfg = load_config(None, ["reward.reward_model=/models/rm"])
    assert cfg.reward.reward_weights == [1.0]


def test_reward_weights_default_to_one_each():
    assert cfg_with('reward.reward_funcs=["accuracy", "format"]').reward.reward_weights == [1.0, 1.0]


def test_reward_weights_must_match_the_rewards():
    message = error_of('reward.reward_funcs=["accuracy", "format"]', "reward.reward_weights=[1.0]")
    assert "reward.reward_weights=[1.0] must hold one weight per reward, 2 (accuracy, format)" in message
    assert "holds 1" in message
    # a reward model is one more reward (as ms-swift)
    cfg = cfg_with("reward.reward_model=rm", "reward.reward_weights=[1.0, 0.5]")
    assert cfg.reward.reward_weights == [1.0, 0.5]
    assert "2 (accuracy, reward_model 'rm')" in error_of(
        "reward.reward_model=rm", "reward.reward_weights=[1.0]"
    )


def test_reward_funcs_are_named_once():
    assert "must name each reward once" in error_of('reward.reward_funcs=["accuracy", "accuracy"]')


def test_run_name_and_transport_url_are_checked():
    assert "run.name='a:b' may hold only" in error_of("run.name=a:b")
    assert "transport.url='http://h' must start with redis://" in error_of("transport.url=http://h")
    cfg = cfg_with("transport.kind=redis", "transport.url=rediss://user:pw@h:6380/1")
    assert cfg.transport.url == "rediss://user:pw@h:6380/1"


# --- overrides ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reward.reward_weights=[1.0, 0.5]", ("reward", "reward_weights", [1.0, 0.5])),
        ("run.name=my-run", ("run", "name", "my-run")),
        ("grpo.num_generations=16", ("grpo", "num_generations", 16)),
        ("learner.learning_rate=1e-5", ("learner", "learning_rate", 1e-5)),
        ("grpo.kl_in_reward=true", ("grpo", "kl_in_reward", True)),
        ('run.name="quoted name"', ("run", "name", "quoted name")),
        ("data.columns.query=prompt", ("data", "columns.query", "prompt")),
        ('data.columns={query = "prompt"}', ("data", "columns", {"query": "prompt"})),
        (" grpo.beta = 0.1 ", ("grpo", "beta", 0.1)),
        ("transport.url=redis://h:6379/0", ("transport", "url", "redis://h:6379/0")),
        ("run.output_dir=", ("run", "output_dir", "")),
        ("grpo.generation_batch_size=none", ("grpo", "generation_batch_size", None)),
        ('data.system="none"', ("data", "system", "none")),
        ("data.system=1\nx = 2", ("data", "system", "1\nx = 2")),  # one value, never two keys
        ("grpo.beta=0.1 # KL", ("grpo", "beta", 0.1)),
    ],
)
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["grpo", "grpo=1", "=1", "grpo.=1", ".beta=1", "grpo.be ta=1"])
def test_malformed_overrides(text):
    with pytest.raises(ConfigError, match="expected section.key=value"):
        parse_override(text)


@given(st.integers() | st.booleans() | st.lists(st.floats(allow_nan=False)) | st.text(max_size=40))
def test_override_values_round_trip_through_toml(value):
    assert parse_override(f"s.k={toml_value(value)}") == ("s", "k", value)


def test_overrides_apply_in_order_over_the_file(tmp_path):
    path = write(tmp_path, '[grpo]\nbeta = 0.1\n[reward]\nreward_funcs = ["accuracy"]\n')
    assert load_config(path).grpo.beta == 0.1
    assert load_config(path, ["grpo.beta=0.2", "grpo.beta=0.3"]).grpo.beta == 0.3


def test_a_bare_number_for_a_string_field_is_the_string():
    assert cfg_with("run.name=2024").run.name == "2024"
    assert cfg_with("data.system=true").data.system == "true"


def test_none_unsets_an_optional_field(tmp_path):
    path = write(tmp_path, '[grpo]\ngeneration_batch_size = 64\n[reward]\nreward_funcs = ["accuracy"]\n')
    cfg = load_config(path, ["grpo.generation_batch_size=none", "grpo.steps_per_generation=2"])
    assert (cfg.grpo.generation_batch_size, cfg.grpo.steps_per_generation) == (16, 2)
    assert cfg_with("data.system=none").data.system is None
    assert cfg_with('data.system="none"').data.system == "none"


def test_a_nested_override_sets_one_entry_of_a_table(tmp_path):
    path = write(tmp_path, '[data]\ncolumns = {answer = "solution"}\n[reward]\nreward_funcs = ["accuracy"]\n')
    cfg = load_config(path, ["data.columns.query=prompt"])
    assert cfg.data.columns == {"answer": "solution", "query": "prompt"}
    assert load_config(path, ['data.columns={query = "q"}']).data.columns == {"query": "q"}
    assert "grpo.beta has no key x" in error_of("grpo.beta.x=1")


# --- files ----------------------------------------------------------------------------------------


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[grpo\n"))
    with pytest.raises(ConfigError, match=r"grpo must be a table"):
        load_config(write(tmp_path, "grpo = 1\n"))


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- resolved, format, replace, output dir --------------------------------------------------------


def test_resolved_holds_every_section_and_the_derived_values():
    data = resolved(load_config(REPO / "configs" / "demo.toml"))
    assert (
        list(data)
        == list(SECTIONS)
        == ["run", "model", "data", "grpo", "rollout", "reward", "learner", "eval", "transport"]
    )
    g = data["grpo"]
    assert (g["generation_batch_size"], g["steps_per_generation"], g["prompt_batch_size"]) == (64, 4, 8)
    assert (g["gradient_accumulation_steps"], g["max_staleness"], g["drop_last"]) == (1, 1, True)
    assert data["reward"]["reward_weights"] == [1.0, 0.2]
    assert data["transport"]["kind"] == "memory"


def test_format_config_shows_derived_values_and_loads_back():
    cfg = load_config(REPO / "configs" / "demo.toml")
    text = format_config(cfg)
    assert "[grpo]\n" in text and "generation_batch_size = 64\n" in text
    assert "# steps_per_generation = 4  (derived: " in text
    assert "# prompt_batch_size = 8  (derived: " in text
    assert "reward_weights = [1.0, 0.2]\n" in text
    assert config_from_dict(tomllib.loads(text)) == cfg


@given(
    num_generations=st.sampled_from([1, 2, 4, 8]),
    per_device=st.sampled_from([1, 2, 4, 8, 16]),
    steps=st.none() | st.integers(1, 4),
    effective=st.none() | st.integers(1, 64),
    system=st.none() | st.text(max_size=30),
    weights=st.none() | st.lists(st.floats(-10, 10), min_size=2, max_size=2),
)
def test_format_config_round_trips(num_generations, per_device, steps, effective, system, weights):
    data = {
        "grpo": {
            "num_generations": num_generations,
            "per_device_train_batch_size": per_device,
            "steps_per_generation": steps,
            "effective_batch_size": effective,
        },
        "data": {"system": system},
        "reward": {"reward_funcs": ["accuracy", "format"], "reward_weights": weights},
    }
    try:
        cfg = config_from_dict(data)
    except ConfigError:
        return  # an indivisible combination; covered above
    assert config_from_dict(tomllib.loads(format_config(cfg))) == cfg


def test_replace_derives_again_and_leaves_the_original_alone():
    cfg = load_config(REPO / "configs" / "demo.toml")
    smaller = replace(cfg, "grpo", num_generations=4)
    assert (smaller.grpo.prompt_batch_size, smaller.grpo.steps_per_generation) == (16, 4)
    assert cfg.grpo.prompt_batch_size == 8
    wider = replace(cfg, "grpo", per_device_train_batch_size=32)
    assert wider.grpo.steps_per_generation == 2  # generation_batch_size was given, so it stays 64
    assert replace(cfg, "run", name="other").run.name == "other"
    with pytest.raises(ConfigError, match="did you mean num_generations"):
        replace(cfg, "grpo", num_generation=4)


def test_replace_keeps_what_was_derived_derived():
    cfg = cfg_with("grpo.per_device_train_batch_size=4", "grpo.steps_per_generation=4")
    assert cfg.grpo.generation_batch_size == 16
    # generation_batch_size was derived from steps_per_generation, so it follows the new mini-batch
    assert replace(cfg, "grpo", per_device_train_batch_size=8).grpo.generation_batch_size == 32
    more = replace(cfg, "reward", reward_funcs=["accuracy", "format"])
    assert more.reward.reward_weights == [1.0, 1.0]


def test_sections_are_mutable_for_the_cli():
    cfg = cfg_with()
    cfg.run.metrics_port = 9100
    assert cfg.run.metrics_port == 9100


def test_resolve_output_dir():
    cfg = cfg_with("run.name=exp")
    assert resolve_output_dir(cfg, now=datetime(2025, 1, 2, 3, 4, 5)) == Path("runs/exp-20250102-030405")
    assert cfg.run.output_dir == ""  # resolved by the helper, never at parse time
    assert resolve_output_dir(cfg_with("run.output_dir=/tmp/out")) == Path("/tmp/out")


def test_every_field_has_a_docstring():
    tree = ast.parse(inspect.getsource(config_schema))
    names = {cls.__name__ for cls in SECTIONS.values()}
    checked = 0
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in names:
            body = node.body
            for stmt, after in zip(body, body[1:] + [None]):
                if isinstance(stmt, ast.AnnAssign):
                    checked += 1
                    assert (
                        isinstance(after, ast.Expr)
                        and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)
                    ), f"{node.name}.{stmt.target.id} has no docstring"
    assert checked == sum(len(msgspec.structs.fields(cls)) for cls in SECTIONS.values())


@pytest.mark.parametrize("overrides", [
    [],  # every derived value from the defaults
    ["learner.train_type=lora", "rollout.gym_env=gym_env_plugin", "grpo.advantage_estimator=rloo"],
    ["data.val_dataset=x.jsonl", "grpo.advantage_estimator=reinforce_plus_plus"],
])
def test_derived_fields_are_typed_without_none_and_never_empty_once_loaded(overrides):
    """The fields loading derives are declared with their own type (not `| None`): a loaded Config holds a
    value of that type in each, whatever derived it."""
    cfg = cfg_with(*overrides)
    for dotted in config_schema.DERIVED_FIELDS:
        section, name = dotted.split(".")
        type_ = config_schema.FIELDS[section][name]
        assert type(None) not in typing.get_args(type_) and type_ is not type(None), dotted
        assert dotted in config_schema.FORMULAS, f"{dotted}: derived, but the reference would not say how"
        value = getattr(getattr(cfg, section), name)
        assert value is not None, dotted
        assert msgspec.convert(value, type_) == value, dotted
    given = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in msgspec.structs.fields(cls)
             if f.default is None and type(None) not in typing.get_args(f.type)}
    assert given == config_schema.DERIVED_FIELDS  # a None default on a non-optional type is a derived field


def test_evaluation_rules_are_the_configs():
    """Evaluation of multi-turn rollouts, and evaluation by a separate engine over broadcast servers, are
    refused when the config loads (not when the evaluate stage is built)."""
    held_out = "data.split_dataset_ratio=0.1"
    with pytest.raises(ConfigError, match="rollout.multi_turn_scheduler='calculator_tool' is not evaluated yet"):
        cfg_with(held_out, "rollout.multi_turn_scheduler=calculator_tool")
    assert cfg_with("rollout.multi_turn_scheduler=calculator_tool").eval.eval_strategy == "no"  # no held-out data
    servers = ["rollout.engine=server", 'rollout.server_urls=["http://127.0.0.1:8000"]',
               "rollout.weight_transport=broadcast", held_out]
    with pytest.raises(ConfigError, match="without knowing which version they hold; set eval.share_rollout_engine"):
        cfg_with(*servers)
    assert cfg_with(*servers, "eval.share_rollout_engine=true").eval.eval_strategy == "steps"
    assert cfg_with(*servers, "eval.eval_strategy=no").eval.eval_strategy == "no"


def test_former_weight_setting_names_are_aliases_of_the_new_ones(tmp_path):
    """rollout.weight_sync_mode and rollout.weight_sync (#37) are still accepted, in a TOML file, a dict and
    --set, as rollout.weight_transport and rollout.weight_load; both names with different values is an error
    naming the two; `config show` writes the new names."""
    old = tmp_path / "old.toml"
    old.write_text('[reward]\nreward_funcs = ["accuracy"]\n[rollout]\nweight_sync_mode = "broadcast"\n'
                   'weight_sync = "drain"\n')
    cfg = load_config(old)
    assert (cfg.rollout.weight_transport, cfg.rollout.weight_load) == ("broadcast", "drain")
    cfg = cfg_with("rollout.weight_sync_mode=broadcast", "rollout.weight_sync=in_flight")
    assert (cfg.rollout.weight_transport, cfg.rollout.weight_load) == ("broadcast", "in_flight")
    cfg = load_config(old, ["rollout.weight_transport=file", "rollout.weight_load=pause"])  # --set wins, new over old
    assert (cfg.rollout.weight_transport, cfg.rollout.weight_load) == ("file", "pause")
    cfg = config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "rollout": {"weight_sync_mode": "broadcast"}})
    assert cfg.rollout.weight_transport == "broadcast"
    same = config_from_dict({"reward": {"reward_funcs": ["accuracy"]},
                             "rollout": {"weight_sync_mode": "broadcast", "weight_transport": "broadcast"}})
    assert same.rollout.weight_transport == "broadcast"
    text = format_config(load_config(old))
    assert 'weight_transport = "broadcast"' in text and 'weight_load = "drain"' in text
    assert "weight_sync_mode" not in text and "weight_sync =" not in text
    both = tmp_path / "both.toml"
    both.write_text('[reward]\nreward_funcs = ["accuracy"]\n[rollout]\nweight_sync_mode = "broadcast"\n'
                    'weight_transport = "file"\n')
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync_mode = 'broadcast' and rollout\.weight_transport "
                                          r"= 'file': rollout\.weight_sync_mode is the former name of "
                                          r"rollout\.weight_transport"):
        load_config(both)
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync = 'drain' and rollout\.weight_load = 'pause'"):
        config_from_dict({"reward": {"reward_funcs": ["accuracy"]},
                          "rollout": {"weight_sync": "drain", "weight_load": "pause"}})
