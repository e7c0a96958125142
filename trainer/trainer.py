"""The public, synchronous GRPO trainer: one generation batch in, metrics rows out, then a weights snapshot.

``Trainer(cfg, model_dir, output_dir, num_batches)``, then ``load()`` (model, reference, optimizer,
scheduler; a checkpoint's state when resuming). ``train_generation_batch(groups, version)`` trains one
generation batch as ms-swift does: its records shuffled (seed ``run.seed + version``), ``num_iterations``
passes of ``steps_per_generation`` mini-batches of ``per_device_train_batch_size * world_size``
trajectories, an optimizer step every ``gradient_accumulation_steps`` mini-batches (the count carries over
generation batches), and returns one metrics row (ms-swift's names) per optimizer step. A step whose loss or
gradient norm is NaN/inf is skipped (``nan_skipped``); three in a row raise ``NonFiniteTrainingError``.
``publish(version, final, leased)`` writes the weights snapshot (temp dir, then rename; the LoRA adapter
alone under LoRA) unless no optimizer step changed the weights since the last one, and deletes those no
worker leases. ``save_checkpoint`` / ``restore`` (``trainer/checkpoint.py``) continue a run exactly.

Under torchrun (``grpo.world_size > 1``, ``trainer/distributed.py``) every collective method is announced to
the other ranks first, which run ``follow()``: they take the same steps on their shards.
"""

from __future__ import annotations

import concurrent.futures
import math
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from config import Config
from data.chat import load_template
from grpo.advantages import compute_advantages, kl_penalized_rewards
from grpo.batching import (
    needs_old_logps,
    optimizer_steps_per_batch,
    shuffle_order,
    token_budget_micro_batches,
)
from grpo.loss import LOSS_STATS, MICRO_BATCH_SHARE, high_entropy_mask, host_stats, mean_std, policy_loss
from grpo.stats import tool_stats, trl_aliases
from pipeline import log, metrics
from pipeline.errors import UserError
from pipeline.records import LearnerCommand, ScoredTrajectory, TrainGroup
from pipeline.run_dir import atomic_dir
from pipeline.stage import FatalStageError
from trainer import checkpoint as checkpoints
from trainer import distributed
from trainer.model import (
    Batch,
    VisionInputs,
    completion_logps,
    completion_logps_and_entropy,
    freeze_vision,
    is_vision_model,
    language_model_linears,
    learner_device,
    learner_processes,
    load_model,
    long_tensors,
    packed_completion_logps_and_entropy,
    sync_ref_model,
)
from weights.snapshots import save_weights_atomically, unused_snapshots


class NonFiniteTrainingError(UserError, FatalStageError):
    """Too many optimizer steps in a row had a NaN/inf loss or gradient norm."""


