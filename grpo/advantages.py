"""GRPO advantages and the per-group checks of the advantage stage. Pure: rewards in, advantages out.

As ms-swift, request-aware: statistics per prompt over its unique requests (a scheduler may split one
request into several records, which share its reward and its advantage).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.records import ScoredTrajectory

STD_EPS = 1e-4  # as ms-swift: (r - mean) / (std + 1e-4)


def _unbiased_std(values: np.ndarray) -> float:
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def _group_mean_baseline(values: np.ndarray) -> np.ndarray:
    """grpo and reinforce_plus_plus: A_q = R_q - mean_G."""
    return values - values.mean()


def _leave_one_out_baseline(values: np.ndarray) -> np.ndarray:
    """rloo: A_q = R_q - mean of the OTHER requests = K/(K-1) * (R_q - mean_G) (as ms-swift); 0 when K = 1."""
    k = len(values)
    centered = values - values.mean()
    return centered * k / (k - 1) if k > 1 else centered


# The baseline of each estimator. Scaling differs too: grpo and rloo divide by the std of the REWARDS,
# reinforce_plus_plus by the std of the (centered) ADVANTAGES, which for "batch" whitens across prompts.
BASELINES = {
    "grpo": _group_mean_baseline,
    "rloo": _leave_one_out_baseline,
    "reinforce_plus_plus": _group_mean_baseline,
}


GDPO_EPS = 1e-8  # as ms-swift's gdpo: (r - mean) / (std + 1e-8), per function and then for the sum
SCALE_REWARDS = ("group", "batch", "none", "gdpo")


def _nan_normalised(values: np.ndarray) -> np.ndarray:
    """One reward function over one group's requests, NaN where it returned None: (r - nanmean) /
    (Bessel nanstd + 1e-8), and 0 where that is NaN (a missing score; fewer than two scores), as ms-swift."""
    scored = values[~np.isnan(values)]
    if len(scored) < 2:  # ms-swift's nanstd is NaN for one score, and NaN becomes 0
        return np.zeros_like(values)
    normalised = (values - scored.mean()) / (scored.std(ddof=1) + GDPO_EPS)
    return np.nan_to_num(normalised, nan=0.0)


def _gdpo(
    rewards_per_func: np.ndarray, reward_weights: np.ndarray, by_prompt: dict[str, list[int]]
) -> np.ndarray:
    """GDPO (arXiv 2601.05242) over unique requests, as ms-swift's scale_rewards="gdpo": each function
    normalised within each prompt's group, the weighted sum, then that sum normalised over every request."""
    summed = np.zeros(len(rewards_per_func))
    for rows in by_prompt.values():
        for column, weight in enumerate(reward_weights):
            summed[rows] += weight * _nan_normalised(rewards_per_func[rows, column])
    return (summed - summed.mean()) / (_unbiased_std(summed) + GDPO_EPS)


