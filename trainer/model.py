"""The trainer's model side: loading (causal LM or Qwen-VL, LoRA parts, frozen vision tower), padded batches
of trajectories, and the completion log-probs (and entropies) of a batch, padded or padding-free.

A ``Batch`` lays prompts out left-padded and completions right-padded, so every completion starts at the
same column and its logits are the last ``T + 1`` positions. Logits are divided by the sampling temperature
before the log-softmax, as TRL/ms-swift do, so the learner's ratio compares like with like.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import SetupError
from pipeline.records import ScoredTrajectory


class Batch:
    """Padded tensors for a list of scored trajectories: prompts left-padded, completions right-padded,
    so every completion starts at the same column and its logits are the last ``T + 1`` positions."""

    def __init__(
        self, records: list[ScoredTrajectory], advantages: list[float], pad_id: int, loss_weights: list[float] | None = None,
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
        from data.media import pil_images

        self.image_token_id = image_token_id
        self.merge = getattr(image_processor, "merge_size", 2) ** 2
        self.processed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, data in images.items():
            out = image_processor(images=pil_images([data]), return_tensors="pt")
            self.processed[key] = (out["pixel_values"], out["image_grid_thw"])

    def for_rows(self, records: list[ScoredTrajectory], input_ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
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


def learner_device(spec: str) -> torch.device:
    """learner.device as a torch device for a learner of one process: "auto" is the first CUDA GPU when torch
    sees one, else the CPU (each rank of a distributed learner: ``trainer.distributed.group_device``)."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
        import data.vl_compat  # noqa: F401  (CPU-only torchvision workaround)

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
    assert vision is not None, "called for a batch with images"
    rope: Any = next(m for m in model.modules() if hasattr(m, "get_rope_index") and hasattr(m, "rope_deltas"))
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


def learner_processes() -> int:
    """Learner processes sharing a generation batch (torch.distributed's world size; 1 when not distributed)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sync_ref_model(ref_model: torch.nn.Module, model: torch.nn.Module, alpha: float) -> None:
    """TRL's SyncRefModelCallback: ref = alpha * policy + (1 - alpha) * ref, parameter by parameter."""
    with torch.no_grad():
        for ref, policy in zip(ref_model.parameters(), model.parameters(), strict=True):
            ref.mul_(1.0 - alpha).add_(policy.detach().to(ref.dtype), alpha=alpha)
