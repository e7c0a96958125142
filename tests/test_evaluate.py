"""Evaluation while training, the pure parts: pass@k, due versions, the eval row, the held-out split,
the config checks, the bad-input errors, metrics and the plot's eval panel."""

from __future__ import annotations

import json
import math

import pytest
from fake_context import FakeContext

from config import ConfigError, load_config
from data import loading
from data.loading import DatasetError, prompt_key, split_dataset
from grpo.stats import eval_row, pass_at_k
from pipeline import metrics
from pipeline.records import ScoredTrajectory, Trajectory, pack_f32, pack_i32
from rollstream import plot
from rollstream import train as graph
from rollstream.evaluate_offline import resolve_weights
from stages.evaluate import eval_seed, is_due


def cfg_with(*overrides):
    return load_config("configs/demo.toml", list(overrides))


# --- pass@k --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 0, 1, 0.0),
        (4, 4, 1, 1.0),
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (4, 2, 1, 0.5),
        (4, 1, 4, 1.0),  # all four drawn: the correct one is among them
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (8, 3, 2, 1 - 10 / 28),  # 1 - C(5,2)/C(8,2)
    ],
)
def test_pass_at_k_matches_hand_worked_cases(n, c, k, expected) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts() -> None:
    for n, c, k in [(4, 1, 5), (4, 5, 1), (4, 1, 0)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_due_versions_are_multiples_of_eval_steps_and_the_final_one() -> None:
    assert [v for v in range(1, 11) if is_due(v, 3)] == [3, 6, 9]
    assert is_due(10, 3, final=True)
    assert not is_due(0, 1)  # version 0 only with eval_on_start


def test_eval_seeds_are_distinct_per_prompt_and_sample() -> None:
    seeds = {eval_seed(42, i, j, 4) for i in range(10) for j in range(4)}
    assert len(seeds) == 40


# --- the row ---------------------------------------------------------------------------------------


def scored(accuracy: float, fmt: float, tokens: int, truncated: bool = False) -> ScoredTrajectory:
    t = Trajectory(
        prompt_id="eval:0",
        attempt=0,
        request_id="eval:0/0/0",
        generation_batch=-1,
        prompt_ids=pack_i32([1, 2]),
        completion_ids=pack_i32(list(range(tokens))),
        logprobs=pack_f32([0.0] * tokens),
        finish_reason="length" if truncated else "stop",
        policy_version=3,
        max_policy_version=3,
    )
    return ScoredTrajectory(
        trajectory=t, rewards={"accuracy": accuracy, "format": fmt}, reward=accuracy + 0.2 * fmt
    )


def test_eval_row_has_ms_swift_eval_names_and_the_right_numbers() -> None:
    groups = [
        [scored(1, 1, 2), scored(0, 1, 4), scored(0, 0, 6, truncated=True), scored(1, 1, 4)],
        [scored(0, 1, 2), scored(0, 1, 2), scored(0, 1, 2), scored(0, 1, 2)],
    ]
    row = eval_row(groups, ["accuracy", "format"], version=3, step=12, seconds=1.5)
    assert row["split"] == "eval" and row["policy_version"] == 3 and row["step"] == 12
    totals = [1.2, 0.2, 0.0, 1.2, 0.2, 0.2, 0.2, 0.2]
    assert row["eval_reward"] == pytest.approx(sum(totals) / 8)
    # mean over prompts of the per-prompt sample std (ddof=1), as training's reward_std
    first = [1.2, 0.2, 0.0, 1.2]
    mean = sum(first) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in first) / 3)
    assert row["eval_reward_std"] == pytest.approx(std / 2)
    assert row["eval_rewards/accuracy/mean"] == pytest.approx(2 / 8)
    assert row["eval_rewards/format/mean"] == pytest.approx(7 / 8)
    assert row["eval_completions/mean_length"] == pytest.approx(24 / 8)
    assert row["eval_completions/clipped_ratio"] == pytest.approx(1 / 8)
    # pass@1: (2/4 + 0) / 2; pass@4: (1 + 0) / 2
    assert row["eval_pass@1"] == pytest.approx(0.25)
    assert row["eval_pass@4"] == pytest.approx(0.5)
    assert (row["eval_prompts"], row["eval_samples"], row["eval_runtime"]) == (2, 8, 1.5)


def test_eval_row_without_accuracy_has_no_pass_at_k() -> None:
    only_format = ScoredTrajectory(trajectory=scored(1, 1, 2).trajectory, rewards={"format": 1.0}, reward=0.2)
    row = eval_row([[only_format]], ["format"], version=1, step=1, seconds=0.1)
    assert row["eval_rewards/format/mean"] == 1.0
    assert not any(key.startswith("eval_pass@") for key in row)