def compute_advantages(
    rewards: Sequence[float] | np.ndarray,
    prompt_ids: Sequence[str],
    request_ids: Sequence[str],
    *,
    scale_rewards: str = "group",
    estimator: str = "grpo",
    rewards_per_func: Sequence[Sequence[float]] | np.ndarray | None = None,
    reward_weights: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """GRPO advantages, request-aware as ms-swift: statistics per prompt over its unique requests.

    R_q is the reward of request q (all its records must agree); for the requests G of one prompt,
    A_q = R_q - mean_G, divided by ``std_G + 1e-4`` (``group``), by the std over every unique request of
    the batch + 1e-4 (``batch``), or not at all (``none``). std is unbiased (ddof=1, torch's default)
    and 0 for a single request. Each record gets its request's A_q.

    ``estimator`` (ms-swift's ``advantage_estimator``): ``grpo`` as above; ``rloo`` uses the
    leave-one-out baseline A_q = K/(K-1) (R_q - mean_G), scaled by the same reward stds;
    ``reinforce_plus_plus`` uses A_q = R_q - mean_G and divides by the std of those A_q, over the
    group (``group``, equal to the reward std) or over every request of the batch (``batch``).

    ``gdpo`` (ms-swift; needs ``rewards_per_func``, n x F with NaN where a function returned None, and
    ``reward_weights``, F; the grpo estimator): per prompt and function f, over the prompt's requests,
    g_qf = (r_qf - nanmean_f) / (Bessel nanstd_f + 1e-8), NaN -> 0 (also for fewer than two scores);
    S_q = sum_f w_f g_qf; A_q = (S_q - mean S) / (std S + 1e-8) over every request passed (the
    generation batch), std unbiased and 0 for one request. ``rewards`` is still checked per request.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    n = len(rewards)
    if len(prompt_ids) != n or len(request_ids) != n:
        raise ValueError(f"lengths differ: {n} rewards, {len(prompt_ids)} prompt_ids, {len(request_ids)} request_ids")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    if estimator not in BASELINES:
        raise ValueError(f"estimator must be one of {', '.join(BASELINES)}, got {estimator!r}")
    per_func, weights = None, np.empty(0)
    if scale_rewards == "gdpo":
        if rewards_per_func is None or reward_weights is None:
            raise ValueError("scale_rewards='gdpo' needs rewards_per_func (n x functions) and reward_weights")
        if estimator != "grpo":
            raise ValueError(f"scale_rewards='gdpo' replaces the estimator's baseline: estimator must be grpo, got {estimator!r}")
        per_func = np.asarray(rewards_per_func, dtype=np.float64).reshape(n, -1)
        weights = np.asarray(reward_weights, dtype=np.float64)
        if per_func.shape[1] != len(weights):
            raise ValueError(f"rewards_per_func has {per_func.shape[1]} functions but reward_weights {len(weights)}")

    request_reward: dict[str, float] = {}
    request_prompt: dict[str, str] = {}
    request_row: dict[str, int] = {}  # the first record of each request (its per-function scores)
    for row, (reward, prompt, request) in enumerate(zip(rewards, prompt_ids, request_ids)):
        if request in request_reward:
            if not np.isclose(request_reward[request], reward, rtol=1e-5, atol=1e-6):
                raise ValueError(
                    f"request {request!r} has records with different rewards "
                    f"({request_reward[request]} and {reward}); a request's records must share one reward"
                )
            continue
        request_reward[request] = float(reward)
        request_prompt[request] = prompt
        request_row[request] = row

    by_prompt: dict[str, list[str]] = {}
    for request, prompt in request_prompt.items():
        by_prompt.setdefault(prompt, []).append(request)

    if per_func is not None:
        order = list(request_row)  # unique requests; rows of that order per prompt
        index = {request: i for i, request in enumerate(order)}
        scaled = _gdpo(
            per_func[[request_row[r] for r in order]],
            weights,
            {p: [index[r] for r in requests] for p, requests in by_prompt.items()},
        )
        return np.array([scaled[index[r]] for r in request_ids], dtype=np.float64)

    values = {p: np.array([request_reward[r] for r in requests]) for p, requests in by_prompt.items()}
    centered = {p: BASELINES[estimator](v) for p, v in values.items()}
    # grpo and rloo divide by the std of the rewards; reinforce_plus_plus by the std of the centered
    # advantages (ms-swift's whitening), which differs from the reward std only across prompts ("batch").
    spread = centered if estimator == "reinforce_plus_plus" else values
    batch_std = _unbiased_std(np.concatenate([np.empty(0), *spread.values()]))
    advantage: dict[str, float] = {}
    for prompt, requests in by_prompt.items():
        scaled = centered[prompt]
        if scale_rewards == "group":
            scaled = scaled / (_unbiased_std(spread[prompt]) + STD_EPS)
        elif scale_rewards == "batch":
            scaled = scaled / (batch_std + STD_EPS)
        advantage.update(zip(requests, scaled.tolist()))
    return np.array([advantage[r] for r in request_ids], dtype=np.float64)


def rewards_per_func(records: Sequence[ScoredTrajectory], names: Sequence[str]) -> np.ndarray:
    """Pure: the (records x functions) matrix of each record's per-function rewards in ``names`` order, NaN
    where a function returned None (not applicable) or did not score the record, as ms-swift's rewards_per_func."""
    return np.array(
        [[np.nan if (v := r.rewards.get(name)) is None else float(v) for name in names] for r in records],
        dtype=np.float64,
    ).reshape(len(records), len(names))


def kl_penalized_rewards(
    rewards: Sequence[float] | np.ndarray, kl: Sequence[float] | np.ndarray, request_ids: Sequence[str], beta: float
) -> np.ndarray:
    """Pure: ms-swift's ``kl_in_reward``, R'_q = R_q - beta * KL_q, where KL_i = sum over record i's
    completion of (old - ref) log-probs and KL_q sums the records of request q (one reward per request,
    as ``compute_advantages`` requires). Only the learner has the reference model, so it calls this and
    then ``compute_advantages`` again on the result."""
    per_request: dict[str, float] = {}
    for request, value in zip(request_ids, kl):
        per_request[request] = per_request.get(request, 0.0) + float(value)
    penalty = np.array([per_request[r] for r in request_ids], dtype=np.float64)
    return np.asarray(rewards, dtype=np.float64) - beta * penalty


def split_request_disagrees(records: Sequence[ScoredTrajectory]) -> bool:
    """Pure: do the records of some request (a scheduler split it into turns) carry different rewards?
    Same tolerance as ``compute_advantages``."""
    first: dict[str, float] = {}
    for r in records:
        reward = first.setdefault(r.trajectory.request_id, r.reward)
        if not np.isclose(reward, r.reward, rtol=1e-5, atol=1e-6):
            return True
    return False


def has_zero_std(records: Sequence[ScoredTrajectory]) -> bool:
    """Pure: do the group's requests all share one reward? Then every advantage is 0 (DAPO drops it).

    Counted per unique request, as the advantages are; a group of one request counts as zero std
    (as ms-swift with num_generations = 1)."""
    rewards = {r.trajectory.request_id: r.reward for r in records}
    return len(set(rewards.values())) <= 1


def overlong_loss_weights(records: Sequence[ScoredTrajectory]) -> list[float]:
    """Pure: DAPO overlong filtering, 0.0 for a truncated completion (finish_reason "length"), else 1.0."""
    return [0.0 if r.trajectory.is_truncated else 1.0 for r in records]
