"""run.log_completions and run.num_completions_to_print (ms-swift's / TRL's names): completions.jsonl on or
off with the real learner stage, what a table prints (as data), and what `rollstream inspect` says."""

from __future__ import annotations

import json

import pytest

from config import ConfigError, load_config
from pipeline.run_dir import missing_completions
from rollstream import inspect_run
from rollstream.progress import completions_to_print
from tests import test_learner_loop
from tests.test_learner_loop import new_learner, train_batches

model_dir = test_learner_loop.model_dir  # the tiny model fixture


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_log_completions_writes_completions_jsonl_and_hands_the_rows_to_the_printer(model_dir, tmp_path):
    out = tmp_path / "on"
    learner = new_learner(model_dir, out, num_batches=2)
    printed = []
    learner.on_completions = printed.append
    await train_batches(learner, range(2))
    await learner.close()
    written = rows(out / "completions.jsonl")
    assert len(written) == 2 * 8 and [len(batch) for batch in printed] == [8, 8]
    assert printed[0] + printed[1] == written  # the table's rows are the file's rows
    assert {"prompt", "completion", "rewards", "reward", "advantage", "step"} <= set(written[0])
    assert missing_completions(out) is None


async def test_log_completions_false_writes_no_completions_jsonl(model_dir, tmp_path):
    out = tmp_path / "off"
    learner = new_learner(model_dir, out, "run.log_completions=false", num_batches=2)
    await train_batches(learner, range(2))
    await learner.close()
    assert not (out / "completions.jsonl").exists()
    assert len(rows(out / "metrics.jsonl")) == learner.trainer.step > 0  # the metrics are still written
    # inspect says why, instead of an empty table (the run's config.toml records the choice)
    (out / "config.toml").write_text("[run]\nlog_completions = false\n")
    info = inspect_run.from_run_dir(out)
    assert info["completions"] == [] and "run.log_completions = false" in info["completions_missing"]


def test_a_run_dir_before_its_first_batch_says_not_yet(tmp_path):
    (tmp_path / "config.toml").write_text("[run]\nlog_completions = true\n")
    assert "not written yet" in missing_completions(tmp_path)
    (tmp_path / "config.toml").write_text("not toml [")
    assert "not written yet" in missing_completions(tmp_path)  # nothing says it was turned off


def test_completions_to_print_is_a_seeded_sample_in_order_with_a_column_per_reward():
    batch = [
        {"step": 10, "prompt": f"p{i}", "completion": f"c{i}", "rewards": {"accuracy": float(i % 2), "format": 1.0},
         "reward": float(i % 2) + 0.2, "advantage": 0.5 - i % 2, "messages": []}
        for i in range(16)
    ]
    picked = completions_to_print(batch, 4, seed=52)
    assert len(picked) == 4 and picked == completions_to_print(batch, 4, seed=52)
    assert picked != completions_to_print(batch, 4, seed=53)  # another step, another sample
    indices = [int(r["prompt"][1:]) for r in picked]
    assert indices == sorted(indices)  # the batch's order
    assert list(picked[0]) == ["prompt", "completion", "accuracy", "format", "reward", "advantage"]
    i = indices[0]
    assert picked[0] == {"prompt": f"p{i}", "completion": f"c{i}", "accuracy": float(i % 2), "format": 1.0,
                         "reward": float(i % 2) + 0.2, "advantage": 0.5 - i % 2}
    assert [r["prompt"] for r in completions_to_print(batch, 64, seed=1)] == [f"p{i}" for i in range(16)]  # all


def test_num_completions_to_print_needs_log_completions():
    with pytest.raises(ConfigError, match="run.num_completions_to_print=4 with run.log_completions=false"):
        load_config("configs/demo.toml", ["run.log_completions=false", "run.num_completions_to_print=4"])
    cfg = load_config("configs/demo.toml", ["run.num_completions_to_print=4"])
    assert (cfg.run.log_completions, cfg.run.num_completions_to_print) == (True, 4)
    default = load_config("configs/demo.toml")
    assert (default.run.log_completions, default.run.num_completions_to_print) == (True, 0)