class Trainer:
    """GRPO on whole generation batches of one model (and its reference), in this thread."""

    MAX_NAN_IN_A_ROW = 3  # non-finite optimizer steps tolerated in a row before training fails

    def __init__(self, cfg: Config, model_dir: Path, output_dir: Path, num_batches: int) -> None:
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.output_dir = Path(output_dir)
        self.num_batches = num_batches  # the learning-rate schedule's length
        self.run = cfg.run.name  # the metrics' run label
        # Prometheus gauges and the staleness histogram set here; off in a child process (learner.own_process),
        # whose registry nobody scrapes: trainer/process.py sets them in the worker from the rows.
        self.export_metrics = True
        self.version = 0  # the policy version named by the latest call (trained on, published, restored)
        self.step = 0  # optimizer steps taken
        self.nan_skipped = 0  # optimizer steps skipped for a non-finite loss or gradient norm
        self._nan_in_a_row = 0
        self.last_checkpoint_step = 0
        self.model: Any = None  # set by load(): a transformers model, or a peft model around one (their API)
        self.ref_model: Any = None  # a transformers model (None: none, or the policy with its adapter off)
        self._accumulated: list[dict[str, Any]] = []  # mini-batch stats since the last optimizer step
        self._accumulated_records: list[ScoredTrajectory] = []
        self._step_started = time.monotonic()
        self._last_publish = time.monotonic()
        self._last_snapshot: Path | None = None  # the newest weights snapshot written, and its step
        self._snapshot_step = 0
        # Under torchrun (grpo.world_size > 1): this process's place among the learner processes; rank 0
        # leads, the others follow(). None for a single process.
        self.group: distributed.LearnerGroup | None = None
        self.device = torch.device("cpu")  # learner.device, resolved in load()
        self._ref_thread: concurrent.futures.ThreadPoolExecutor | None = None  # set in load()
        # One collective step at a time: the stage calls from several threads, and ranks must take the same
        # steps in the same order.
        self._collective_lock = threading.RLock()

    @property
    def accumulating(self) -> bool:
        """Gradients are accumulated for an optimizer step not taken yet (they carry over generation batches)."""
        return bool(self._accumulated)

    # ------------------------------------------------------------------ loading

    def load(self, resume_from: checkpoints.Checkpoint | None = None) -> None:
        """Load the model, its reference, optimizer and scheduler; then, when resuming, the checkpoint."""
        from transformers import AutoTokenizer

        distributed.check_world_size(self.cfg)
        if distributed.processes_from_env() > 1:
            self.group = distributed.LearnerGroup(self.cfg.learner.device)  # its rank's device: GPU or CPU
        torch.set_num_threads(self.cfg.learner.torch_threads)
        torch.manual_seed(self.cfg.run.seed)
        dtype = getattr(torch, self.cfg.model.torch_dtype)
        self.device = self.group.device if self.group is not None else learner_device(self.cfg.learner.device)
        self.model = load_model(self.model_dir, dtype).to(self.device)
        lc = self.cfg.learner
        self.vision = is_vision_model(self.model_dir)
        self.image_processor = None
        if self.vision:
            from transformers import AutoImageProcessor

            self.image_processor = AutoImageProcessor.from_pretrained(str(self.model_dir))
            self.image_token_id = self.model.config.image_token_id
            freeze_vision(self.model, freeze_vit=lc.freeze_vit, freeze_aligner=lc.freeze_aligner)
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
        if resume_from is not None:  # whole weights, before sharding: any number of processes can resume
            self._restore_weights(resume_from.path)
        if self.group is not None:
            self.group.shard(self.model)
            if self.ref_model is not None:  # sharded alike, so sync_ref_model mixes matching shards
                self.group.shard(self.ref_model)
        trained = [p for p in self.model.parameters() if p.requires_grad]  # the adapter alone under LoRA
        # As transformers' Trainer (ms-swift's): biases and norm weights (1-D) are not decayed.
        groups = [
            {"params": [p for p in trained if p.ndim >= 2]},
            {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
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
        if resume_from is not None:
            self.restore(resume_from)
        self._last_publish = time.monotonic()


    def close(self) -> None:
        """Stop the reference passes' thread and, distributed, the followers (they exit with rank 0)."""
        if self._ref_thread is not None:
            self._ref_thread.shutdown()
        if self.group is not None:
            with self._collective_lock:
                self._command("stop")
            self.group.close()

    # ------------------------------------------------------------------ training

    def train_generation_batch(
        self, groups: list[TrainGroup], version: int, images: dict[str, bytes] | None = None
    ) -> list[dict[str, Any]]:
        """Train one generation batch sampled for policy ``version``; returns a metrics row per optimizer step
        (none while gradients accumulate across batches). ``images``: the batch's image bytes by content
        key (image-prompt models). A collective step when distributed: every rank gets the groups and trains
        its rows of each global mini-batch."""
        with self._collective_lock:
            self.version = version
            self._command("train", groups)
            return self._train(groups, images or {})

    def _train(self, groups: list[TrainGroup], images: dict[str, bytes]) -> list[dict[str, Any]]:
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
        vision = (VisionInputs(self.image_processor, self.image_token_id, images)
                  if self.vision and images else None)
        minibatches = [
            Batch(records[i : i + global_size][mine], advantages[i : i + global_size][mine], self.pad_id,
                  weights[i : i + global_size][mine], vision=vision, learner_version=self.version, device=self.device)
            for i in range(0, len(records), global_size)
        ]
        if self.export_metrics:
            for s in staleness:
                metrics.STALENESS.labels(self.run).observe(s)
        kl_in_reward = g.kl_in_reward and g.beta != 0.0
        # Started first, so they run while this thread takes the old-log-prob passes; all are in before the
        # first optimizer step, which may move the reference (sync_ref_model).
        ref_passes = (
            [self._ref_thread.submit(self.ref_logps, mb) for mb in minibatches]
            if g.beta != 0.0 and self._ref_thread is not None
            else None
        )
        with torch.no_grad():
            if kl_in_reward:
                old = [self.logps(self.model, mb) for mb in minibatches]
            elif needs_old_logps(g, records, self.version):
                # The first mini-batch trains on the weights the batch starts from: its training forward
                # gives its old log-probs (ratio 1), so that pass is skipped. Not with several iterations,
                # whose later passes need the start's log-probs again.
                first = [None] if g.num_iterations == 1 else []
                old = first + [self.logps(self.model, mb) for mb in minibatches[len(first):]]
            else:
                old = None
            if ref_passes is not None:
                ref = [future.result() for future in ref_passes]
            else:
                ref = [self.ref_logps(mb) for mb in minibatches] if g.beta != 0.0 else None
            if kl_in_reward:  # the KL moves from the loss into the rewards, then the advantages are redone
                assert old is not None and ref is not None, "kl_in_reward: both computed above (beta > 0)"
                kl_mean = self._penalize_rewards_by_kl(records, minibatches, cast("list[torch.Tensor]", old), ref)
        # dapo divides by the completion tokens of the whole generation batch, per learner process (TRL's
        # num_items_in_batch / num_processes), so every mini-batch's tokens weigh the same.
        tokens = sum(float(mb.row_tokens.sum()) for mb in minibatches)
        if self.group is not None:  # this rank's mini-batches hold its rows only
            tokens = self.group.sum(tokens)
        num_items_in_batch = tokens / learner_processes()
        rows: list[dict[str, Any]] = []
        for _ in range(g.num_iterations):
            for index, mb in enumerate(minibatches):
                stats = self.minibatch_backward(
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
    def ref_logps(self, mb: Batch) -> torch.Tensor:
        """(B, T) completion log-probs of a mini-batch under the reference (the base model under LoRA)."""
        if self.lora:
            with self.model.disable_adapter():
                return self.logps(self.model, mb)
        return self.logps(self.ref_model, mb)

    def logps(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """(B, T) completion log-probs of a mini-batch (old or reference pass), padding-free under
        learner.max_tokens_per_batch."""
        budget, temperature = self.cfg.learner.max_tokens_per_batch, self.cfg.grpo.temperature
        if budget is None:
            return completion_logps(model, mb, temperature)
        groups = token_budget_micro_batches([len(seq) for seq in mb.sequences], budget)
        return torch.cat([packed_completion_logps_and_entropy(model, mb, rows, temperature, False)[0] for rows in groups])

    def minibatch_backward(
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
        # The engine's log-probs: the rollout IS weights and the off-policy mask's behaviour policy (as ms-swift).
        engine_logps = g.rollout_importance_sampling_mode is not None or g.off_policy_sequence_mask_delta is not None
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
                rollout_logps=mb.rollout_logps[select] if engine_logps else None,
                rollout_is_mode=g.rollout_importance_sampling_mode,
                rollout_is_threshold=g.rollout_importance_sampling_threshold,
                entropy_mask=(high_entropy_mask(entropy, mask, g.top_entropy_quantile)
                              if top_entropy and entropy is not None else None),  # (computed when top_entropy)
                tau_pos=g.tau_pos,
                tau_neg=g.tau_neg,
                off_policy_sequence_mask_delta=g.off_policy_sequence_mask_delta,
                rollout_is_convention=g.rollout_importance_sampling_convention,
                use_bias_correction_kl=g.use_bias_correction_kl,
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
                if key.endswith(("_min", "_max")):  # extremes over the micro-batches
                    pick = torch.minimum if key.endswith("_min") else torch.maximum
                    totals[key] = pick(totals[key], value) if key in totals else value
                else:
                    totals[key] = totals.get(key, 0.0) + value * tokens / max(all_tokens, 1.0)
            if entropy is not None and g.log_entropy:
                totals["entropy_sum"] = totals.get("entropy_sum", 0.0) + (entropy * mask).sum()
                totals["entropy_tokens"] = totals.get("entropy_tokens", 0.0) + tokens
        return totals

    def _penalize_rewards_by_kl(
        self, records: list[ScoredTrajectory], minibatches: list[Batch], old: list[torch.Tensor], ref: list[torch.Tensor]
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
        learning_rate = float(self.scheduler.get_last_lr()[0])
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

    def _row(
        self, stats: list[dict[str, float]], records: list[ScoredTrajectory], grad_norm: float, lr: float,
        staleness: list[int], seconds: float,
    ) -> dict[str, Any]:
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
            row[f"rewards/{name}/mean"], row[f"rewards/{name}/std"] = mean_std(values)
            # completions the function failed on after its retries (scored 0 under reward.on_error = "zero")
            row[f"rewards/{name}/failures"] = sum(name in r.reward_errors for r in records)
        lengths = [len(r.trajectory.completion_ids) // 4 for r in records]
        row["completions/mean_length"] = float(np.mean(lengths))
        row["completions/min_length"] = float(np.min(lengths))
        row["completions/max_length"] = float(np.max(lengths))
        row["completions/clipped_ratio"] = float(np.mean([r.trajectory.is_truncated for r in records]))
        row.update(tool_stats([r.trajectory.rollout_infos for r in records]))
        for key in LOSS_STATS:
            values = [s[key] for s in stats if key in s]
            if values:  # a min or max over the step's mini-batches; else their mean
                combine = np.min if key.endswith("_min") else np.max if key.endswith("_max") else np.mean
                value = float(combine(values))
                if combine is np.mean or not math.isinf(value):  # an extreme over no counted token: not logged
                    row[key] = value
        if "entropy_sum" in stats[0]:  # token-weighted over the step's mini-batches
            tokens = sum(s["entropy_tokens"] for s in stats)
            row["entropy/mean"] = sum(s["entropy_sum"] for s in stats) / tokens if tokens else 0.0
        diff_tokens = sum(s.get("logp_diff_tokens", 0.0) for s in stats)
        if diff_tokens:  # only rows sampled with the learner's current weights count (TRL's name)
            row["sampling/sampling_logp_difference/mean"] = sum(s["logp_diff_sum"] for s in stats) / diff_tokens
            row["sampling/sampling_logp_difference/max"] = max(s.get("logp_diff_max", 0.0) for s in stats)
        row.update(trl_aliases(row))  # TRL's names too, where they differ
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
        # TRL's log_metric from the reward functions: one value per group, averaged over the step's groups;
        # a name the row already has keeps the learner's value, the reward's goes under reward_metrics/.
        logged: dict[str, dict[str, float]] = {}
        for r in records:
            for key, value in r.logged_metrics.items():
                logged.setdefault(key, {})[r.group_id] = value
        for key, per_group in logged.items():
            row[key if key not in row else f"reward_metrics/{key}"] = float(np.mean(list(per_group.values())))
        if self.export_metrics:
            metrics.set_train_gauges(self.run, row)
        return row

    # ------------------------------------------------------------------ weights

    def snapshot_dir(self, version: int) -> Path:
        return self.output_dir / "weights" / f"v{version:06d}"

    def publish(self, version: int, final: bool = False, leased: Sequence[int] = (), snapshot: bool = True) -> Path | None:
        """The snapshot of policy ``version``: written, unless no optimizer step changed the weights since the
        last one (every step skipped as non-finite, or gradients still accumulating): then it is the last
        snapshot, so versions still count generation batches and admission control moves on. Then delete
        the snapshots no worker uses any more (``leased``: the versions workers lease); ``final``: also
        write ``final/``. Returns the snapshot's directory. ``snapshot`` False (weights go by broadcast,
        ``weights_state``): no snapshot, only ``final/``; returns None."""
        self.version = version
        self._last_publish = time.monotonic()
        if not snapshot:
            if final:
                self.save_final()
            return None
        if self.step != self._snapshot_step or self._last_snapshot is None:
            self.write_snapshot(version)
        directory = self._last_snapshot
        assert directory is not None, "write_snapshot sets it"
        found = (self.output_dir / "weights").glob("v*")
        snapshots = {int(d.name[1:]): d for d in found if d.name[1:].isdigit()}
        for unused in unused_snapshots(list(snapshots), leased, keep=directory.name):
            shutil.rmtree(snapshots[unused], ignore_errors=True)
        if final:
            self.save_final()
        return directory

    def write_snapshot(self, version: int) -> Path | None:
        """Policy ``version``'s weights snapshot, always written. Distributed: a collective step (the weights
        are gathered whole); rank 0 writes it, the others return None."""
        with self._collective_lock:
            self.version = version
            self._command("publish")
            state = None
            if self.group is not None:
                state = self.group.full_model_state(self.model)
                if not self.group.leader:
                    return None
        path = save_weights_atomically(self.model, self.snapshot_dir(version), adapter_only=self.lora, state=state)
        self._last_snapshot, self._snapshot_step = path, self.step
        return path

    def weights_state(self) -> dict[str, torch.Tensor] | None:
        """The whole weights, as a snapshot holds them, to broadcast (weights/sender.py). Distributed: a
        collective step (gathered whole); rank 0 gets them, the others None."""
        with self._collective_lock:
            self._command("weights")
            if self.group is not None:
                state = self.group.full_model_state(self.model)
                return state if self.group.leader else None
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def save_final(self) -> None:
        """``final/``: the trained model with its tokenizer, loadable by transformers (collective when distributed)."""
        with self._collective_lock:
            self._command("final")
            state = None
            if self.group is not None:
                state = self.group.full_model_state(self.model)
                if not self.group.leader:
                    return
        with atomic_dir(self.output_dir / "final") as final_dir:  # never a half-written final/
            self.model.save_pretrained(str(final_dir), state_dict=state)
            if self.cfg.model.chat_template is not None:  # the template the run rendered its prompts with goes along
                self.tokenizer.chat_template = load_template(self.cfg.model.chat_template)
            self.tokenizer.save_pretrained(str(final_dir))
            if self.image_processor is not None:  # an image-prompt model: its processor parts and chat template too
                self.image_processor.save_pretrained(str(final_dir))
                if (self.model_dir / "chat_template.json").is_file():
                    shutil.copy(self.model_dir / "chat_template.json", final_dir / "chat_template.json")

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, state: dict[str, Any] | None = None) -> Path | None:
        """``checkpoint-<step>``: everything ``restore`` needs to continue exactly (see trainer/checkpoint.py),
        with the caller's ``state`` (its counters, JSON) in trainer_state.json beside the trainer's. Taken
        between generation batches, so no mini-batch is half-trained. Distributed: a collective step (the
        weights and optimizer state are gathered whole); rank 0 writes it, the others return None. The
        optimizer state is keyed by parameter name, so any number of processes can resume from it."""
        with self._collective_lock:
            self._command("checkpoint")
            return self._save_checkpoint(state or {})

    def _save_checkpoint(self, state: dict[str, Any]) -> Path | None:
        from safetensors.torch import save_file, save_model
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        moving_ref = self.ref_model is not None and self.cfg.learner.sync_ref_model
        if self.group is None:
            model_state = ref_state = None  # save_model writes the module itself
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer)
        else:
            model_state = self.group.full_model_state(self.model)
            ref_state = self.group.full_model_state(self.ref_model) if moving_ref and self.ref_model is not None else None
            optimizer_state = self.group.full_optimizer_state(self.model, self.optimizer)
            if not self.group.leader:
                return None

        def write(directory: Path) -> None:
            for name, module, weights in (("model", self.model, model_state), ("ref_model", self.ref_model, ref_state)):
                if name == "ref_model" and not moving_ref:
                    continue
                if weights is None:
                    save_model(module, str(directory / f"{name}.safetensors"))
                else:
                    save_file(weights, str(directory / f"{name}.safetensors"), metadata={"format": "pt"})
            torch.save(optimizer_state, directory / "optimizer.pt")
            torch.save(self.scheduler.state_dict(), directory / "scheduler.pt")
            torch.save(checkpoints.rng_states(), directory / "rng_state.pth")

        counters = {"policy_version": self.version, "nan_skipped": self.nan_skipped, "nan_in_a_row": self._nan_in_a_row}
        path = checkpoints.save(self.output_dir, self.step, {**counters, **state}, write, self.cfg.learner.save_total_limit)
        self.last_checkpoint_step = self.step
        log.get(stage="learner").info("checkpoint", path=str(path), step=self.step, version=self.version)
        return path

    def _restore_weights(self, path: Path) -> None:
        """A checkpoint's whole weights (and moving reference), loaded before the model is sharded."""
        from safetensors.torch import load_model

        load_model(self.model, str(path / "model.safetensors"))
        if (path / "ref_model.safetensors").is_file() and self.ref_model is not None:
            load_model(self.ref_model, str(path / "ref_model.safetensors"))

    def restore(self, checkpoint: checkpoints.Checkpoint) -> None:
        """Load the rest of a checkpoint (its weights went in before sharding, in load): optimizer, scheduler,
        RNGs, the trainer's counters. The caller's own state is in ``checkpoint.state``."""
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
        self.nan_skipped = state["nan_skipped"]
        self._nan_in_a_row = state["nan_in_a_row"]
        self.last_checkpoint_step = self.step

    # ------------------------------------------------------------------ distributed (trainer/distributed.py)

    def _command(self, action: str, groups: list[TrainGroup] | None = None) -> None:
        """Rank 0 of a distributed learner: tell the followers which collective step comes next."""
        if self.group is not None and self.group.leader:
            self.group.send(LearnerCommand(action=action, version=self.version, groups=groups or []))

    def follow(self, resume_from: checkpoints.Checkpoint | None = None) -> int:
        """Ranks > 0 of a distributed learner: load and shard the model, then take each collective step rank 0
        announces (the same methods rank 0 runs) until it says stop. Returns the exit code."""
        self.load(resume_from)
        actions: dict[str, Callable[[LearnerCommand], Any]] = {
            "train": lambda command: self.train_generation_batch(command.groups, command.version),
            "publish": lambda command: self.write_snapshot(command.version),
            "weights": lambda command: self.weights_state(),
            "final": lambda command: self.save_final(),
            "checkpoint": lambda command: self.save_checkpoint(),
        }
        group = self.group
        assert group is not None, "ranks > 0 run only in a learner group"
        try:
            while (command := group.receive()).action != "stop":
                if command.action not in actions:
                    raise ValueError(f"learner rank {group.rank}: unknown command {command.action!r} from rank 0")
                self.version = command.version
                try:
                    actions[command.action](command)
                except NonFiniteTrainingError:
                    pass  # rank 0 saw the same (the stats and the norm are global); it checkpoints with us, then stops
        finally:
            group.close()
        return 0
