"""The batch plan of one generation batch: the order its records are trained in, how they split into
mini-batches (per learner process) and token-budget micro-batches, and whether old log-probs are needed.
Pure: numbers and records in, indices out.

As ms-swift: a generation batch is ``steps_per_generation`` mini-batches of ``per_device_train_batch_size
* world_size`` trajectories, trained ``num_iterations`` times, with an optimizer step every
``gradient_accumulation_steps`` mini-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from config import GrpoConfig
from pipeline.records import ScoredTrajectory


def shuffle_order(size: int, seed: int, version: int) -> list[int]:
    """The order in which a generation batch's records are trained: seeded by ``run.seed + version``, so a
    rerun trains the same mini-batches and no mini-batch is always one prompt group (as verifiers does)."""
    return np.random.default_rng(seed + version).permutation(size).tolist()


def needs_old_logps(grpo: GrpoConfig, records: Sequence[ScoredTrajectory], version: int) -> bool:
    """Whether the learner's log-probs at the start of the generation batch must be computed.

    Without them the ratio is 1 (old = logps.detach()), which is right only when the policy cannot move
    between the batch's start and any of its forward passes and the samples are on-policy. ms-swift's rule:
    several iterations, or optimizer steps not aligned with generation batches
    (gradient_accumulation_steps % steps_per_generation != 0, which also covers GA < steps_per_generation).
    Ours adds trajectories from an older policy version, and the rollout IS correction, whose weights
    compare the old log-probs with the engine's.
    """
    return (
        grpo.num_iterations > 1
        or grpo.gradient_accumulation_steps % grpo.steps_per_generation != 0
        or grpo.rollout_importance_sampling_mode is not None
        or any(r.trajectory.policy_version < version for r in records)
    )


def optimizer_steps_per_batch(grpo: GrpoConfig) -> int:
    """Pure: optimizer steps one generation batch brings (at least 1)."""
    return max(1, (grpo.steps_per_generation * grpo.num_iterations) // grpo.gradient_accumulation_steps)


def token_budget_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Pure: consecutive rows grouped so that each group's tokens (prompt + completion) fit ``max_tokens``;
    a row longer than the budget alone makes a group."""
    groups: list[list[int]] = []
    used = 0
    for row, n in enumerate(lengths):
        if groups and groups[-1] and used + n <= max_tokens:
            groups[-1].append(row)
            used += n
        else:
            groups.append([row])
            used = n
    return groups
