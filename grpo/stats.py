"""Pure statistics of rewards and evaluation: numbers (and scored records) in, numbers out."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.records import ScoredTrajectory


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for one value); (0, 0) for none."""
    array = np.asarray(values, dtype=np.float64)
    return (float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0) if len(array) else (0.0, 0.0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021, HumanEval):
    ``1 - C(n - c, k) / C(n, k)``, the chance that k samples drawn without replacement hold a correct one."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def eval_row(
    groups: list[list[ScoredTrajectory]], reward_funcs: list[str], *, version: int, step: int, seconds: float
) -> dict[str, Any]:
    """One ``metrics.jsonl`` row for an evaluated version, with the training row's names behind
    transformers' ``eval_`` prefix (as TRL/ms-swift log evaluation): ``eval_reward``, ``eval_reward_std``
    (mean of the per-prompt stds, as training's), ``eval_rewards/<func>/mean``, ``eval_completions/...``,
    ``eval_runtime`` (seconds); with the accuracy reward, ``eval_pass@1`` and ``eval_pass@<G>`` (mean over
    prompts of the unbiased estimator; a completion is correct when accuracy scores 1)."""
    records = [r for group in groups for r in group]
    row: dict[str, Any] = {"split": "eval", "policy_version": version, "step": step}
    row["eval_reward"] = mean_std([r.reward for r in records])[0]
    row["eval_reward_std"] = mean_std([mean_std([r.reward for r in group])[1] for group in groups])[0]
    names = list(dict.fromkeys([*reward_funcs, *(n for r in records for n in r.rewards)]))
    for name in names:
        values = [r.rewards.get(name) for r in records]
        values = [v for v in values if v is not None and not math.isnan(v)]
        row[f"eval_rewards/{name}/mean"], row[f"eval_rewards/{name}/std"] = mean_std(values)
    lengths = [len(r.trajectory.completion_ids) // 4 for r in records]  # int32 tokens
    row["eval_completions/mean_length"] = mean_std(lengths)[0]
    row["eval_completions/clipped_ratio"] = mean_std([float(r.trajectory.is_truncated) for r in records])[0]
    if "accuracy" in names and groups:
        n = min(len(group) for group in groups)
        for k in dict.fromkeys((1, n)):
            per_prompt = [
                pass_at_k(len(group), sum((r.rewards.get("accuracy") or 0.0) >= 1.0 for r in group), k)
                for group in groups
            ]
            row[f"eval_pass@{k}"] = mean_std(per_prompt)[0]
    row["eval_prompts"] = len(groups)
    row["eval_samples"] = len(records)
    row["eval_runtime"] = seconds
    row["time"] = time.time()
    return row


def tool_stats(rollout_infos: list[dict[str, Any]]) -> dict[str, float]:
    """TRL's tool metrics over a step's completions (the tool_calling scheduler counts per request):
    ``tools/call_frequency`` = tool calls per completion, ``tools/failure_frequency`` = failed calls per call;
    rollstream's ``tools/template_rewrite_frequency`` = completions whose re-rendered history differs from
    the sampled tokens (which are kept); ``agent/branch_frequency``: records of agent episodes split into
    branches. Empty when no completion went through either."""
    out: dict[str, float] = {}
    episodes = [i for i in rollout_infos if "branches" in i]  # the agent scheduler's records
    if episodes:  # records of episodes split into branches (a history the endpoint could not extend)
        out["agent/branch_frequency"] = sum(int(i["branches"]) > 1 for i in episodes) / len(episodes)
    counted = [i for i in rollout_infos if "num_tool_calls" in i]
    if not counted:
        return out
    calls = sum(int(i["num_tool_calls"]) for i in counted)
    failures = sum(int(i.get("num_tool_failures", 0)) for i in counted)
    return {
        **out,
        "tools/call_frequency": calls / len(rollout_infos),
        "tools/failure_frequency": failures / calls if calls else 0.0,
        "tools/template_rewrite_frequency": sum(bool(i.get("template_rewrites")) for i in counted) / len(counted),
    }


# TRL's names (trl 1.16 grpo_trainer.py) of the learner's metrics where rollstream's (ms-swift's) differ: both
# go into metrics.jsonl with the same value, so a TRL user's dashboards and scripts read a run as they are.
# The IS weight's mean is over completion tokens (TRL's sequence modes average per sequence), its min and max over
# the step's completion tokens.
TRL_METRIC_ALIASES = {
    "rollout_correction/is_weight_mean": "sampling/importance_sampling_ratio/mean",
    "rollout_correction/is_weight_min": "sampling/importance_sampling_ratio/min",
    "rollout_correction/is_weight_max": "sampling/importance_sampling_ratio/max",
    "entropy/mean": "entropy",
}


def trl_aliases(row: dict[str, Any]) -> dict[str, Any]:
    """TRL's name -> value for each of ``row``'s metrics that TRL logs under another name."""
    return {trl: row[ours] for ours, trl in TRL_METRIC_ALIASES.items() if ours in row and trl not in row}
