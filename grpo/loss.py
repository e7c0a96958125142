"""The GRPO loss (ms-swift / TRL), its variants, aggregators and the statistics the learner logs. Pure:
tensors in, tensors out.

Per completion token t of sequence i, with advantage A_i, importance ratio w_t = exp(log_w_t) (token level:
log_w_t = logp_t - old_logp_t, 1 when on-policy; GSPO: the sequence's mean) and current log-prob l_t:

    policy term P_t, by ``loss_type`` (``POLICY_TERMS``):
      grpo, bnpo, dr_grpo, dapo   -min(w_t A_i, clip(w_t, 1 - eps, 1 + eps_high) A_i)        PPO clip
      cispo                       -sg(min(w_t, eps_high)) A_i l_t      the ratio clamped at eps_high itself
      sapo                        -sigmoid(tau (w_t - 1)) (4 / tau) A_i    tau = tau_pos if A_i > 0 else tau_neg
    L_t  = (P_t * entropy_mask_t + beta * KL_t) * rollout_is_weight_t     the order of terms as ms-swift
    KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                      k3 estimator, always >= 0

and the ``loss_type`` decides how token losses are averaged (``LOSS_NORMALISERS``). The off-policy sequence
mask (DeepSeek-V3.2) removes a sequence from the completion mask before that average.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch


def _per_sequence_mean(loss: torch.Tensor, mask: torch.Tensor, **_: Any) -> torch.Tensor:
    # grpo: each row's token mean, then the mean over ALL rows (an empty row adds 0 but still counts).
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def _token_mean(loss: torch.Tensor, mask: torch.Tensor, **_: Any) -> torch.Tensor:
    # bnpo: the mean over every completion token of the mini-batch.
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def _fixed_length(loss: torch.Tensor, mask: torch.Tensor, max_completion_length: int | None = None, **_: Any) -> torch.Tensor:
    # dr_grpo: divide by a constant (rows x max_completion_length), so length carries no bias.
    if max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' needs max_completion_length (grpo.max_completion_length)")
    return (loss * mask).sum() / (loss.shape[0] * max_completion_length)


def _global_token_mean(loss: torch.Tensor, mask: torch.Tensor, num_items_in_batch: float | None = None, **_: Any) -> torch.Tensor:
    # dapo: divide by the completion tokens of the whole generation batch (per learner process).
    denominator = num_items_in_batch if num_items_in_batch is not None else mask.sum().clamp(min=1.0)
    return (loss * mask).sum() / denominator


LOSS_NORMALISERS = {
    "grpo": _per_sequence_mean,
    "bnpo": _token_mean,
    "dr_grpo": _fixed_length,
    "dapo": _global_token_mean,
    "cispo": _global_token_mean,  # as ms-swift and TRL: CISPO divides by num_items_in_batch, as dapo
    "sapo": _per_sequence_mean,  # as ms-swift and TRL: SAPO averages as grpo
}


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, logps: torch.Tensor, *, eps_low: float, eps_high: float,
    delta: float | None, **_: Any
) -> torch.Tensor:
    # PPO's pessimistic bound; delta (TRL's two-sided clipping) also caps the unclipped branch.
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.min(ratio * adv, clipped * adv)


def _cispo(ratio: torch.Tensor, adv: torch.Tensor, logps: torch.Tensor, *, eps_high: float, **_: Any) -> torch.Tensor:
    # CISPO (MiniMax-M1): REINFORCE weighted by the ratio clamped from above at eps_high itself (ScaleRL
    # uses 5.0) and detached, so a token outside the trust region still gets a gradient (only smaller).
    return -torch.clamp(ratio, max=eps_high).detach() * adv * logps


def _sapo(
    ratio: torch.Tensor, adv: torch.Tensor, logps: torch.Tensor, *, tau_pos: float, tau_neg: float, **_: Any
) -> torch.Tensor:
    # SAPO (arXiv 2511.20347): a soft gate instead of the hard clip. d/dlogp = -4 s (1 - s) w A with
    # s = sigmoid(tau (w - 1)), which is -A at w = 1 (the on-policy gradient) and fades as w leaves 1.
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    return -torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau) * adv


# The policy term of each loss_type; the normaliser is LOSS_NORMALISERS[loss_type].
POLICY_TERMS = {
    "grpo": _clipped_surrogate,
    "bnpo": _clipped_surrogate,
    "dr_grpo": _clipped_surrogate,
    "dapo": _clipped_surrogate,
    "cispo": _cispo,
    "sapo": _sapo,
}


def _masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean over the mask, shape (B, 1); an empty row gives 0."""
    return (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


# Rollout importance-sampling correction (ms-swift): weights from the engine's behaviour policy to the
# learner's "old" policy, without gradient. r_t is the token ratio, rho_i the per-sequence GEOMETRIC
# mean (TRL uses the product), C the threshold (an upper bound only).
ROLLOUT_IS_MODES = {
    "token_truncate": lambda r, rho, c: torch.clamp(r, max=c),
    "token_mask": lambda r, rho, c: torch.where(r <= c, r, torch.zeros_like(r)),
    "sequence_truncate": lambda r, rho, c: torch.clamp(rho, max=c).expand_as(r),
    "sequence_mask": lambda r, rho, c: torch.where(rho.expand_as(r) <= c, r, torch.zeros_like(r)),
}
# TRL's (GRPOConfig.vllm_importance_sampling_*, trl 1.16 grpo_trainer.py): the token modes are the same; a
# sequence's ratio rho is the PRODUCT of its token ratios and is itself the weight of every token under
# sequence_mask (ms-swift keeps the token ratios there); and the weight multiplies the policy term only.
TRL_ROLLOUT_IS_MODES = {
    **ROLLOUT_IS_MODES,
    "sequence_mask": lambda r, rho, c: torch.where(rho <= c, rho, torch.zeros_like(rho)).expand_as(r),
}
ROLLOUT_IS_CONVENTIONS = {"ms-swift": ROLLOUT_IS_MODES, "trl": TRL_ROLLOUT_IS_MODES}


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    beta: float = 0.04,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: float | None = None,
    rollout_logps: torch.Tensor | None = None,
    rollout_is_mode: str | None = None,
    rollout_is_threshold: float = 2.0,
    entropy_mask: torch.Tensor | None = None,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    off_policy_sequence_mask_delta: float | None = None,
    rollout_is_convention: str = "ms-swift",
    use_bias_correction_kl: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO objective over (B, T) per-token log-probs, as ms-swift computes it (see the module docstring).

    Returns (scalar loss, stats), the stats token means over ``mask``: kl; the clipped losses'
    clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean; cispo's cispo_clip_ratio (w > epsilon_high
    and A > 0; sapo has no clip ratio, as ms-swift); rollout_correction/is_weight_mean when a rollout IS mode is active;
    off_policy_sequence_mask/dropped_token_ratio when that mask is on. They are 0-dim tensors on the loss's
    device: reading one is a device sync, so the learner reads a whole optimizer step's at once (``host_stats``).

    ``entropy_mask`` (0/1, from ``high_entropy_mask``) zeroes the POLICY term of low-entropy tokens, not their
    KL term, without changing the normaliser (TRL/ms-swift's top_entropy_quantile).
    ``off_policy_sequence_mask_delta`` (DeepSeek-V3.2, ms-swift's name): a sequence whose mean over its tokens
    of (behaviour - current) log-probs exceeds delta and whose advantage is negative leaves the completion
    mask; the behaviour log-probs are ``rollout_logps`` (the engine's) when given, else the old policy's. It
    so leaves the grpo/bnpo normalisers, while dapo/cispo's ``num_items_in_batch`` and dr_grpo's constant
    stay what they were (as ms-swift).
    ``rollout_is_convention`` "trl": TRL's rollout IS weight (TRL_ROLLOUT_IS_MODES), on the policy term only.
    ``use_bias_correction_kl`` (TRL's name): the KL term times the ratio w_t (DeepSeek-V3.2's unbiased KL gradient).
    """
    if loss_type not in POLICY_TERMS:
        raise ValueError(f"loss_type must be one of {', '.join(POLICY_TERMS)}, got {loss_type!r}")
    if rollout_is_mode is not None and rollout_is_mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is_mode must be one of {sorted(ROLLOUT_IS_MODES)} or None, got {rollout_is_mode!r}")
    if rollout_is_mode is not None and rollout_logps is None:
        raise ValueError(f"rollout_is_mode={rollout_is_mode!r} needs rollout_logps (the engine's sampled-token log-probs)")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (a reference model); set beta = 0 to train without KL")
    if loss_type == "cispo" and importance_sampling_level != "token":
        # TRL: a token-summed loss with one ratio per sequence weights each sequence by its length
        # instead of optimising the per-sequence objective (and the detached cap makes sequence_token the same).
        raise ValueError(
            f"loss_type='cispo' needs importance_sampling_level='token', got {importance_sampling_level!r}: cispo sums "
            f"token losses, so a sequence-level ratio weights each sequence by its length; use loss_type='grpo' for GSPO"
        )
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    delta_logp = logps - old
    if importance_sampling_level == "token":
        log_w = delta_logp
    elif importance_sampling_level in ("sequence", "sequence_token"):
        # GSPO: one ratio per sequence, the geometric mean of the token ratios.
        seq = _masked_row_mean(delta_logp, mask)
        if importance_sampling_level == "sequence":
            log_w = seq.expand_as(logps)
        else:  # GSPO-token: the value of the sequence ratio, the gradient of each token
            log_w = logps - logps.detach() + seq.detach()
    else:
        raise ValueError(
            f"importance_sampling_level must be token, sequence or sequence_token, got {importance_sampling_level!r}"
        )

    eps_low, eps_high = epsilon, epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(log_w)
    adv = advantages.to(logps.dtype).unsqueeze(-1)
    per_token = POLICY_TERMS[loss_type](
        ratio, adv, logps, eps_low=eps_low, eps_high=eps_high, delta=delta, tau_pos=tau_pos, tau_neg=tau_neg
    )
    # The order of terms as ms-swift: policy term x entropy mask, + beta * KL, x rollout IS weight.
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token.dtype)
    is_weight = None
    if rollout_is_mode is not None:
        assert rollout_logps is not None  # (checked above)
        with torch.no_grad():
            log_r = torch.clamp(old.detach() - rollout_logps, -20.0, 20.0)
            if rollout_is_convention == "trl":  # the product of the token ratios
                rho = torch.exp(torch.clamp((log_r * mask).sum(-1, keepdim=True), -20.0, 20.0))
            else:  # ms-swift: their geometric mean
                rho = torch.exp(_masked_row_mean(log_r, mask))
            modes = ROLLOUT_IS_CONVENTIONS[rollout_is_convention]
            is_weight = modes[rollout_is_mode](torch.exp(log_r), rho, rollout_is_threshold)
        if rollout_is_convention == "trl":
            per_token = per_token * is_weight  # TRL weights the policy term only
    kl = None
    if beta != 0.0:
        assert ref_logps is not None  # (checked above)
        x = torch.clamp(ref_logps - logps, -20.0, 20.0)
        kl = torch.clamp(torch.exp(x) - x - 1, -10.0, 10.0)  # k3, clamped as ms-swift
        per_token = per_token + beta * (kl * ratio if use_bias_correction_kl else kl)
    if is_weight is not None and rollout_is_convention != "trl":
        per_token = per_token * is_weight  # ms-swift weights the KL term too
    tokens = mask.sum().clamp(min=1.0)
    loss_mask, dropped = mask, None
    if off_policy_sequence_mask_delta is not None:
        with torch.no_grad():
            behaviour = (rollout_logps if rollout_logps is not None else old).detach()
            gap = _masked_row_mean(behaviour - logps.detach(), mask)  # (B, 1): mean log(pi_behaviour / pi_theta)
            drop = (gap > off_policy_sequence_mask_delta) & (adv < 0)
            dropped = (mask * drop).sum() / tokens
            loss_mask = mask * ~drop
    # dapo/cispo without num_items_in_batch: the tokens of the mask as given, before the off-policy mask.
    num_items = tokens if num_items_in_batch is None else num_items_in_batch
    loss = LOSS_NORMALISERS[loss_type](
        per_token, loss_mask, max_completion_length=max_completion_length, num_items_in_batch=num_items
    )

    # Token means over the completion tokens as given (masked sequences included; ms-swift leaves them out),
    # so that micro-batches and ranks combine them exactly by their token counts.
    with torch.no_grad():
        stats = {"kl": (kl * mask).sum() / tokens if kl is not None else tokens.new_zeros(())}
        raw_ratio = ratio.detach()
        if POLICY_TERMS[loss_type] is _clipped_surrogate:
            low = ((raw_ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)
            high = ((raw_ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)
            stats["clip_ratio/low_mean"] = (low * mask).sum() / tokens
            stats["clip_ratio/high_mean"] = (high * mask).sum() / tokens
            stats["clip_ratio/region_mean"] = ((low + high).clamp(max=1) * mask).sum() / tokens
        elif loss_type == "cispo":
            capped = ((raw_ratio > eps_high) & (adv > 0)).to(mask.dtype)
            stats["cispo_clip_ratio"] = (capped * mask).sum() / tokens
        if is_weight is not None:
            stats["rollout_correction/is_weight_mean"] = (is_weight * mask).sum() / tokens
            # Over the completion tokens (TRL logs the min and max beside the mean); always present, so every
            # rank of a distributed learner reduces the same keys: +-inf where no token counts (not logged).
            weight, counted = is_weight.detach().expand_as(mask), mask > 0
            stats["rollout_correction/is_weight_min"] = weight.masked_fill(~counted, math.inf).min()
            stats["rollout_correction/is_weight_max"] = weight.masked_fill(~counted, -math.inf).max()
        if dropped is not None:
            stats["off_policy_sequence_mask/dropped_token_ratio"] = dropped
    return loss, stats


# The learner's loss columns of metrics.jsonl: the loss, and every stat policy_loss may return (ms-swift's
# names; the off-policy mask's share is ours, neither peer logs one). Gauges: pipeline/metrics.py.
LOSS_STATS = (
    "kl",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "cispo_clip_ratio",
    "loss",
    "rollout_correction/is_weight_mean",
    "rollout_correction/is_weight_min",
    "rollout_correction/is_weight_max",
    "off_policy_sequence_mask/dropped_token_ratio",
)


def host_stats(stats: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The same dicts with every tensor value read as a float, all in one device-to-host copy: on a GPU each
    separate read is a sync that lets the device run dry while Python queues the next kernels."""
    slots = [(i, key) for i, row in enumerate(stats) for key, value in row.items() if isinstance(value, torch.Tensor)]
    out = [dict(row) for row in stats]
    if slots:
        values = torch.stack([stats[i][key].detach().float().reshape(()) for i, key in slots]).tolist()
        for (i, key), value in zip(slots, values, strict=True):
            out[i][key] = value
    return out


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """top_entropy_quantile (TRL/ms-swift): 1 on completion tokens whose entropy is at least the
    ``1 - quantile`` quantile of the entropies of the mini-batch's completion tokens, else 0. ``quantile``
    1.0 keeps every token; 0.2 keeps the 20 % most uncertain ("80/20", Wang et al. 2025)."""
    mask = mask.to(entropy.dtype)
    values = entropy[mask > 0].float()
    if values.numel() == 0:
        return torch.zeros_like(mask)
    threshold = torch.quantile(values, 1.0 - quantile)
    return ((entropy >= threshold) & (mask > 0)).to(mask.dtype)


# A micro-batch's share of its mini-batch's loss, so that summing the micro-batches' (loss * share) gives
# exactly the padded mini-batch's loss: (rows, tokens) of the micro-batch, then of the mini-batch.
MICRO_BATCH_SHARE = {
    "grpo": lambda rows, tokens, all_rows, all_tokens: rows / all_rows,  # a mean over rows
    "bnpo": lambda rows, tokens, all_rows, all_tokens: tokens / max(all_tokens, 1.0),  # a mean over tokens
    "dr_grpo": lambda rows, tokens, all_rows, all_tokens: rows / all_rows,  # a sum / (rows * max length)
    "dapo": lambda rows, tokens, all_rows, all_tokens: 1.0,  # a sum / the generation batch's tokens
    "cispo": lambda rows, tokens, all_rows, all_tokens: 1.0,  # as dapo
    "sapo": lambda rows, tokens, all_rows, all_tokens: rows / all_rows,  # as grpo
}


def mean_std(values: list[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=np.float64)
    return (float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0) if len(array) else (0.0, 0.0)
