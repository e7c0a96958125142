"""Learner: GRPO on whole generation batches, then publish the new weights.

It collects ``prompt_batch_size`` TrainGroups (one generation batch), drops groups older than
``max_staleness``, shuffles the records (seed ``run.seed + version``) and trains on them as ms-swift does:
``num_iterations`` passes of ``steps_per_generation`` mini-batches of ``per_device_train_batch_size``
trajectories, an optimizer step every ``gradient_accumulation_steps`` mini-batches (the count carries over
generation batches). A step whose loss or gradient norm is NaN/inf is skipped (``nan_skipped``); three in a
row stop the learner with a checkpoint and an error. Then ``policy_version += 1``: the weights are written
as a safetensors snapshot (temp dir, then rename) and announced with ``WeightsPublished`` (a batch whose
steps were all skipped writes no snapshot: it announces the unchanged one). Every ``save_steps`` optimizer
steps, at the end, and on a graceful stop (SIGTERM: ``drain``) a checkpoint is written
(``stages/checkpoint.py``); ``restore`` continues from one.

The loss (ms-swift / TRL GRPO), per completion token t of sequence i, with advantage A_i:
    w_t   = exp(logp_t - old_logp_t)                        importance ratio (1 when on-policy)
    L_t   = -min(w_t A_i, clip(w_t, 1 - eps, 1 + eps_high) A_i) + beta * KL_t
    KL_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      k3 estimator, always >= 0
and the ``loss_type`` decides how token losses are averaged (see ``LOSS_NORMALISERS``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from pipeline import log, metrics
from pipeline.edges import FEEDBACK, WEIGHTS
from pipeline.errors import SetupError, UserError
from pipeline.media import ImageCache
from pipeline.records import Feedback, FeederPosition, LearnerCommand, TrainGroup, WeightsPublished
from pipeline.stage import FatalStageError, Handled
from stages import checkpoint as checkpoints
from stages import learner_dist
from stages.advantage import compute_advantages, kl_penalized_rewards
from stages.feeder import optimizer_steps_per_batch

# ----------------------------------------------------------------------------- loss core (pure)


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


def sync_ref_model(ref_model: torch.nn.Module, model: torch.nn.Module, alpha: float) -> None:
    """TRL's SyncRefModelCallback: ref = alpha * policy + (1 - alpha) * ref, parameter by parameter."""
    with torch.no_grad():
        for ref, policy in zip(ref_model.parameters(), model.parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(policy.detach().to(ref.dtype), alpha=alpha)


# ----------------------------------------------------------------------------- batches and log-probs


class Batch:
    """Padded tensors for a list of scored trajectories: prompts left-padded, completions right-padded,
    so every completion starts at the same column and its logits are the last ``T + 1`` positions."""

    def __init__(
        self, records: list[Any], advantages: list[float], pad_id: int, loss_weights: list[float] | None = None,
        vision: VisionInputs | None = None, learner_version: int | None = None, device: torch.device | str = "cpu",
    ) -> None:
        prompts = [r.trajectory.prompt_token_ids() for r in records]
        completions = [r.trajectory.completion_token_ids() for r in records]
        loss_masks = [r.trajectory.completion_loss_mask() for r in records]
        engine_logps = [r.trajectory.completion_logprobs() for r in records]
        width_p = max(len(p) for p in prompts)
        width_c = max(1, max(len(c) for c in completions))
        rows = len(records)
        ids = np.full((rows, width_p + width_c), pad_id, dtype=np.int64)
        attention = np.zeros((rows, width_p + width_c), dtype=np.int64)
        mask = np.zeros((rows, width_c), dtype=np.float32)
        rollout = np.zeros((rows, width_c), dtype=np.float32)  # padding is masked out of every use
        for i, (p, c, m, lp) in enumerate(zip(prompts, completions, loss_masks, engine_logps)):
            ids[i, width_p - len(p) : width_p] = p
            ids[i, width_p : width_p + len(c)] = c
            attention[i, width_p - len(p) : width_p + len(c)] = 1
            mask[i, : len(c)] = m[: len(c)]
            rollout[i, : min(len(c), len(lp))] = lp[: len(c)]
        if loss_weights is not None:  # overlong_filter: a truncated completion is in the stats, not the loss
            mask *= np.asarray(loss_weights, dtype=np.float32)[:, None]
        self.row_tokens = mask.sum(axis=1, dtype=np.float64)  # on the host: counting them needs no device sync
        self.input_ids = torch.from_numpy(ids)
        self.attention_mask = torch.from_numpy(attention)
        self.position_ids = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)
        self.completion_ids = self.input_ids[:, width_p:]
        self.completion_mask = torch.from_numpy(mask)
        self.rollout_logps = torch.from_numpy(rollout)  # the engine's (behaviour policy's) log-probs
        # Rows sampled entirely with the weights the learner holds now: there the engine's and the learner's
        # log-probs must agree (sampling/sampling_logp_difference). None: unknown, no row counts.
        self.same_version = torch.tensor(
            [float(learner_version is not None and r.trajectory.policy_version == learner_version
                   and r.trajectory.max_policy_version == learner_version) for r in records], dtype=torch.float32)
        # Image-prompt models: pixel_values, image_grid_thw and mm_token_type_ids of these rows (None: text).
        self.vision = vision.for_rows(records, self.input_ids) if vision is not None else None
        self.vision_inputs = vision  # for the padding-free path, which lays the images out per packed row
        self.row_images = [list(r.trajectory.images) for r in records]
        self.advantages = torch.tensor(advantages, dtype=torch.float32)
        self.device = torch.device(device)
        if self.device.type != "cpu":  # built on the host, copied over once per mini-batch
            for name in ("input_ids", "attention_mask", "position_ids", "completion_mask", "rollout_logps",
                         "same_version", "advantages"):
                setattr(self, name, getattr(self, name).to(self.device, non_blocking=True))
            self.completion_ids = self.input_ids[:, width_p:]
            if self.vision is not None:
                self.vision = {k: v.to(self.device) for k, v in self.vision.items()}
        self.width_c = width_c
        # Unpadded rows, for the padding-free path: prompt + completion tokens, and where the completion starts.
        self.sequences = [list(p) + list(c) for p, c in zip(prompts, completions)]
        self.prompt_lengths = [len(p) for p in prompts]

    def __len__(self) -> int:
        return self.input_ids.shape[0]


