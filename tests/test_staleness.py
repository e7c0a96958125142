"""Feeder + advantage + learner over the real pipeline: max_staleness bounds, the synchronous special case,
and DAPO dynamic sampling (tiny model, real vLLM, real learner).

Marked ``e2e``. Runs are short (a few generation batches of 32 samples) but real end to end.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict

import pytest

from config import load_config
from data.loading import load_rows
from rewards import get_reward, orms
from rollstream import train
from stages.feeder import Feeder

pytestmark = pytest.mark.e2e


def small_config(tmp_path, *extra):
    return load_config(
        "configs/demo.toml",
        [
            f"run.output_dir={json.dumps(str(tmp_path))}",
            f"run.name=staleness-{uuid.uuid4().hex[:6]}",
            "grpo.generation_batch_size=32",  # 4 prompt groups of 8, 2 optimizer steps per batch
            "rollout.max_model_len=256",
            *extra,
        ],
    )


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
async def test_observed_staleness_never_exceeds_max_staleness(tmp_path, vllm_engine, max_staleness):
    cfg = small_config(tmp_path, f"grpo.max_staleness={max_staleness}", "run.max_steps=16")
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    completions = read_jsonl(result.output_dir / "completions.jsonl")
    assert len(rows) == 16 and len(completions) == 8 * 32
    assert max(r["staleness/max"] for r in rows) <= max_staleness
    assert all(c["trained_at_version"] - c["policy_version"] <= max_staleness for c in completions)
    # Admission control keeps generated work fresh enough: (almost) nothing is dropped for staleness.
    dropped = sum(r.get("staleness/dropped", 0) for r in rows)
    assert dropped < 0.05 * len(completions)


async def test_max_staleness_zero_is_synchronous_grpo(tmp_path, vllm_engine):
    """Batch b is sampled with exactly version b and trained at version b, on the prompts the feeder's pure
    order gives: the pipeline equals a synchronous GRPO loop with the same seeds."""
    cfg = small_config(tmp_path, "grpo.max_staleness=0", "run.max_steps=10")
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    completions = read_jsonl(result.output_dir / "completions.jsonl")
    by_batch: dict[int, list[dict]] = defaultdict(list)
    for c in completions:
        by_batch[c["generation_batch"]].append(c)
    assert sorted(by_batch) == list(range(5))
    planned = Feeder(cfg, load_rows(cfg))
    for b, batch in sorted(by_batch.items()):
        assert {(c["policy_version"], c["max_policy_version"], c["trained_at_version"]) for c in batch} == {(b, b, b)}
        assert sorted({c["prompt_id"] for c in batch}) == sorted(t.prompt_id for t in planned.release_batch())


async def test_dynamic_sampling_resamples_always_solved_groups_for_max_resample_times_rounds(tmp_path, vllm_engine):
    from data.loading import arithmetic_rows

    data = tmp_path / "half_solved.jsonl"
    with data.open("w") as f:
        for i, row in enumerate(arithmetic_rows(200, seed=5)):
            f.write(json.dumps({**row, "always_solved": i % 2 == 0}) + "\n")
    accuracy = get_reward("accuracy")

    def solved_or_accuracy(completions, always_solved, solution, **kwargs):
        scores = accuracy(completions, solution=solution)
        return [1.0 if solved else score for solved, score in zip(always_solved, scores)]

    orms["solved_or_accuracy"] = solved_or_accuracy
    try:
        cfg = small_config(
            tmp_path / "run",
            f"data.dataset={json.dumps(str(data))}",
            'reward.reward_funcs=["solved_or_accuracy"]',
            "reward.reward_weights=[1.0]",
            "grpo.dynamic_sample=true",
            "grpo.max_resample_times=2",
            "grpo.max_staleness=0",  # batches one after another: a row's drops belong to its batch
            "run.max_steps=10",
        )
        result = await train.run_pipeline(cfg, engine=vllm_engine)
    finally:
        del orms["solved_or_accuracy"]
    assert result.exit_code == 0
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    completions = read_jsonl(result.output_dir / "completions.jsonl")
    groups: dict[tuple[int, str], list[float]] = defaultdict(list)
    for c in completions:
        groups[(c["generation_batch"], f'{c["prompt_id"]}/{c["attempt"]}')].append(c["reward"])
    batch_rows = [r for r in rows if "dropped/zero_std" in r]  # the first optimizer step of each batch
    assert len(batch_rows) == 5
    for b, row in enumerate(batch_rows):
        trained = {g: rewards for (gb, g), rewards in groups.items() if gb == b}
        assert len(trained) == cfg.grpo.prompt_batch_size  # each batch still trains whole
        # max_resample_times = 2 rounds (ms-swift's count): a group is re-asked in rounds 0 and 1 at most, so
        # a batch drops at most 2 groups per place, and a zero-std group trains only in round 2 (its attempt).
        attempts = {g: int(g.rsplit("/", 1)[1]) for g in trained}
        assert all(a <= 2 for a in attempts.values())
        assert all(attempts[g] == 2 for g, rewards in trained.items() if len(set(rewards)) == 1)
        assert row["dropped/zero_std"] <= 2 * cfg.grpo.prompt_batch_size
        assert row["dropped/zero_std"] == sum(attempts.values())  # each attempt >= 1 replaced one dropped group
        assert row["resample/count"] == row["dropped/zero_std"]
    # Half the prompts are always solved: replacements happened, and they are new prompts (attempt >= 1).
    assert sum(r["dropped/zero_std"] for r in batch_rows) >= 3
    assert any(c["attempt"] >= 1 for c in completions)