def test_eval_gauges_take_the_row() -> None:
    groups = [[scored(1, 1, 2), scored(0, 1, 2)]]
    row = eval_row(groups, ["accuracy", "format"], version=7, step=28, seconds=2.0)
    metrics.set_eval_gauges("eval-gauges", row)
    from prometheus_client import REGISTRY

    sample = REGISTRY.get_sample_value
    assert sample("rollstream_eval_reward", {"run": "eval-gauges"}) == pytest.approx(row["eval_reward"])
    assert sample("rollstream_eval_policy_version", {"run": "eval-gauges"}) == 7
    assert sample("rollstream_eval_runtime", {"run": "eval-gauges"}) == 2.0
    assert sample("rollstream_eval_reward_func_mean", {"run": "eval-gauges", "reward": "accuracy"}) == 0.5
    assert sample("rollstream_eval_pass_at_k", {"run": "eval-gauges", "k": "2"}) == 1.0


# --- the split -------------------------------------------------------------------------------------


def test_split_is_deterministic_and_disjoint_by_prompt() -> None:
    cfg = cfg_with("data.split_dataset_ratio=0.1")
    train, held = loading.load_splits(cfg)
    again = loading.load_splits(cfg)
    assert (train, held) == again  # same seed, same split
    train_keys, held_keys = {prompt_key(r) for r in train}, {prompt_key(r) for r in held}
    assert train_keys and held_keys and not train_keys & held_keys
    assert len(train) + len(held) == cfg.data.dataset_size  # every row on one side
    distinct = len(train_keys | held_keys)
    assert len(held_keys) == round(0.1 * distinct)
    other = loading.load_splits(cfg_with("data.split_dataset_ratio=0.1", "run.seed=7"))[1]
    assert {prompt_key(r) for r in other} != held_keys  # the seed decides


def test_the_learner_plans_batches_on_the_train_side_only() -> None:
    cfg = cfg_with("data.split_dataset_ratio=0.2")
    assert len(loading.load_rows(cfg)) == len(loading.load_splits(cfg)[0]) < cfg.data.dataset_size


def test_held_out_prompts_are_evaluated_once_each_up_to_eval_limit() -> None:
    cfg = cfg_with("data.split_dataset_ratio=0.2")
    held = loading.load_splits(cfg)[1]
    rows = loading.load_eval_rows(cfg)
    distinct = list(dict.fromkeys(prompt_key(r) for r in held))  # first-seen order
    assert [prompt_key(r) for r in rows] == distinct and len(rows) < len(held)
    limited = loading.load_eval_rows(cfg_with("data.split_dataset_ratio=0.2", "eval.eval_limit=5"))
    assert limited == rows[:5]


def test_a_split_that_leaves_a_side_empty_names_the_field() -> None:
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}], "solution": "1"} for i in range(4)]
    with pytest.raises(
        DatasetError, match=r"data.split_dataset_ratio=0.05 leaves the held-out set empty.*4 distinct"
    ):
        split_dataset(rows, 0.05, seed=0)
    with pytest.raises(DatasetError, match="leaves the train set empty"):
        split_dataset(rows, 0.95, seed=0)


def test_val_dataset_is_read_with_the_train_column_mapping(tmp_path) -> None:
    path = tmp_path / "val.jsonl"
    path.write_text(
        "\n".join(json.dumps({"question": f"What is {i}+1?", "answer": str(i + 1)}) for i in range(3))
    )
    cfg = cfg_with(
        f"data.val_dataset={json.dumps(str(path))}", 'data.columns={question = "prompt", answer = "solution"}'
    )
    # the built-in train set has no such columns: the mapping must not be checked against it
    with pytest.raises(DatasetError, match="data.columns maps 'question'"):
        loading.load_eval_rows(cfg)
    mapped = tmp_path / "train.jsonl"
    mapped.write_text(path.read_text())
    cfg = cfg_with(
        f"data.dataset={json.dumps(str(mapped))}",
        f"data.val_dataset={json.dumps(str(path))}",
        'data.columns={question = "prompt", answer = "solution"}',
    )
    rows = loading.load_eval_rows(cfg)
    assert [r["solution"] for r in rows] == ["1", "2", "3"]
    assert cfg.eval.eval_strategy == "steps"  # derived: there is held-out data


def test_val_dataset_bad_input_is_one_line_naming_the_problem(tmp_path) -> None:
    cfg = cfg_with(f"data.val_dataset={json.dumps(str(tmp_path / 'missing.jsonl'))}")
    with pytest.raises(DatasetError, match="missing.jsonl.*no such file"):
        loading.load_eval_rows(cfg)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(DatasetError, match="row 0 has no prompt"):
        loading.load_eval_rows(cfg_with(f"data.val_dataset={json.dumps(str(bad))}"))


# --- config ----------------------------------------------------------------------------------------


def test_eval_defaults_follow_training_and_the_data() -> None:
    off = cfg_with()
    assert off.eval.eval_strategy == "no"
    on = cfg_with("data.split_dataset_ratio=0.05", "grpo.temperature=0.7")
    assert on.eval.eval_strategy == "steps"
    assert on.eval.eval_num_generations == on.grpo.num_generations == 8
    assert on.eval.eval_temperature == 0.7