class VisionInputs:
    """The processed images of a generation batch by content key, and how to lay them out for a mini-batch.

    The prompt ids are the engine's expanded ones (one image token per merged patch), so the model's own
    image processor gives exactly the pixel patches those tokens stand for; ``mm_token_type_ids`` marks the
    image tokens (1) and is 0 over text and completion tokens (transformers 5 requires it with pixels, to
    build the 3-D M-RoPE positions)."""

    def __init__(self, image_processor: Any, image_token_id: int, images: dict[str, bytes]) -> None:
        from pipeline.media import pil_images

        self.image_token_id = image_token_id
        self.merge = getattr(image_processor, "merge_size", 2) ** 2
        self.processed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, data in images.items():
            out = image_processor(images=pil_images([data]), return_tensors="pt")
            self.processed[key] = (out["pixel_values"], out["image_grid_thw"])

    def for_rows(self, records: list[Any], input_ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        keys = [key for r in records for key in r.trajectory.images]
        if not keys:
            return None
        for row, r in enumerate(records):
            tokens = int((input_ids[row] == self.image_token_id).sum())
            expected = sum(int(self.processed[k][1].prod()) // self.merge for k in r.trajectory.images)
            if tokens != expected:
                raise ValueError(
                    f"trajectory {r.trajectory.request_id}: {tokens} image tokens in its prompt ids but its "
                    f"{len(r.trajectory.images)} image(s) make {expected}; the prompt ids must be the engine's expanded ones"
                )
        return {
            "pixel_values": torch.cat([self.processed[k][0] for k in keys]),
            "image_grid_thw": torch.cat([self.processed[k][1] for k in keys]),
            "mm_token_type_ids": (input_ids == self.image_token_id).long(),
        }


def learner_device(spec: str, *, distributed: bool = False) -> torch.device:
    """learner.device as a torch device: "auto" is the first CUDA GPU when torch sees one and the learner is
    one process (the distributed learner trains on CPU over gloo), else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and not distributed else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SetupError(
                f"learner.device={spec!r} but torch sees no CUDA GPU (torch {torch.__version__}); set "
                f'learner.device = "cpu" or "auto"'
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SetupError(
                f"learner.device={spec!r} but torch sees {torch.cuda.device_count()} GPU(s), indices "
                f"0..{torch.cuda.device_count() - 1}"
            )
    return device


def is_vision_model(model_dir: Path) -> bool:
    return "vision_config" in json.loads((Path(model_dir) / "config.json").read_text())


def load_model(model_dir: str | Path, dtype: Any) -> torch.nn.Module:
    """A causal LM, or an image-text-to-text model (Qwen-VL) when the config has a vision tower."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if is_vision_model(Path(model_dir)):
        import pipeline.vl_compat  # noqa: F401  (CPU-only torchvision workaround)

        return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)


def freeze_vision(model: torch.nn.Module, *, freeze_vit: bool, freeze_aligner: bool) -> int:
    """ms-swift's freeze_vit / freeze_aligner on a Qwen-VL model: the vision tower's parameters, and its
    merger (the projector into the language model), stop taking gradients. Returns the parameters frozen."""
    frozen = 0
    for name, param in model.named_parameters():
        if ".visual." not in f".{name}":
            continue
        aligner = "merger" in name
        if (aligner and freeze_aligner) or (not aligner and freeze_vit):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


def language_model_linears(model: torch.nn.Module) -> list[str]:
    """The full names of a VL model's linear layers in its language model (LoRA's "all-linear" there: not the
    vision tower, its merger, or the output head)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".language_model." in f".{name}."]


def temperature_scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 logits / the sampling temperature; at 1.0 no division, which on a 150 k vocabulary is a pass
    over (and a backward through) the largest activation of the step."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def completion_logps(model: torch.nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """log p(completion token) under ``model``, shape (B, T). Logits are divided by the sampling
    temperature first, as TRL/ms-swift do, so the ratio compares like with like."""
    return completion_logps_and_entropy(model, batch, temperature, with_entropy=False)[0]


def completion_logps_and_entropy(
    model: torch.nn.Module, batch: Batch, temperature: float, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``completion_logps`` plus, when asked, the policy's entropy at each completion position,
    H_t = -sum_v p_v log p_v over the temperature-scaled distribution (as ms-swift), without gradient."""
    if batch.vision is not None:  # the model builds its 3-D M-RoPE positions from the images and the mask
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=batch.width_c + 1,
                    use_cache=False, **batch.vision)
    else:
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.width_c + 1,
            use_cache=False,
        )
    log_probs = torch.log_softmax(temperature_scaled(out.logits[:, :-1, :], temperature), dim=-1)
    logps = log_probs.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logps, entropy


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


