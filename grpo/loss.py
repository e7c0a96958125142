"""The GRPO loss (ms-swift / TRL), its aggregators and the statistics the learner logs. Pure: tensors in,
tensors out.

Per completion token t of sequence i, with advantage A_i:
    w_t   = exp(logp_t - old_logp_t)                        importance ratio (1 when on-policy)
    L_t   = -min(w_t A_i, clip(w_t, 1 - eps, 1 + eps_high) A_i) + beta * KL_t
    KL_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      k3 estimator, always >= 0
and the ``loss_type`` decides how token losses are averaged (see ``LOSS_NORMALISERS``).
"""

from __future__ import annotations

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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped GRPO objective over (B, T) per-token log-probs, as ms-swift computes it.

    Returns (scalar loss, stats: kl, clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, and
    rollout_is/mean when a rollout IS mode is active). The stats are 0-dim tensors on the loss's device: reading
    one is a device sync, so the learner reads a whole optimizer step's at once (``host_stats``).
    ``entropy_mask`` (0/1, from ``high_entropy_mask``) zeroes the loss of low-entropy tokens without changing
    the normaliser or the stats, as TRL/ms-swift's top_entropy_quantile.
    """
    if loss_type not in LOSS_NORMALISERS:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_NORMALISERS)}, got {loss_type!r}")
    if rollout_is_mode is not None and rollout_is_mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is_mode must be one of {sorted(ROLLOUT_IS_MODES)} or None, got {rollout_is_mode!r}")
    if rollout_is_mode is not None and rollout_logps is None:
        raise ValueError(f"rollout_is_mode={rollout_is_mode!r} needs rollout_logps (the engine's sampled-token log-probs)")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (a reference model); set beta = 0 to train without KL")
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
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    if delta is not None:  # two-sided clipping (TRL): cap the unclipped branch too
        ratio = torch.clamp(ratio, max=delta)
    adv = advantages.to(logps.dtype).unsqueeze(-1)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        x = torch.clamp(ref_logps - logps, -20.0, 20.0)
        kl = torch.clamp(torch.exp(x) - x - 1, -10.0, 10.0)  # k3, clamped as ms-swift
        per_token = per_token + beta * kl
    is_weight = None
    if rollout_is_mode is not None:
        with torch.no_grad():
            log_r = torch.clamp(old.detach() - rollout_logps, -20.0, 20.0)
            rho = torch.exp(_masked_row_mean(log_r, mask))
            is_weight = ROLLOUT_IS_MODES[rollout_is_mode](torch.exp(log_r), rho, rollout_is_threshold)
        per_token = per_token * is_weight  # ms-swift weights the KL term too (TRL only the surrogate)
    if entropy_mask is not None:
        per_token = per_token * entropy_mask.to(per_token.dtype)
    loss = LOSS_NORMALISERS[loss_type](
        per_token, mask, max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch
    )

    with torch.no_grad():
        tokens = mask.sum().clamp(min=1.0)
        raw_ratio = torch.exp(log_w)
        low = ((raw_ratio < 1 - eps_low) & (adv < 0)).to(mask.dtype)
        high = ((raw_ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)
        stats = {
            "kl": (kl * mask).sum() / tokens if kl is not None else tokens.new_zeros(()),
            "clip_ratio/low_mean": (low * mask).sum() / tokens,
            "clip_ratio/high_mean": (high * mask).sum() / tokens,
            "clip_ratio/region_mean": ((low + high).clamp(max=1) * mask).sum() / tokens,
        }
        if is_weight is not None:
            stats["rollout_is/mean"] = (is_weight * mask).sum() / tokens
    return loss, stats


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
}


def mean_std(values: list[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=np.float64)
    return (float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0) if len(array) else (0.0, 0.0)