def test_divisibility_error_shows_the_numbers_and_nearest_valid_values() -> None:
    with pytest.raises(ConfigError) as info:
        cfg_with(
            "data.split_dataset_ratio=0.05",
            "eval.per_device_eval_batch_size=6",
            "eval.eval_num_generations=4",
        )
    text = str(info.value)
    assert "eval.per_device_eval_batch_size=6" in text and "1 * 6 = 6" in text
    assert (
        "eval.eval_num_generations=4" in text and "nearest valid per_device_eval_batch_size: 4 or 8" in text
    )
    with pytest.raises(ConfigError, match=r"2 \* 3 = 6 .* nearest valid per_device_eval_batch_size: 2 or 4"):
        cfg_with(
            "data.split_dataset_ratio=0.05",
            "grpo.world_size=2",
            "grpo.per_device_train_batch_size=8",
            "eval.per_device_eval_batch_size=3",
            "eval.eval_num_generations=4",
        )


def test_divisibility_is_not_checked_with_evaluation_off() -> None:
    cfg = cfg_with("eval.per_device_eval_batch_size=6", "eval.eval_num_generations=4")
    assert cfg.eval.eval_strategy == "no"
    cfg = cfg_with(
        "data.split_dataset_ratio=0.05", 'eval.eval_strategy="no"', "eval.per_device_eval_batch_size=6"
    )
    assert cfg.eval.eval_strategy == "no"


def test_evaluation_on_without_data_and_two_sources_are_errors() -> None:
    with pytest.raises(ConfigError, match=r'eval.eval_strategy="steps" needs held-out data'):
        cfg_with('eval.eval_strategy="steps"')
    with pytest.raises(ConfigError, match="both set"):
        cfg_with('data.val_dataset="x.jsonl"', "data.split_dataset_ratio=0.1")
    with pytest.raises(ConfigError, match=r"data.split_dataset_ratio=1.0 is out of range"):
        cfg_with("data.split_dataset_ratio=1.0")


# --- rollstream eval's weights argument ------------------------------------------------------------


def test_resolve_weights_finds_snapshots_and_explains_what_is_missing(tmp_path) -> None:
    run = tmp_path / "run"
    for version in (2, 4):
        (run / "weights" / f"v{version:06d}").mkdir(parents=True)
        (run / "weights" / f"v{version:06d}" / "model.safetensors").write_bytes(b"")
    assert resolve_weights(str(run)) == (run / "weights" / "v000004", 4)
    assert resolve_weights(f"{run}:2") == (run / "weights" / "v000002", 2)
    assert resolve_weights(str(run / "weights" / "v000002")) == (run / "weights" / "v000002", 2)
    with pytest.raises(graph.SetupError, match=r"no snapshot of that version .*kept: v000002, v000004"):
        resolve_weights(f"{run}:3")
    with pytest.raises(graph.SetupError, match="holds no model.safetensors"):
        resolve_weights(str(tmp_path))


# --- plot ------------------------------------------------------------------------------------------


def test_plot_draws_train_and_eval_reward_by_version(tmp_path) -> None:
    rows = [
        {"step": s, "policy_version": s, "reward": 0.1 * s, "rewards/accuracy/mean": 0.05 * s, "time": s}
        for s in range(1, 5)
    ]
    rows += [
        {
            "split": "eval",
            "policy_version": v,
            "step": v,
            "eval_reward": 0.2 * v,
            "eval_rewards/accuracy/mean": 0.1 * v,
        }
        for v in (2, 4)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plot.figure(plot.read_rows(tmp_path))
    panel = next(ax for ax in fig.axes if ax.get_title() == "train vs eval reward")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in panel.get_lines()}
    assert lines["eval reward"] == ([2, 4], [pytest.approx(0.4), pytest.approx(0.8)])
    assert lines["train reward"][0] == [1, 2, 3, 4]
    assert set(lines) == {"train reward", "eval reward", "train accuracy", "eval accuracy"}
    reward = next(ax for ax in fig.axes if ax.get_title() == "reward")
    assert len(reward.get_lines()[0].get_xdata()) == 4  # eval rows are not optimizer steps


async def test_with_evaluation_off_the_worker_only_waits_for_the_run_to_end(tmp_path) -> None:
    from pipeline.records import WeightsPublished
    from stages.evaluate import Evaluate

    stage = Evaluate(cfg_with(), tmp_path, [], tmp_path)  # eval_strategy derived "no": no engine is started
    ctx = FakeContext("eval-off", "evaluate", "w")
    await stage.start(ctx)
    assert stage.engine is None
    await stage.on_broadcast(WeightsPublished(version=3, path="x"), ctx)
    assert ctx.stops == []
    await stage.on_broadcast(WeightsPublished(version=4, path="x", final=True), ctx)
    assert "run finished" in ctx.stop_reason
    await stage.close()
    assert not (tmp_path / "metrics.jsonl").exists()