def packed_completion_logps_and_entropy(
    model: torch.nn.Module, batch: Batch, rows: list[int], temperature: float, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``completion_logps_and_entropy`` for ``rows`` of ``batch``, computed padding-free: the rows are
    concatenated into one sequence whose position ids restart at 0 for each row, which transformers turns
    into a block-diagonal causal mask (no attention across rows). Only the logits that predict completion
    tokens are computed. Returns (len(rows), T) tensors laid out as the padded path's (0 at padding)."""
    width = batch.width_c
    ids: list[int] = []
    positions: list[int] = []
    sources: list[int] = []  # index in the packed sequence of the logit that predicts each completion token
    slots: list[int] = []  # where that token sits in the (rows, T) layout
    for k, i in enumerate(rows):
        sequence, start = batch.sequences[i], batch.prompt_lengths[i]
        offset = len(ids)
        ids += sequence
        positions += range(len(sequence))
        sources += range(offset + start - 1, offset + len(sequence) - 1)
        slots += range(k * width, k * width + len(sequence) - start)
    device = batch.device
    input_ids, keep, position_ids, slot_index = long_tensors([ids, sources, positions, slots], device)
    input_ids, position_ids = input_ids.unsqueeze(0), position_ids.unsqueeze(0)
    if batch.vision is not None:
        vision = packed_vision_inputs(model, batch, rows, torch.tensor([ids], dtype=torch.long))
        out = model(input_ids=input_ids, logits_to_keep=keep, use_cache=False,
                    **{k: v.to(device) for k, v in vision.items()})
    else:
        out = model(
            input_ids=input_ids,
            position_ids=position_ids,
            logits_to_keep=keep,
            use_cache=False,
        )
    log_probs = torch.log_softmax(temperature_scaled(out.logits[0], temperature), dim=-1)
    targets = input_ids[0, keep + 1]
    values = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    index = (slot_index,)
    logps = values.new_zeros(len(rows) * width).index_put(index, values).view(len(rows), width)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            h = -(log_probs.exp() * log_probs).sum(-1)
            entropy = h.new_zeros(len(rows) * width).index_put(index, h).view(len(rows), width)
    return logps, entropy


def long_tensors(lists: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Host int lists as int64 tensors on ``device``. On a GPU: one copy from pinned memory, which does not
    wait for the device (a copy from pageable memory syncs the stream and lets the GPU run dry)."""
    if device.type == "cpu":
        return [torch.tensor(values, dtype=torch.long) for values in lists]
    flat = torch.tensor([v for values in lists for v in values], dtype=torch.long).pin_memory()
    return list(flat.to(device, non_blocking=True).split([len(values) for values in lists]))


def packed_vision_inputs(model: torch.nn.Module, batch: Batch, rows: list[int], input_ids: torch.Tensor) -> dict:
    """Image inputs of a packed (padding-free) sequence of ``rows``: each row's 3-D M-RoPE positions from the
    model's own ``get_rope_index``, concatenated, with plain positions restarting at 0 per row in front
    (transformers' packed layout ``[4, 1, L]``: the first plane marks the rows for the block-diagonal mask)."""
    vision = batch.vision_inputs
    rope = next(m for m in model.modules() if hasattr(m, "get_rope_index") and hasattr(m, "rope_deltas"))
    planes, pixels, grids = [], [], []
    for i in rows:
        sequence = torch.tensor([batch.sequences[i]], dtype=torch.long)
        row_pixels = [vision.processed[k][0] for k in batch.row_images[i]]
        row_grids = [vision.processed[k][1] for k in batch.row_images[i]]
        text = torch.arange(sequence.shape[1])[None, None, :]
        if row_grids:
            three_d, _ = rope.get_rope_index(sequence, mm_token_type_ids=(sequence == vision.image_token_id).long(),
                                             image_grid_thw=torch.cat(row_grids))
        else:
            three_d = text.expand(3, 1, -1)
        planes.append(torch.cat([text, three_d], dim=0))
        pixels += row_pixels
        grids += row_grids
    return {
        "position_ids": torch.cat(planes, dim=-1),
        "pixel_values": torch.cat(pixels),
        "image_grid_thw": torch.cat(grids),
        "mm_token_type_ids": (input_ids == vision.image_token_id).long(),
    }


# A micro-batch's share of its mini-batch's loss, so that summing the micro-batches' (loss * share) gives
# exactly the padded mini-batch's loss: (rows, tokens) of the micro-batch, then of the mini-batch.
MICRO_BATCH_SHARE = {
    "grpo": lambda rows, tokens, all_rows, all_tokens: rows / all_rows,  # a mean over rows
    "bnpo": lambda rows, tokens, all_rows, all_tokens: tokens / max(all_tokens, 1.0),  # a mean over tokens
    "dr_grpo": lambda rows, tokens, all_rows, all_tokens: rows / all_rows,  # a sum / (rows * max length)
    "dapo": lambda rows, tokens, all_rows, all_tokens: 1.0,  # a sum / the generation batch's tokens
}


# ----------------------------------------------------------------------------- weights


def save_weights_atomically(
    model: torch.nn.Module, directory: Path, adapter_only: bool = False, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write ``directory/model.safetensors`` so a reader never sees a half-written snapshot. ``adapter_only``
    (a peft model): the LoRA adapter alone, as peft writes it (adapter_model.safetensors, adapter_config.json).
    ``state``: the weights to write instead of ``model.state_dict()`` (a distributed learner's gathered ones)."""
    from safetensors.torch import save_file

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    if adapter_only:
        model.save_pretrained(str(tmp))
    else:
        state = model.state_dict() if state is None else state
        state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def unused_snapshots(versions: list[int], leased: list[int], keep: str = "") -> list[int]:
    """Pure: the snapshot versions to delete: those older than the oldest version a worker leases
    (``leased``; a dead worker's lease has expired). The newest is always kept (a worker that starts now
    loads it), and so is the directory named ``keep`` (the one being announced). Checkpoints and ``final``
    hold their own copies of the weights, so no snapshot is kept for them."""
    if not versions:
        return []
    floor = min([*leased, max(versions)])
    return sorted(v for v in versions if v < floor and f"v{v:06d}" != keep)


# ----------------------------------------------------------------------------- the stage


def shuffle_order(size: int, seed: int, version: int) -> list[int]:
    """The order in which a generation batch's records are trained: seeded by ``run.seed + version``, so a
    rerun trains the same mini-batches and no mini-batch is always one prompt group (as verifiers does)."""
    return np.random.default_rng(seed + version).permutation(size).tolist()


def needs_old_logps(grpo: Any, records: list[Any], version: int) -> bool:
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


def learner_processes() -> int:
    """Learner processes sharing a generation batch (torch.distributed's world size; 1 when not distributed)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mean_std(values: list[float]) -> tuple[float, float]:
    array = np.asarray(values, dtype=np.float64)
    return (float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0) if len(array) else (0.0, 0.0)


class NonFiniteTrainingError(UserError, FatalStageError):
    """Too many optimizer steps in a row had a NaN/inf loss or gradient norm."""


class Learner:
    name = "learner"
    consumes = ("train",)
    subscribes = ()

    MAX_NAN_IN_A_ROW = 3  # non-finite optimizer steps tolerated in a row before the learner fails

    def __init__(self, cfg: Any, model_dir: Path, output_dir: Path, num_batches: int, on_step: Any = None) -> None:
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.output_dir = Path(output_dir)
        self.num_batches = num_batches
        self.on_step = on_step  # callback(row: dict) for live progress
        self.version = 0
        self.step = 0
        self.batches_trained = 0
        self._waiting: dict[str, TrainGroup] = {}
        self._images = ImageCache()
        self._batch_images: dict[str, bytes] = {}  # the images of the generation batch being trained, by key
        self._trained: set[str] = set()
        self._unacked: list[str] = []  # trained groups no checkpoint covers yet: held, acked at the next one
        self._drops: dict[str, int] = {}  # groups we dropped since the last batch, by reason
        self._stale_samples = 0  # trajectories we dropped for staleness since the last batch
        self._last_publish = time.monotonic()
        self._metrics_file = None
        self._completions_file = None
        self.nan_skipped = 0  # optimizer steps skipped for a non-finite loss or gradient norm
        self._nan_in_a_row = 0
        self._accumulated: list[dict[str, float]] = []  # mini-batch stats since the last optimizer step
        self._accumulated_records: list[Any] = []
        self._step_started = time.monotonic()
        # Checkpoints: resume_from is restored in _load; feeder_position(b) says where the feeder must
        # restart to produce generation batch b (set by graph.run_pipeline, where the feeder lives).
        self.resume_from: checkpoints.Checkpoint | None = None
        self.feeder_position: Callable[[int], FeederPosition | None] | None = None
        self._last_checkpoint_step = 0
        self._last_snapshot: Path | None = None  # the newest weights snapshot written, and its step
        self._snapshot_step = 0
        # Under torchrun (grpo.world_size > 1): this process's place among the learner processes; rank 0
        # runs the worker, the others follow() it (stages/learner_dist.py). None for a single process.
        self.group: learner_dist.LearnerGroup | None = None
        self.device = torch.device("cpu")  # learner.device, resolved in _load
        self._ref_thread: concurrent.futures.ThreadPoolExecutor | None = None  # set in _load
        # One collective step at a time: the resume announcement (source) and training (handle) both run
        # in threads, and ranks must take the same steps in the same order.
        self._collective_lock = threading.RLock()

    async def start(self, ctx: Any) -> None:
        await asyncio.to_thread(self._load)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # Open for the stage's lifetime (closed in close()); line-buffered, so a kill loses no whole row.
        self._metrics_file = open(self.output_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115, ASYNC230
        self._completions_file = open(self.output_dir / "completions.jsonl", "a", buffering=1)  # noqa: SIM115, ASYNC230
        self._run = ctx.run
        self._last_publish = time.monotonic()

    def _load(self) -> None:
        from transformers import AutoTokenizer

        learner_dist.check_world_size(self.cfg)
        if learner_dist.processes_from_env() > 1:
            self.group = learner_dist.LearnerGroup()
        torch.set_num_threads(self.cfg.learner.torch_threads)
        torch.manual_seed(self.cfg.run.seed)
        dtype = getattr(torch, self.cfg.model.torch_dtype)
        self.device = learner_device(self.cfg.learner.device, distributed=self.group is not None)
        self.model = load_model(self.model_dir, dtype).to(self.device)
        lc = self.cfg.learner
        self.vision = is_vision_model(self.model_dir)
        self.image_processor = None
        if self.vision:
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(str(self.model_dir))
            self.image_token_id = self.model.config.image_token_id
            freeze_vision(self.model, freeze_vit=getattr(lc, "freeze_vit", True),
                          freeze_aligner=getattr(lc, "freeze_aligner", True))
        self.lora = lc.train_type == "lora"
        if self.lora:
            from peft import LoraConfig, get_peft_model

            targets = "all-linear" if lc.target_modules == ["all-linear"] else list(lc.target_modules)
            if self.vision and targets == "all-linear":  # as ms-swift: the language model only, by default
                targets = language_model_linears(self.model)
            self.model = get_peft_model(
                self.model,
                LoraConfig(r=lc.lora_rank, lora_alpha=lc.lora_alpha, lora_dropout=lc.lora_dropout,
                           target_modules=targets, task_type="CAUSAL_LM"),
            )
        self.model.train()
        if self.cfg.learner.gradient_checkpointing:  # recompute activations in backward: memory for time
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.ref_model = None  # under LoRA the reference is the base model: the policy with its adapter disabled
        if self.cfg.grpo.beta != 0.0 and not self.lora:
            ref_dir = self.cfg.learner.ref_model or str(self.model_dir)
            self.ref_model = load_model(ref_dir, dtype).to(self.device).eval()
            self.ref_model.requires_grad_(False)
        # The frozen reference model's passes run in their own thread, beside the policy's old-log-prob
        # passes (on another core when one is free). Not distributed: its forward passes are collectives,
        # which every rank must call in the same order.
        self._ref_thread = (
            concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ref-pass")
            if self.ref_model is not None and self.group is None
            else None
        )
        if self.resume_from is not None:  # whole weights, before sharding: any number of processes can resume
            self._restore_weights(self.resume_from.path)
        if self.group is not None:
            self.group.shard(self.model)
            if self.ref_model is not None:  # sharded alike, so sync_ref_model mixes matching shards
                self.group.shard(self.ref_model)
        trained = [p for p in self.model.parameters() if p.requires_grad]  # the adapter alone under LoRA
        self.optimizer = torch.optim.AdamW(
            trained,
            lr=lc.learning_rate,
            betas=(lc.adam_beta1, lc.adam_beta2),
            eps=lc.adam_epsilon,
            weight_decay=lc.weight_decay,
            # One fused kernel per step instead of a loop of foreach ops: the same update, measured here at
            # 1 thread 5.7 -> 0.6 ms (tiny, 0.4 M) and 190 -> 34 ms (mid, 18 M) per step. Not for a sharded
            # (distributed) learner, whose parameters are its own shards.
            fused=self.group is None and all(p.device.type in ("cpu", "cuda") for p in trained),
        )
        total = max(1, self.num_batches * optimizer_steps_per_batch(self.cfg.grpo))
        warmup = int(lc.warmup_ratio * total)
        kind = lc.lr_scheduler_type

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, total - warmup)
            if kind == "linear":
                return max(0.0, 1.0 - progress)
            if kind == "cosine":
                return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
            return 1.0

        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, factor)
        if self.resume_from is not None:
            self.restore(self.resume_from)

    async def close(self) -> None:
        if self._ref_thread is not None:
            self._ref_thread.shutdown()
        for f in (self._metrics_file, self._completions_file):
            if f is not None:
                f.close()
        if self.group is not None:  # the followers exit with rank 0
            with self._collective_lock:
                self._command("stop")
            self.group.close()

    async def drain(self, ctx: Any) -> Handled:
        """SIGTERM: checkpoint what was trained since the last checkpoint, so the groups it covers are acked
        now and ``--resume`` retrains nothing (with save_steps = 0 there is otherwise no checkpoint to resume
        from). Not with gradients accumulated across a batch boundary, which a checkpoint does not hold: the
        groups then stay held, as after a kill, and are retrained from the last checkpoint."""
        if self.step == self._last_checkpoint_step or self._accumulated:
            return Handled()
        await asyncio.to_thread(self.save_checkpoint)
        released, self._unacked = self._unacked, []
        return Handled(release=released)

    async def source(self, ctx: Any) -> AsyncIterator[list]:
        """After a resume, announce the restored weights once: the rollout loads them and the feeder's
        admission control sees the restored version (a fresh transport has no weights record yet)."""
        if self.resume_from is None:
            return
        path = await asyncio.to_thread(self._write_snapshot)
        self._last_snapshot, self._snapshot_step = path, self.step
        yield [(WEIGHTS, WeightsPublished(version=self.version, path=str(path), step=self.step, published_at=time.time()))]

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path | None:
        """``checkpoint-<step>``: everything ``restore`` needs to continue exactly (see stages/checkpoint.py).
        Taken between generation batches, so no mini-batch is half-trained. Distributed: a collective step
        (the weights and optimizer state are gathered whole); rank 0 writes it, the others return None.
        The optimizer state is keyed by parameter name, so any number of processes can resume from it."""
        with self._collective_lock:
            self._command("checkpoint")
            return self._save_checkpoint()

    def _save_checkpoint(self) -> Path | None:
        from safetensors.torch import save_file, save_model
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        moving_ref = self.ref_model is not None and self.cfg.learner.sync_ref_model
        if self.group is None:
            model_state = ref_state = None  # save_model writes the module itself
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer)
        else:
            model_state = self.group.full_model_state(self.model)
            ref_state = self.group.full_model_state(self.ref_model) if moving_ref else None
            optimizer_state = self.group.full_optimizer_state(self.model, self.optimizer)
            if not self.group.leader:
                return None

        def write(directory: Path) -> None:
            for name, module, state in (("model", self.model, model_state), ("ref_model", self.ref_model, ref_state)):
                if name == "ref_model" and not moving_ref:
                    continue
                if state is None:
                    save_model(module, str(directory / f"{name}.safetensors"))
                else:
                    save_file(state, str(directory / f"{name}.safetensors"), metadata={"format": "pt"})
            torch.save(optimizer_state, directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
            torch.save(checkpoints.rng_states(), directory / "rng_state.pth")

        position = self.feeder_position(self.batches_trained) if self.feeder_position is not None else None
        state = {
            "policy_version": self.version,
            "batches_trained": self.batches_trained,
            "nan_skipped": self.nan_skipped,
            "nan_in_a_row": self._nan_in_a_row,
            # Trained groups this checkpoint covers that are acked right after it is written: a kill in
            # between redelivers them, and the resumed learner acks them without training them again.
            "unacked_group_ids": list(self._unacked),
            "feeder_position": msgspec.to_builtins(position) if position is not None else None,
            # What the jsonl files held at this point: a resume cuts off rows written after it.
            "metrics_bytes": self._metrics_file.tell() if self._metrics_file is not None else None,
            "completions_bytes": self._completions_file.tell() if self._completions_file is not None else None,
        }
        path = checkpoints.save(self.output_dir, self.step, state, write, self.cfg.learner.save_total_limit)
        self._last_checkpoint_step = self.step
        log.get(stage="learner").info("checkpoint", path=str(path), step=self.step, version=self.version)
        return path

    def _restore_weights(self, path: Path) -> None:
        """A checkpoint's whole weights (and moving reference), loaded before the model is sharded."""
        from safetensors.torch import load_model

        load_model(self.model, str(path / "model.safetensors"))
        if (path / "ref_model.safetensors").is_file() and self.ref_model is not None:
            load_model(self.ref_model, str(path / "ref_model.safetensors"))

    def restore(self, checkpoint: checkpoints.Checkpoint) -> None:
        """Load the rest of a checkpoint into this learner (its weights went in before sharding, in _load):
        optimizer, scheduler, RNGs, counters; the jsonl files are cut back to their length at save time."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        path, state = checkpoint.path, checkpoint.state
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        if all(isinstance(p, int) for group in optimizer_state["param_groups"] for p in group["params"]):
            self.optimizer.load_state_dict(optimizer_state)  # keyed by position: an older single-process one
        elif self.group is None:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state)
        else:
            self.group.load_optimizer_state(self.model, self.optimizer, optimizer_state)
        for group in self.optimizer.param_groups:  # the checkpoint's flag came with its groups: back to ours
            group["fused"] = self.optimizer.defaults["fused"]
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True, map_location="cpu"))
        checkpoints.set_rng_states(torch.load(path / "rng_state.pth", weights_only=True, map_location="cpu"))
        self.version = state["policy_version"]
        self.step = state["step"]
        self.batches_trained = state["batches_trained"]
        self.nan_skipped = state["nan_skipped"]
        self._nan_in_a_row = state["nan_in_a_row"]
        self._trained = set(state.get("unacked_group_ids", []))
        self._last_checkpoint_step = self.step
        for name in ("metrics", "completions"):
            if self.group is not None and not self.group.leader:
                break  # rank 0 owns the run's files
            size, file = state.get(f"{name}_bytes"), self.output_dir / f"{name}.jsonl"
            if size is not None and file.is_file() and file.stat().st_size > size:
                os.truncate(file, size)

    def _checkpoint_due(self, done: bool) -> bool:
        """At the end, and at the first generation-batch boundary at or after every save_steps-th optimizer
        step (never with gradients accumulated across the boundary: those are not in the checkpoint)."""
        if self._accumulated and not done:
            return False
        every = self.cfg.learner.save_steps
        crossed = every > 0 and self.step // every > self._last_checkpoint_step // every
        return done or crossed

    async def handle(self, group: TrainGroup, ctx: Any) -> Handled:
        if not isinstance(group, TrainGroup):
            raise TypeError(f"learner got {type(group).__name__}, expected TrainGroup")
        if group.group_id in self._trained or group.group_id in self._waiting:
            return Handled()  # a redelivery: never train a group twice
        stale = self._staleness(group) > self.cfg.grpo.max_staleness
        if stale:
            self._count_stale(group, ctx)
            self._trained.add(group.group_id)
            return Handled(outputs=[(FEEDBACK, self._feedback(group, "dropped", "staleness"))])
        self._waiting[group.group_id] = group
        if len(self._waiting) < self.cfg.grpo.prompt_batch_size or ctx.stopping:
            return Handled(hold=True)
        return await self._train_and_publish(ctx)

    def _count_stale(self, group: TrainGroup, ctx: Any) -> None:
        metrics.STALE_DROPPED.labels(ctx.run).inc(len(group.records))
        metrics.GROUPS_DROPPED.labels(ctx.run, "staleness").inc()
        self._drops["staleness"] = self._drops.get("staleness", 0) + 1
        self._stale_samples += len(group.records)

    def _drop_metrics(self, batch: list[TrainGroup]) -> dict[str, int]:
        """Groups dropped since the previous batch, by reason (advantage's and ours), for metrics.jsonl."""
        drops = dict(self._drops)
        for group in batch:
            for reason, count in group.drops.items():
                drops[reason] = drops.get(reason, 0) + count
        row = {f"dropped/{reason}": drops.get(reason, 0) for reason in ("zero_std", "reward_error", "staleness")}
        row.update({f"dropped/{reason}": count for reason, count in drops.items()})
        row["resample/count"] = sum(drops.values())  # every dropped group was replaced by the feeder
        row["staleness/dropped"] = self._stale_samples
        self._drops, self._stale_samples = {}, 0
        return row

    def _staleness(self, group: TrainGroup) -> int:
        return self.version - min(r.trajectory.policy_version for r in group.records)

    def _feedback(self, group: TrainGroup, outcome: str, reason: str = "") -> Feedback:
        return Feedback(
            prompt_id=group.prompt_id,
            attempt=group.attempt,
            generation_batch=group.generation_batch,
            outcome=outcome,
            reason=reason,
            learner_version=self.version,
        )

    async def _train_and_publish(self, ctx: Any) -> Handled:
        outputs: list = []
        released: list[str] = []  # held inputs acked with these outputs
        # Oldest generation batches first; re-check staleness now that the version may have moved.
        candidates = sorted(self._waiting.values(), key=lambda g: (g.generation_batch, g.group_id))
        batch: list[TrainGroup] = []
        for group in candidates:
            if self._staleness(group) > self.cfg.grpo.max_staleness:
                del self._waiting[group.group_id]
                self._trained.add(group.group_id)
                self._count_stale(group, ctx)
                outputs.append((FEEDBACK, self._feedback(group, "dropped", "staleness")))
                released.append(group.group_id)
            elif len(batch) < self.cfg.grpo.prompt_batch_size:
                batch.append(group)
        if len(batch) < self.cfg.grpo.prompt_batch_size:
            # Stale groups were dropped (the feeder replaces them): wait for the replacements.
            return Handled(outputs=outputs, hold=True, release=released)
        for group in batch:
            del self._waiting[group.group_id]
            self._trained.add(group.group_id)
        keys = list(dict.fromkeys(k for g in batch for r in g.records for k in r.trajectory.images))
        self._batch_images = dict(zip(keys, await self._images.get(ctx, keys))) if keys else {}
        try:
            rows = await asyncio.to_thread(self._train_batch, batch)
        except NonFiniteTrainingError as exc:
            # Keep what the run reached (the weights of the last good step) so it can go on from there.
            path = await asyncio.to_thread(self.save_checkpoint)
            raise NonFiniteTrainingError(f"{exc}. Checkpoint of the last good step: {path}") from None
        if rows:  # counted once per generation batch, on its first optimizer-step row
            rows[0].update(self._drop_metrics(batch))
        self.version += 1
        self.batches_trained += 1
        done = self.batches_trained >= self.num_batches or (0 < self.cfg.run.max_steps <= self.step)
        leased = list((await ctx.leases(WEIGHTS)).values())  # the versions rollout workers still use
        path = await asyncio.to_thread(self._publish, done, leased)
        metrics.LEARNER_VERSION.labels(ctx.run).set(self.version)
        for row in rows:
            row["policy_version"] = self.version
            self._metrics_file.write(json.dumps(row) + "\n")
            if self.on_step is not None:
                self.on_step(row)
        self._log_completions(batch)
        self._unacked += [g.group_id for g in batch]
        checkpointed = self._checkpoint_due(done)
        if checkpointed:
            await asyncio.to_thread(self.save_checkpoint)
        published = WeightsPublished(
            version=self.version, path=str(path), step=self.step, published_at=time.time(), final=done
        )
        outputs.append((WEIGHTS, published))
        outputs += [(FEEDBACK, self._feedback(g, "trained")) for g in batch]
        if done:
            ctx.request_stop(
                f"trained {self.batches_trained} generation batches, {self.step} optimizer steps", run_finished=True
            )
        # A trained TrainGroup is acked only once a checkpoint covers it (with learner.save_steps > 0): until
        # then it stays pending, held by this worker. A learner killed after checkpoint C resumes from C, and
        # the transport redelivers exactly the groups it trained after C (their training died with it) plus
        # those it had not trained yet; a group C covers whose ack the kill prevented is listed in C
        # (unacked_group_ids) and acked without training. Acking each batch at once instead would lose
        # the groups trained after C: acked, but their training gone from the resumed weights.
        if checkpointed or self.cfg.learner.save_steps == 0:
            released += self._unacked
            self._unacked = []
            return Handled(outputs=outputs, release=released)
        return Handled(outputs=outputs, hold=True, release=released)

    # ------------------------------------------------------------------ training (runs in a thread)

    def _train_batch(self, groups: list[TrainGroup]) -> list[dict[str, Any]]:
        """Train one generation batch (a collective step when distributed: every rank gets the groups and
        trains its rows of each global mini-batch)."""
        with self._collective_lock:
            self._command("train", groups)
            return self._train_generation_batch(groups)

    def _train_generation_batch(self, groups: list[TrainGroup]) -> list[dict[str, Any]]:
        g = self.cfg.grpo
        records = [r for group in groups for r in group.records]
        advantages = [a for group in groups for a in group.advantages]
        weights = [w for group in groups for w in (group.loss_weights or [1.0] * len(group.records))]
        order = shuffle_order(len(records), self.cfg.run.seed, self.version)
        records, advantages = [records[i] for i in order], [advantages[i] for i in order]
        weights = [weights[i] for i in order]
        staleness = [self.version - r.trajectory.policy_version for r in records]
        # A global mini-batch is per_device_train_batch_size * world_size rows (ms-swift); this process
        # trains its per_device_train_batch_size of them.
        size = g.per_device_train_batch_size
        global_size = size * g.world_size
        mine = self.group.rows(size) if self.group is not None else slice(0, size)
        if self.vision and self.group is not None and any(r.trajectory.images for r in records):
            raise ValueError("a distributed learner (grpo.world_size > 1) does not take image prompts yet")
        vision = (VisionInputs(self.image_processor, self.image_token_id, self._batch_images)
                  if self.vision and self._batch_images else None)
        minibatches = [
            Batch(records[i : i + global_size][mine], advantages[i : i + global_size][mine], self.pad_id,
                  weights[i : i + global_size][mine], vision=vision, learner_version=self.version, device=self.device)
            for i in range(0, len(records), global_size)
        ]
        for s in staleness:
            metrics.STALENESS.labels(self._run).observe(s)
        kl_in_reward = g.kl_in_reward and g.beta != 0.0
        # Started first, so they run while this thread takes the old-log-prob passes; all are in before the
        # first optimizer step, which may move the reference (sync_ref_model).
        ref_passes = (
            [self._ref_thread.submit(self._ref_logps, mb) for mb in minibatches]
            if g.beta != 0.0 and self._ref_thread is not None
            else None
        )
        with torch.no_grad():
            if kl_in_reward:
                old = [self._logps(self.model, mb) for mb in minibatches]
            elif needs_old_logps(g, records, self.version):
                # The first mini-batch trains on the weights the batch starts from: its training forward
                # gives its old log-probs (ratio 1), so that pass is skipped. Not with several iterations,
                # whose later passes need the start's log-probs again.
                first = [None] if g.num_iterations == 1 else []
                old = first + [self._logps(self.model, mb) for mb in minibatches[len(first):]]
            else:
                old = None
            if ref_passes is not None:
                ref = [future.result() for future in ref_passes]
            else:
                ref = [self._ref_logps(mb) for mb in minibatches] if g.beta != 0.0 else None
            if kl_in_reward:  # the KL moves from the loss into the rewards, then the advantages are redone
                kl_mean = self._penalize_rewards_by_kl(records, minibatches, old, ref)
        # dapo divides by the completion tokens of the whole generation batch, per learner process (TRL's
        # num_items_in_batch / num_processes), so every mini-batch's tokens weigh the same.
        tokens = sum(float(mb.row_tokens.sum()) for mb in minibatches)
        if self.group is not None:  # this rank's mini-batches hold its rows only
            tokens = self.group.sum(tokens)
        num_items_in_batch = tokens / learner_processes()
        rows: list[dict[str, Any]] = []
        for _ in range(g.num_iterations):
            for index, mb in enumerate(minibatches):
                stats = self._minibatch_backward(
                    mb,
                    old[index] if old is not None else None,
                    ref[index] if ref is not None and not kl_in_reward else None,
                    beta=0.0 if kl_in_reward else g.beta,
                    num_items_in_batch=max(num_items_in_batch, 1.0),
                )
                if self.group is not None:  # the whole mini-batch's stats, the same on every rank
                    stats = self.group.reduce_stats(host_stats([stats])[0], float(mb.row_tokens.sum()))
                if kl_in_reward:
                    stats["kl"] = kl_mean  # as ms-swift: the mean per-sequence KL that entered the rewards
                # The accumulation carries over generation batches (as ms-swift) when
                # gradient_accumulation_steps > steps_per_generation * num_iterations.
                self._accumulated.append(stats)
                self._accumulated_records += records[index * global_size : (index + 1) * global_size]
                if len(self._accumulated) < g.gradient_accumulation_steps:
                    continue
                rows.append(self._optimizer_step(staleness))
                if 0 < self.cfg.run.max_steps <= self.step:
                    return rows
        return rows

    @torch.no_grad()  # no_grad is per thread, and this may run in the reference passes' thread
    def _ref_logps(self, mb: Batch) -> torch.Tensor:
        if self.lora:
            with self.model.disable_adapter():
                return self._logps(self.model, mb)
        return self._logps(self.ref_model, mb)

    def _logps(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """(B, T) completion log-probs of a mini-batch (old or reference pass), padding-free under
        learner.max_tokens_per_batch."""
        budget, temperature = self.cfg.learner.max_tokens_per_batch, self.cfg.grpo.temperature
        if budget is None:
            return completion_logps(model, mb, temperature)
        groups = token_budget_micro_batches([len(seq) for seq in mb.sequences], budget)
        return torch.cat([packed_completion_logps_and_entropy(model, mb, rows, temperature, False)[0] for rows in groups])

    def _minibatch_backward(
        self, mb: Batch, old: torch.Tensor | None, ref: torch.Tensor | None, *, beta: float, num_items_in_batch: float
    ) -> dict[str, float]:
        """Forward, loss and backward of one mini-batch (gradients scaled by 1 / gradient_accumulation_steps).

        Padded: one forward over the (B, T) batch. With ``learner.max_tokens_per_batch``: padding-free
        micro-batches within the token budget, each backpropagated on its own (activations of one at a
        time), with its loss scaled by its share of the mini-batch (``MICRO_BATCH_SHARE``) so the summed
        loss and gradients are the padded path's. Returns the mini-batch's stats (device tensors among them: read
        them with ``host_stats``)."""
        g = self.cfg.grpo
        budget = self.cfg.learner.max_tokens_per_batch
        groups = (
            [list(range(len(mb)))]
            if budget is None
            else token_budget_micro_batches([len(seq) for seq in mb.sequences], budget)
        )
        top_entropy = g.top_entropy_quantile < 1.0
        all_tokens = float(mb.row_tokens.sum())
        totals: dict[str, Any] = {}  # floats and 0-dim device tensors, read at the optimizer step (host_stats)
        for rows in groups:
            # All rows (the padded path): a slice, no index tensor to copy to the device.
            select = slice(None) if len(rows) == len(mb) else long_tensors([rows], mb.device)[0]
            mask = mb.completion_mask[select]
            if budget is None:
                logps, entropy = completion_logps_and_entropy(
                    self.model, mb, g.temperature, with_entropy=g.log_entropy or top_entropy
                )
            else:
                logps, entropy = packed_completion_logps_and_entropy(
                    self.model, mb, rows, g.temperature, with_entropy=g.log_entropy or top_entropy
                )
            loss, stats = policy_loss(
                logps,
                old[select] if old is not None else None,
                ref[select] if ref is not None else None,
                mb.advantages[select],
                mask,
                loss_type=g.loss_type,
                epsilon=g.epsilon,
                epsilon_high=g.epsilon_high,
                delta=g.delta,
                beta=beta,
                importance_sampling_level=g.importance_sampling_level,
                max_completion_length=g.max_completion_length,
                num_items_in_batch=num_items_in_batch,
                rollout_logps=mb.rollout_logps[select] if g.rollout_importance_sampling_mode is not None else None,
                rollout_is_mode=g.rollout_importance_sampling_mode,
                rollout_is_threshold=g.rollout_importance_sampling_threshold,
                entropy_mask=high_entropy_mask(entropy, mask, g.top_entropy_quantile) if top_entropy else None,
            )
            # TRL's sampling/sampling_logp_difference: |engine - learner| log-prob of the sampled tokens, over rows
            # sampled with the weights held now (``old``, or this forward when nothing moved them since).
            with torch.no_grad():
                current = old[select] if old is not None else logps.detach()
                check = mask * mb.same_version[select].unsqueeze(-1)
                diff = (current - mb.rollout_logps[select]).abs() * check
                totals["logp_diff_sum"] = totals.get("logp_diff_sum", 0.0) + diff.sum()
                totals["logp_diff_tokens"] = totals.get("logp_diff_tokens", 0.0) + check.sum()
                if diff.numel():
                    totals["logp_diff_max"] = torch.maximum(totals.get("logp_diff_max", diff.new_zeros(())), diff.max())
            tokens = float(mb.row_tokens[rows].sum())
            share = MICRO_BATCH_SHARE[g.loss_type](len(rows), tokens, len(mb), all_tokens)
            (loss * share / g.gradient_accumulation_steps).backward()
            # Token-mean stats combine by token counts; the loss by its share.
            totals["loss"] = totals.get("loss", 0.0) + loss.detach() * share
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value * tokens / max(all_tokens, 1.0)
            if entropy is not None and g.log_entropy:
                totals["entropy_sum"] = totals.get("entropy_sum", 0.0) + (entropy * mask).sum()
                totals["entropy_tokens"] = totals.get("entropy_tokens", 0.0) + tokens
        return totals

    def _penalize_rewards_by_kl(
        self, records: list[Any], minibatches: list[Batch], old: list[torch.Tensor], ref: list[torch.Tensor]
    ) -> float:
        """kl_in_reward: R' = R - beta * KL per request, then the advantages again with the same pure
        functions as the advantage stage (over this generation batch). Returns the mean KL per sequence."""
        g = self.cfg.grpo
        size = g.per_device_train_batch_size
        kl = torch.cat([((o - r) * mb.completion_mask).sum(-1) for o, r, mb in zip(old, ref, minibatches)])
        if self.group is not None:  # every rank's rows, in the generation batch's order
            kl = self.group.gather_rows(kl, size)
        kl = kl.tolist()
        request_ids = [r.trajectory.request_id for r in records]
        rewards = kl_penalized_rewards([r.reward for r in records], kl, request_ids, g.beta)
        advantages = compute_advantages(
            rewards,
            [r.group_id for r in records],
            request_ids,
            scale_rewards=g.scale_rewards,
            estimator=g.advantage_estimator,
        )
        first = self.group.rank * size if self.group is not None else 0
        for index, mb in enumerate(minibatches):
            start = index * size * g.world_size + first  # this rank's rows of global mini-batch `index`
            mb.advantages = torch.tensor(advantages[start : start + size], dtype=torch.float32, device=mb.device)
        return float(np.mean(kl))

    def _optimizer_step(self, staleness: list[int]) -> dict[str, Any]:
        """Clip, step (or skip a non-finite step), and return the metrics row of the accumulated mini-batches."""
        max_norm = self.cfg.learner.max_grad_norm
        self._accumulated = host_stats(self._accumulated)
        if self.group is None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        else:  # the norm over every rank's shard
            grad_norm = self.group.clip_grad_norm(self.model.parameters(), max_norm)
        learning_rate = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(grad_norm) and all(math.isfinite(s["loss"]) for s in self._accumulated)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self._nan_in_a_row = 0
            lc = self.cfg.learner
            if lc.sync_ref_model and self.ref_model is not None and self.step % lc.ref_model_sync_steps == 0:
                sync_ref_model(self.ref_model, self.model, lc.ref_model_mixup_alpha)
        else:
            # A NaN/inf loss or gradient would poison the weights and Adam's moments: drop this step's
            # gradients, keep the weights, and give up if it keeps happening.
            self.nan_skipped += 1
            self._nan_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        now = time.monotonic()
        row = self._row(
            self._accumulated, self._accumulated_records, grad_norm, learning_rate, staleness, now - self._step_started
        )
        row["nan_skipped"] = 0 if finite else 1
        self._step_started = now
        self._accumulated, self._accumulated_records = [], []
        if self._nan_in_a_row >= self.MAX_NAN_IN_A_ROW:
            raise NonFiniteTrainingError(
                f"learner: non-finite loss or gradient norm {self._nan_in_a_row} optimizer steps in a row, the last "
                f"at step {self.step + 1} (policy version {self.version}, {self.nan_skipped} skipped in all); "
                f"the weights are those of step {self.step}. Lower learner.learning_rate or check the advantages"
            )
        return row

    def _row(self, stats: list[dict[str, float]], records: list[Any], grad_norm: float, lr: float, staleness: list[int], seconds: float) -> dict[str, Any]:
        """One metrics.jsonl row with ms-swift's names."""
        g = self.cfg.grpo
        row: dict[str, Any] = {"step": self.step}
        rewards = [r.reward for r in records]
        row["reward"], _ = mean_std(rewards)
        by_group: dict[str, list[float]] = {}
        for r in records:
            by_group.setdefault(r.group_id, []).append(r.reward)
        group_stds = [mean_std(v)[1] for v in by_group.values()]
        row["reward_std"] = float(np.mean(group_stds)) if group_stds else 0.0
        row["frac_reward_zero_std"] = float(np.mean([s < 1e-8 for s in group_stds])) if group_stds else 0.0
        # Every configured function, plus whatever else scored (a reward model is "reward_model").
        names = list(dict.fromkeys([*self.cfg.reward.reward_funcs, *(n for r in records for n in r.rewards)]))
        for name in names:
            values = [r.rewards.get(name) for r in records]
            values = [v for v in values if v is not None and not math.isnan(v)]
            row[f"reward/{name}/mean"], row[f"reward/{name}/std"] = mean_std(values)
        lengths = [len(r.trajectory.completion_ids) // 4 for r in records]
        row["completions/mean_length"] = float(np.mean(lengths))
        row["completions/min_length"] = float(np.min(lengths))
        row["completions/max_length"] = float(np.max(lengths))
        row["completions/clipped_ratio"] = float(np.mean([r.trajectory.is_truncated for r in records]))
        for key in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "loss", "rollout_is/mean"):
            if key in stats[0]:
                row[key] = float(np.mean([s[key] for s in stats]))
        if "entropy_sum" in stats[0]:  # token-weighted over the step's mini-batches
            tokens = sum(s["entropy_tokens"] for s in stats)
            row["entropy/mean"] = sum(s["entropy_sum"] for s in stats) / tokens if tokens else 0.0
        diff_tokens = sum(s.get("logp_diff_tokens", 0.0) for s in stats)
        if diff_tokens:  # only rows sampled with the learner's current weights count (TRL's name)
            row["sampling/sampling_logp_difference/mean"] = sum(s["logp_diff_sum"] for s in stats) / diff_tokens
            row["sampling/sampling_logp_difference/max"] = max(s.get("logp_diff_max", 0.0) for s in stats)
        row["grad_norm"] = grad_norm
        row["learning_rate"] = lr
        row["staleness/mean"] = float(np.mean(staleness)) if staleness else 0.0
        row["staleness/max"] = int(max(staleness)) if staleness else 0
        # Throughput of the whole pipeline: trajectories trained per wall second since the last publish.
        elapsed = time.monotonic() - self._last_publish
        row["samples_per_second"] = g.generation_batch_size / elapsed if elapsed > 0 else 0.0
        # Completion tokens trained per wall second of this optimizer step (its wait for data included).
        row["tokens_per_second"] = sum(lengths) / seconds if seconds > 0 else 0.0
        row["time"] = time.time()
        metrics.set_train_gauges(self._run, row)
        return row

    def _snapshot_dir(self, version: int) -> Path:
        return self.output_dir / "weights" / f"v{version:06d}"

    def _publish(self, final: bool, leased: list[int] = ()) -> Path:
        """Write this version's snapshot, unless no optimizer step changed the weights since the last one
        (every step skipped as non-finite, or gradients still accumulating): then the announcement names
        the last snapshot, so versions still count generation batches and admission control moves on.
        Then delete the snapshots no worker uses any more (``leased``: the versions workers lease)."""
        self._last_publish = time.monotonic()
        if self.step != self._snapshot_step or self._last_snapshot is None:
            self._last_snapshot = self._write_snapshot()
            self._snapshot_step = self.step
        directory = self._last_snapshot
        found = (self.output_dir / "weights").glob("v*")
        snapshots = {int(d.name[1:]): d for d in found if d.name[1:].isdigit()}
        for version in unused_snapshots(list(snapshots), leased, keep=directory.name):
            shutil.rmtree(snapshots[version], ignore_errors=True)
        if final:
            self._save_final()
        return directory

    def _write_snapshot(self) -> Path | None:
        """This version's weights snapshot. Distributed: a collective step (the weights are gathered whole);
        rank 0 writes it, the others return None."""
        with self._collective_lock:
            self._command("publish")
            state = None
            if self.group is not None:
                state = self.group.full_model_state(self.model)
                if not self.group.leader:
                    return None
        return save_weights_atomically(self.model, self._snapshot_dir(self.version), adapter_only=self.lora, state=state)

    def _save_final(self) -> None:
        """``final/``: the trained model with its tokenizer, loadable by transformers (collective when distributed)."""
        with self._collective_lock:
            self._command("final")
            state = None
            if self.group is not None:
                state = self.group.full_model_state(self.model)
                if not self.group.leader:
                    return
        final_dir = self.output_dir / "final"
        self.model.save_pretrained(str(final_dir), state_dict=state)
        self.tokenizer.save_pretrained(str(final_dir))
        if self.image_processor is not None:  # an image-prompt model: its processor parts and chat template too
            self.image_processor.save_pretrained(str(final_dir))
            if (self.model_dir / "chat_template.json").is_file():
                shutil.copy(self.model_dir / "chat_template.json", final_dir / "chat_template.json")

    # ------------------------------------------------------------------ distributed (stages/learner_dist.py)

    def _command(self, action: str, groups: list[TrainGroup] | None = None) -> None:
        """Rank 0 of a distributed learner: tell the followers which collective step comes next."""
        if self.group is not None and self.group.leader:
            self.group.send(LearnerCommand(action=action, version=self.version, groups=groups or []))

    def follow(self) -> int:
        """Ranks > 0 of a distributed learner: load and shard the model, then take each collective step rank 0
        announces (the same methods rank 0 runs) until it says stop. Returns the exit code."""
        self._load()
        self._run = self.cfg.run.name
        actions: dict[str, Callable[[LearnerCommand], Any]] = {
            "train": lambda command: self._train_batch(command.groups),
            "publish": lambda command: self._write_snapshot(),
            "final": lambda command: self._save_final(),
            "checkpoint": lambda command: self.save_checkpoint(),
        }
        try:
            while (command := self.group.receive()).action != "stop":
                if command.action not in actions:
                    raise ValueError(f"learner rank {self.group.rank}: unknown command {command.action!r} from rank 0")
                self.version = command.version
                try:
                    actions[command.action](command)
                except NonFiniteTrainingError:
                    pass  # rank 0 saw the same (the stats and the norm are global); it checkpoints with us, then stops
        finally:
            self.group.close()
        return 0

    def _log_completions(self, groups: list[TrainGroup]) -> None:
        for group in groups:
            for record, advantage in zip(group.records, group.advantages):
                t = record.trajectory
                prompt = t.messages[-1]["content"] if t.messages else ""
                self._completions_file.write(
                    json.dumps(
                        {
                            "step": self.step,
                            "generation_batch": group.generation_batch,
                            "prompt_id": group.prompt_id,
                            "attempt": group.attempt,
                            "request_id": t.request_id,
                            "policy_version": t.policy_version,
                            "max_policy_version": t.max_policy_version,
                            "trained_at_version": self.version - 1,  # called after the publish bumped it
                            "prompt": prompt,
                            **({"images": list(t.images)} if t.images else {}),  # content keys, not bytes
                            "completion": t.completion,
                            "rewards": record.rewards,
                            "reward": record.reward,
                            "advantage": advantage,
                            # a gym rollout's per-step rewards and infos (reset first)
                            **({"trajectory_infos": t.rollout_infos["trajectory_infos"]}
                               if "trajectory_infos" in t.rollout_infos else {}),
                        }
                    )
                    + "\n"
                )
