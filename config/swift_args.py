"""ms-swift's GRPO arguments by their own names: one table, and the translation every entry point uses.

Each argument of ``swift rlhf --rlhf_type grpo`` (ms-swift v3.12.6 and main: ``RLHFArguments`` with its
mixins, and the transformers ``TrainingArguments`` under it) is one ``SwiftArg``:

- **accepted**: a rollstream field of the same name and meaning (``num_generations`` is ``grpo.num_generations``);
- **mapped**: a rollstream field under another name, or a value converted (``stop_words`` is ``rollout.stop``,
  ``vllm_server_host`` + ``vllm_server_port`` are ``rollout.server_urls``, ``max_steps = -1`` is ``0``);
- **not needed**: accepted and without effect, with the reason (``logging_steps``: every step is logged;
  the PPO/DPO/GKD arguments do nothing in a GRPO run); a few take only some values (``rlhf_type = "grpo"``);
- **refused**: names a feature rollstream lacks (``deepspeed``, ``sequence_parallel_size > 1``); its
  ms-swift default (the value that asks for nothing) is accepted, anything else is an error with the reason.

``config.load_config`` reads these names at a TOML's top level and inside sections (where the
rollstream field lives), ``rollstream train --reward_funcs accuracy --num_generations 8 ...`` takes them as
flags, and ``rollstream config from-swift args.json`` converts an ms-swift run (``from_args_json``), listing in
``Conversion.changes`` where the result would not train what ms-swift trained (the CLI then exits 3 unless
``--accept-changes``). ``command_defaults``: what an ms-swift command that leaves an argument out trains (LoRA).
docs/swift-arguments.md is generated from this table (``render_markdown``).

Pure: no imports from the rest of rollstream (the config loader imports this module).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

ACCEPTED = "accepted"
MAPPED = "mapped"
NOT_NEEDED = "not needed"
REFUSED = "refused"
KINDS = (ACCEPTED, MAPPED, NOT_NEEDED, REFUSED)

# A converter returns {"section.field": value} (empty: nothing to set); a ValueError means the value is refused.
Convert = Callable[[Any, Mapping[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Deferred:
    """A value that needs other fields of the finished config (``padding_free``): ``resolve(get)`` with
    ``get("section.field")`` the merged value (or the rollstream default)."""

    resolve: Callable[[Callable[[str], Any]], Any]
    text: str


class SortedArg(Protocol):
    """What ``Conversion.take`` reads of an argument (a ``SwiftArg``, or trl_args' ``TrlArg``)."""

    @property
    def kind(self) -> str: ...

    @property
    def why(self) -> str: ...

    def is_harmless(self, value: Any) -> bool: ...


@dataclass(frozen=True)
class SwiftArg:
    name: str
    kind: str
    targets: tuple[str, ...] = ()
    """The rollstream fields it sets ("section.field")."""
    why: str = ""
    """Refused / not needed: the reason; mapped: how the value is converted."""
    convert: Convert | None = None
    harmless: Callable[[Any], bool] | None = None
    """Refused / not needed: the values accepted without effect; None = ms-swift's default only (refused) or
    every value (not needed)."""
    default: Any = None
    """ms-swift's default (main's; ``swift_default`` knows v3.12.6's where it differs)."""
    alias_of: str | None = None
    """Another ms-swift name for the same argument (``max_new_tokens`` of ``max_completion_length``)."""

    def is_harmless(self, value: Any) -> bool:
        if self.harmless is not None:
            return self.harmless(value)
        if self.kind == NOT_NEEDED:
            return True
        return is_default(self.name, value)

    def translate(self, value: Any) -> dict[str, Any]:
        """{"section.field": value} for an accepted or mapped argument; a ValueError names what is wrong."""
        if self.kind in (REFUSED, NOT_NEEDED):
            if self.is_harmless(value):
                return {}
            raise ValueError(self.why)
        if self.convert is not None:
            return self.convert(value, {self.name: value})
        return {self.targets[0]: value}


class SwiftArgError(ValueError):
    """A refused argument or value (pipeline.config turns it into a ConfigError)."""


# ---------------------------------------------------------------------------------------------------
# ms-swift's defaults: RLHFArguments' dataclass fields at ms-swift main (v4), the transformers 5
# Seq2SeqTrainingArguments fields under them, and v3.12.6's fields that main dropped; extracted from the
# dataclasses' source. Where v3.12.6's default differs, _V3_DEFAULTS has it (both count as the default).

_MISSING = object()
_DEFAULTS: dict[str, Any] = {
    'per_device_train_batch_size': 1, 'per_device_eval_batch_size': 1, 'gradient_accumulation_steps': None,
    'tuner_backend': 'peft', 'gradient_checkpointing': True, 'vit_gradient_checkpointing': None,
    'gradient_checkpointing_kwargs': None, 'logging_first_step': True, 'logging_steps': 5,
    'router_aux_loss_coef': 0.0, 'enable_dft_loss': False, 'enable_channel_loss': False, 'weight_decay': 0.1,
    'adam_beta2': 0.95, 'lr_scheduler_type': 'cosine', 'lr_scheduler_kwargs': None, 'report_to': ['tensorboard'],
    'dataloader_num_workers': None, 'dataloader_persistent_workers': False, 'dataloader_prefetch_factor': None,
    'use_liger_kernel': False, 'check_model': True, 'acc_strategy': 'token', 'train_dataloader_shuffle': True,
    'max_epochs': None, 'aligner_lr': None, 'vit_lr': None, 'use_logits_to_keep': None,
    'ds3_gather_for_generation': True, 'resume_only_model': False, 'optimizer': None, 'loss_type': None,
    'metric': None, 'eval_use_evalscope': False, 'eval_dataset': [], 'eval_dataset_args': None, 'eval_limit': None,
    'eval_generation_config': None, 'extra_eval_args': None, 'use_flash_ckpt': False, 'output_dir': None,
    'learning_rate': None, 'eval_strategy': None, 'fp16': None, 'bf16': None, 'use_ray': False, 'ray_exp_name': None,
    'device_groups': None, 'model': None, 'model_type': None, 'model_revision': None, 'task_type': None,
    'torch_dtype': None, 'attn_impl': None, 'new_special_tokens': [], 'num_labels': None, 'problem_type': None,
    'rope_scaling': None, 'device_map': None, 'max_memory': None, 'max_model_len': None, 'local_repo_path': None,
    'init_strategy': None, 'template': None, 'system': None, 'max_length': None, 'truncation_strategy': None,
    'max_pixels': None, 'agent_template': None, 'norm_bbox': None, 'use_chat_template': None,
    'padding_side': 'right', 'padding_free': False, 'loss_scale': None, 'sequence_parallel_size': 1,
    'template_backend': 'swift', 'response_prefix': None, 'enable_thinking': None, 'add_non_thinking_prefix': True,
    'dataset': [], 'val_dataset': [], 'cached_dataset': [], 'cached_val_dataset': [], 'split_dataset_ratio': 0.0,
    'data_seed': 42, 'dataset_num_proc': 1, 'load_from_cache_file': False, 'dataset_shuffle': True,
    'val_dataset_shuffle': False, 'streaming': False, 'interleave_prob': None,
    'stopping_strategy': 'first_exhausted', 'shuffle_buffer_size': 1000, 'download_mode': 'reuse_dataset_if_exists',
    'columns': None, 'strict': False, 'remove_unused_columns': True, 'model_name': None, 'model_author': None,
    'custom_dataset_info': [], 'quant_method': None, 'quant_bits': None, 'hqq_axis': None,
    'bnb_4bit_compute_dtype': None, 'bnb_4bit_quant_type': 'nf4', 'bnb_4bit_use_double_quant': True,
    'bnb_4bit_quant_storage': None, 'max_new_tokens': None, 'temperature': 0.9, 'top_k': -1, 'top_p': 1.0,
    'repetition_penalty': 1.0, 'num_beams': 1, 'stream': None, 'stop_words': [], 'logprobs': False,
    'top_logprobs': None, 'structured_outputs_regex': None, 'ckpt_dir': None, 'lora_modules': [],
    'train_type': 'lora', 'adapters': [], 'external_plugins': [], 'seed': 42, 'model_kwargs': None,
    'load_args': False, 'load_data_args': False, 'packing': False, 'packing_length': None, 'packing_num_proc': 1,
    'lazy_tokenize': None, 'custom_register_path': [], 'use_hf': False, 'hub_token': None, 'ddp_timeout': 18000000,
    'ddp_backend': None, 'ignore_args_error': False, 'use_swift_lora': False, 'freeze_parameters': [],
    'freeze_parameters_regex': None, 'freeze_parameters_ratio': 0.0, 'trainable_parameters': [],
    'trainable_parameters_regex': None, 'freeze_llm': False, 'freeze_vit': True, 'freeze_aligner': True,
    'target_modules': ['all-linear'], 'target_regex': None, 'target_parameters': None, 'modules_to_save': [],
    'lora_rank': 8, 'lora_alpha': 32, 'lora_dropout': 0.05, 'lora_bias': 'none', 'lora_dtype': None,
    'lorap_lr_ratio': None, 'use_rslora': False, 'use_dora': False, 'lora_ga_batch_size': 2, 'lora_ga_iters': 2,
    'lora_ga_max_length': 1024, 'lora_ga_direction': 'ArB2r', 'lora_ga_scale': 'stable', 'lora_ga_stable_gamma': 16,
    'init_weights': 'true', 'fourier_n_frequency': 2000, 'fourier_scaling': 300.0, 'boft_block_size': 4,
    'boft_block_num': 0, 'boft_n_butterfly_factor': 1, 'boft_dropout': 0.0, 'vera_rank': 256,
    'vera_projection_prng_key': 0, 'vera_dropout': 0.0, 'vera_d_initial': 0.1, 'adapter_act': 'gelu',
    'adapter_length': 128, 'use_galore': False, 'galore_target_modules': None, 'galore_rank': 128,
    'galore_update_proj_gap': 50, 'galore_scale': 1.0, 'galore_proj_type': 'std',
    'galore_optim_per_parameter': False, 'galore_with_embedding': False, 'galore_quantization': False,
    'galore_proj_quant': False, 'galore_proj_bits': 4, 'galore_proj_group_size': 256, 'galore_cos_threshold': 0.4,
    'galore_gamma_proj': 2, 'galore_queue_size': 5, 'adalora_target_r': 8, 'adalora_init_r': 12, 'adalora_tinit': 0,
    'adalora_tfinal': 0, 'adalora_deltaT': 1, 'adalora_beta1': 0.85, 'adalora_beta2': 0.85,
    'adalora_orth_reg_weight': 0.5, 'llamapro_num_new_blocks': 4, 'llamapro_num_groups': None,
    'lisa_activated_layers': 0, 'lisa_step_interval': 20, 'reft_layer_key': None, 'reft_layers': None,
    'reft_rank': 4, 'reft_intervention_type': 'LoreftIntervention', 'reft_args': None, 'swanlab_token': None,
    'swanlab_project': 'ms-swift', 'swanlab_workspace': None, 'swanlab_exp_name': None,
    'swanlab_notification_method': None, 'swanlab_webhook_url': None, 'swanlab_secret': None,
    'swanlab_sender_email': None, 'swanlab_receiver_email': None, 'swanlab_smtp_server': None,
    'swanlab_smtp_port': None, 'swanlab_email_language': 'zh', 'swanlab_mode': 'cloud', 'add_version': True,
    'create_checkpoint_symlink': False, 'zero_hpz_partition_size': None, 'deepspeed_autotp_size': None, 'fsdp': None,
    'early_stop_interval': None, 'sft_alpha': 0, 'chord_sft_dataset': [],
    'chord_sft_per_device_train_batch_size': None, 'chord_enable_phi_function': False, 'chord_mu_warmup_steps': None,
    'chord_mu_decay_steps': None, 'chord_mu_peak': None, 'chord_mu_valley': None, 'reward_model': None,
    'reward_adapters': [], 'reward_model_type': None, 'reward_model_revision': None, 'num_ppo_epochs': 4,
    'whiten_rewards': False, 'kl_coef': 0.05, 'cliprange': 0.2, 'vf_coef': 0.1, 'cliprange_value': 0.2, 'gamma': 1.0,
    'lam': 0.95, 'num_mini_batches': 1, 'local_rollout_forward_batch_size': 64, 'num_sample_generations': 10,
    'response_length': None, 'missing_eos_penalty': None, 'vllm_gpu_memory_utilization': 0.9,
    'vllm_tensor_parallel_size': 1, 'vllm_pipeline_parallel_size': 1, 'vllm_enable_expert_parallel': False,
    'vllm_max_num_seqs': None, 'vllm_max_model_len': None, 'vllm_disable_custom_all_reduce': True,
    'vllm_enforce_eager': False, 'vllm_limit_mm_per_prompt': None, 'vllm_max_lora_rank': 16,
    'vllm_enable_prefix_caching': True, 'vllm_use_async_engine': None, 'vllm_quantization': None,
    'vllm_reasoning_parser': None, 'vllm_disable_cascade_attn': False, 'vllm_mm_processor_cache_gb': None,
    'vllm_speculative_config': None, 'vllm_engine_kwargs': None, 'vllm_data_parallel_size': 1, 'use_vllm': False,
    'vllm_mode': None, 'vllm_enable_lora': False, 'vllm_server_base_url': None, 'vllm_server_host': None,
    'vllm_server_port': [8000], 'vllm_server_timeout': 240.0, 'vllm_server_group_port': None,
    'enable_flattened_weight_sync': True, 'async_generate': False, 'sleep_level': 0, 'move_model_batches': None,
    'offload_optimizer': False, 'offload_model': False, 'wandb_log_unique_prompts': None, 'epsilon': 0.2,
    'epsilon_high': None, 'delta': None, 'cosine_min_len_value_wrong': -0.5, 'cosine_max_len_value_wrong': 0.0,
    'cosine_min_len_value_correct': 1.0, 'cosine_max_len_value_correct': 0.5, 'cosine_max_len': None,
    'repetition_n_grams': 3, 'repetition_max_penalty': -1.0, 'reward_model_plugin': None, 'sync_ref_model': False,
    'ref_model_sync_steps': 512, 'ref_model_mixup_alpha': 0.6, 'multi_turn_scheduler': None, 'max_turns': None,
    'completion_length_limit_scope': 'per_round', 'vllm_server_pass_dataset': False, 'dynamic_sample': False,
    'max_resample_times': 3, 'overlong_filter': False, 'soft_max_length': None, 'soft_cache_length': None,
    'scale_rewards': None, 'log_entropy': False, 'top_entropy_quantile': 1.0, 'importance_sampling_level': 'token',
    'tau_pos': 1.0, 'tau_neg': 1.05, 'advantage_estimator': 'grpo', 'kl_in_reward': None,
    'generation_batch_size': None, 'steps_per_generation': None, 'num_generations_eval': None,
    'rollout_importance_sampling_mode': None, 'rollout_importance_sampling_threshold': 2.0,
    'log_rollout_offpolicy_metrics': False, 'off_policy_sequence_mask_delta': None, 'num_generations': 8,
    'reward_funcs': [], 'reward_weights': None, 'log_completions': False, 'num_iterations': 1, 'teacher_model': None,
    'teacher_adapters': [], 'teacher_model_type': None, 'teacher_model_revision': None, 'teacher_deepspeed': None,
    'rlhf_type': 'dpo', 'ref_model': None, 'ref_adapters': [], 'ref_model_type': None, 'ref_model_revision': None,
    'beta': None, 'label_smoothing': 0, 'max_completion_length': 512, 'rpo_alpha': None, 'ld_alpha': None,
    'discopop_tau': 0.05, 'loss_weights': None, 'cpo_alpha': 1.0, 'simpo_gamma': 1, 'desirable_weight': 1.0,
    'undesirable_weight': 1.0, 'center_rewards_coefficient': None, 'lmbda': 0.5, 'seq_kd': False,
    'offload_teacher_model': False, 'safe_serialization': True, 'max_shard_size': '5GB', 'group_by_length': False,
    'mrl_dims': None, 'eval_metric': None, 'callbacks': [], 'tuner_type': 'lora', 'logging_dir': None,
    'warmup_ratio': 0.0, 'experts_impl': None, 'is_binary_loss_scale': None, 'preserve_thinking': None,
    'disable_ignore_empty_think': False, 'disable_auto_column_mapping': False, 'enable_npu_model_patch': True,
    'packing_strategy': 'binpack', 'reward_template': None, 'min_p': 0.0, 'teacher_tag_key': 'dataset',
    'use_gym_env': None, 'gym_env': None, 'teacher_kl_coef': 1.0, 'advantage_reweight': None, 'rlsd_lambda': 0.5,
    'rlsd_reweight_clip_range': 0.2, 'rlsd_lambda_warmup_steps': 0, 'rlsd_lambda_decay_steps': 0,
    'rlsd_negative_only': False, 'sdar_loss_coef': 0.0, 'sdar_gate_beta': 5.0, 'real_tau': 0.5,
    'fipo_decay_rate': 32.0, 'fipo_clip_range': 0.2, 'fipo_clip_high_only': True, 'fipo_safety_threshold': 4.0,
    'teacher_model_server': None, 'gkd_logits_topk': None, 'num_train_epochs': 3.0, 'max_steps': -1,
    'warmup_steps': 0, 'optim': 'adamw_torch_fused', 'optim_args': None, 'adam_beta1': 0.9, 'adam_epsilon': 1e-08,
    'optim_target_modules': None, 'average_tokens_across_devices': True, 'max_grad_norm': 1.0,
    'label_smoothing_factor': 0.0, 'bf16_full_eval': False, 'fp16_full_eval': False, 'tf32': None,
    'torch_compile': False, 'torch_compile_backend': None, 'torch_compile_mode': None, 'liger_kernel_config': None,
    'use_cache': False, 'neftune_noise_alpha': None, 'torch_empty_cache_steps': None, 'auto_find_batch_size': False,
    'logging_strategy': 'steps', 'log_on_each_node': True, 'logging_nan_inf_filter': True,
    'include_num_input_tokens_seen': 'no', 'log_level': 'passive', 'log_level_replica': 'warning',
    'disable_tqdm': None, 'run_name': None, 'project': 'huggingface', 'trackio_space_id': None,
    'trackio_bucket_id': None, 'trackio_static_space_id': None, 'eval_steps': None, 'eval_delay': 0,
    'prediction_loss_only': False, 'eval_on_start': False, 'eval_do_concat_batches': True,
    'eval_use_gather_object': False, 'eval_accumulation_steps': None, 'include_for_metrics': [],
    'batch_eval_metrics': False, 'save_only_model': False, 'save_strategy': 'steps', 'save_steps': 500,
    'save_on_each_node': False, 'save_total_limit': None, 'enable_jit_checkpoint': False, 'push_to_hub': False,
    'hub_private_repo': None, 'hub_model_id': None, 'hub_strategy': 'every_save', 'hub_always_push': False,
    'hub_revision': None, 'load_best_model_at_end': False, 'metric_for_best_model': None, 'greater_is_better': None,
    'ignore_data_skip': False, 'restore_callback_states_from_checkpoint': False, 'full_determinism': False,
    'use_cpu': False, 'accelerator_config': None, 'parallelism_config': None, 'dataloader_drop_last': False,
    'dataloader_pin_memory': True, 'dataloader_multiprocessing_context': None, 'dataloader_in_order': True,
    'label_names': None, 'train_sampling_strategy': 'random', 'length_column_name': 'length',
    'ddp_find_unused_parameters': None, 'ddp_bucket_cap_mb': None, 'ddp_broadcast_buffers': None,
    'ddp_static_graph': None, 'fsdp_config': None, 'deepspeed': None, 'debug': '', 'skip_memory_metrics': True,
    'do_train': False, 'do_eval': False, 'do_predict': False, 'resume_from_checkpoint': None, 'local_rank': -1,
    'sortish_sampler': False, 'predict_with_generate': False, 'generation_max_length': None,
    'generation_num_beams': None, 'generation_config': None,
    # transformers 4 (ms-swift v3.12.6's) TrainingArguments fields that transformers 5 dropped
    'overwrite_output_dir': False, 'save_safetensors': True, 'no_cuda': False,
    'use_mps_device': False, 'use_ipex': False, 'jit_mode_eval': False, 'fp16_opt_level': 'O1',
    'fp16_backend': 'auto', 'half_precision_backend': 'auto', 'tpu_num_cores': None, 'tpu_metrics_debug': False,
    'past_index': -1, 'push_to_hub_model_id': None, 'push_to_hub_organization': None, 'push_to_hub_token': None,
    'mp_parameters': '', 'ray_scope': 'last', 'include_inputs_for_metrics': False,
    'include_tokens_per_second': False, 'fsdp_min_num_params': 0, 'fsdp_transformer_layer_cls_to_wrap': None,
    'split_batches': None, 'dispatch_batches': None, 'torchdynamo': None, 'use_legacy_prediction_loop': False,
    'evaluation_strategy': None, 'adafactor': False, 'per_gpu_train_batch_size': None,
    'per_gpu_eval_batch_size': None,
}
_V3_DEFAULTS: dict[str, Any] = {
    'top_k': 50, 'top_p': 0.9, 'padding_side': None, 'optim': 'adamw_torch', 'include_num_input_tokens_seen': False,
    'trackio_space_id': 'trackio',
}
# TRL GRPOConfig names rollstream also takes.
_TRL_DEFAULTS: dict[str, Any] = {
    'chat_template_kwargs': None, 'num_completions_to_print': None, 'max_prompt_length': 512,
    'mask_truncated_completions': False,
}
# Not arguments: values ms-swift's start-up writes into args.json beside them.
_RUNTIME_DEFAULTS: dict[str, Any] = {
    'rank': -1, 'global_world_size': 1, 'local_world_size': 1, 'model_info': None, 'model_meta': None,
    'model_dir': None, 'model_suffix': None, 'hub': None, 'training_args': None, 'vllm_client': None,
    'swift_version': None, 'template_meta': None,
}


def swift_default(name: str) -> Any:
    """ms-swift's default of ``name`` (main's), or _MISSING for a name not in the table."""
    return _DEFAULTS.get(name, _MISSING)


def is_default(name: str, value: Any) -> bool:
    """Is ``value`` ms-swift's default for ``name`` (main's or v3.12.6's; None and empty containers alike)?"""
    candidates = [_DEFAULTS.get(name, _MISSING)]
    if name in _V3_DEFAULTS:
        candidates.append(_V3_DEFAULTS[name])
    return any(_same_value(value, c) for c in candidates if c is not _MISSING)


def _same_value(a: Any, b: Any) -> bool:
    empty = (None, "", (), [], {})
    if (a is None or (isinstance(a, (str, list, tuple, dict)) and not a)) and b in empty:
        return b is None or a in empty
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0) or a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------------------------------------
# Value converters (a ValueError's message says what is refused and what to do instead)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"expected true or false, got {value!r}")


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _json_object(value: Any) -> dict[str, Any] | None:
    """ms-swift takes dict arguments as JSON text too (``--columns '{"problem": "query"}'``)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"expected a JSON object, got {value!r} ({exc.msg})") from None
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"expected a JSON object (a table), got {value!r}")


def _one(value: Any, what: str) -> Any:
    """ms-swift's list-typed argument where rollstream takes one value."""
    values = _as_list(value)
    if len(values) > 1:
        raise ValueError(f"rollstream takes one {what}, got {len(values)}: {values!r}")
    return values[0] if values else None


def _skip_none(target: str) -> Convert:
    """Accepted as is; None (ms-swift's "its default") and an empty list or table leave rollstream's value."""

    def convert(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        return {} if value is None or (isinstance(value, (list, dict)) and not value) else {target: value}

    return convert


def _choices(target: str, allowed: Iterable[str], why: str, renames: Mapping[str, Any] | None = None) -> Convert:
    allowed = tuple(allowed)

    def convert(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            return {}
        value = _one(value, target) if isinstance(value, (list, tuple)) else value
        if renames and value in renames:
            renamed = renames[value]
            return {} if renamed is None else {target: renamed}
        if value not in allowed:
            raise ValueError(f"{value!r} is not available: {why}")
        return {target: value}

    return convert


def _max_steps(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"run.max_steps": max(int(value), 0)}


def _epochs(target: str) -> Convert:
    def convert(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            return {}
        if float(value) != int(float(value)) or float(value) < 1:
            raise ValueError(
                f"{value!r}: rollstream trains whole epochs (data.num_train_epochs >= 1); "
                f"for part of an epoch set max_steps"
            )
        return {target: int(float(value))}

    return convert


def _report_to(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    names = [v for v in _as_list(value) if v not in ("none", None)]
    other = [v for v in names if v not in ("tensorboard", "wandb")]
    if other:
        raise ValueError(
            f"{other!r}: rollstream reports to tensorboard and wandb (run.report_to); remove {', '.join(map(str, other))}"
        )
    return {"run.report_to": names}


def _log_level(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value in (None, "passive"):
        return {}
    levels = {"debug": "debug", "info": "info", "warning": "warning", "error": "error", "critical": "error"}
    if value not in levels:
        raise ValueError(f"{value!r} is not a log level (debug, info, warning, error, critical, passive)")
    return {"run.log_level": levels[value]}


def _torch_dtype(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}  # ms-swift: the model's own dtype; rollstream keeps its defaults
    if value not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"{value!r} is not one of bfloat16, float16, float32")
    return {"model.torch_dtype": value, "rollout.dtype": value}


def _vllm_mode(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if value == "server":
        return {"rollout.engine": "server"}
    if value == "colocate":
        return {"rollout.engine": "async"}
    raise ValueError(f"{value!r} is not one of server, colocate")


def _server_urls_from_host(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    hosts = [str(h) for h in _as_list(value)]
    if not hosts:
        return {}
    ports = [int(p) for p in _as_list(args.get("vllm_server_port", [8000]))] or [8000]
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts):
        raise ValueError(f"{len(hosts)} hosts but {len(ports)} vllm_server_port values; give one port per host")
    return {"rollout.server_urls": [f"http://{h}:{p}" for h, p in zip(hosts, ports)]}


def _server_port(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if args.get("vllm_server_host") or is_default("vllm_server_port", value):
        return {}  # joined with the hosts by vllm_server_host
    raise ValueError("needs vllm_server_host (the ports belong to those hosts), or give vllm_server_base_url")


def _base_urls(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    urls = [str(u).rstrip("/") for u in _as_list(value)]
    return {"rollout.server_urls": urls} if urls else {}


def _true_sets(target: str, on: Any) -> Convert:
    def convert(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        return {target: on} if value is not None and _as_bool(value) else {}

    return convert


def _sleep_level(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    level = int(value or 0)
    if level not in (0, 1, 2):
        raise ValueError(f"{value!r} is not one of 0, 1, 2")
    return {"rollout.colocate": True} if level else {}


def _async_generate(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"grpo.max_staleness": 1 if _as_bool(value) else 0}


def _train_type(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if value not in ("full", "lora"):
        raise ValueError(
            f"{value!r} is not available: rollstream trains full weights or a LoRA adapter (learner.train_type "
            f"full or lora)"
        )
    return {"learner.train_type": value}


def _padding_free(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if not _as_bool(value):
        return {}

    def budget(get: Callable[[str], Any]) -> int:
        max_length = get("data.max_length")
        if max_length is None:
            raise ValueError(
                "padding_free = true packs each mini-batch into one row, and with data.max_length unset its token "
                "count has no bound; set data.max_length (ms-swift's max_length), or learner.max_tokens_per_batch "
                "(the token budget of one packed micro-batch) instead of padding_free"
            )
        return get("grpo.per_device_train_batch_size") * (max_length + get("grpo.max_completion_length"))

    text = "per_device_train_batch_size * (max_length + max_completion_length)"
    return {"learner.max_tokens_per_batch": Deferred(budget, text)}


def _loss_type(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    value = _one(value, "loss_type")
    if value is None:
        return {}
    available = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo")
    if value not in available:
        raise ValueError(f"{value!r} is not available: rollstream's loss types are {', '.join(available)}")
    return {"grpo.loss_type": value}


def _scale_rewards(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, bool):  # ms-swift < 3.10: true = group, false = none
        value = "group" if value else "none"
    return {"grpo.scale_rewards": value}


def _reward_model(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    model = _one(value, "reward model (reward.reward_model)")
    return {} if model is None else {"reward.reward_model": model}


def _lr_scheduler(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if value == "constant_with_warmup":
        return {"learner.lr_scheduler_type": "constant"}
    if value not in ("constant", "linear", "cosine"):
        raise ValueError(
            f"{value!r} is not available: rollstream's schedules are constant, linear and cosine after a linear "
            f"warm-up (learner.lr_scheduler_type, learner.warmup_ratio)"
        )
    return {"learner.lr_scheduler_type": value}


def _warmup_steps(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if not value:
        return {}
    if 0 < float(value) < 1:  # transformers 5: a float below 1 is a ratio
        return {"learner.warmup_ratio": float(value)}
    raise ValueError(
        f"{value!r} steps: rollstream's warm-up is a fraction of the run; set warmup_ratio "
        f"(= warmup_steps / total optimizer steps)"
    )


def _steps(target: str) -> Convert:
    def convert(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            return {}
        if float(value) != int(float(value)):  # transformers: a float below 1 is a ratio of the run
            raise ValueError(f"{value!r}: give a whole number of steps (a ratio of the run is not available)")
        return {target: int(float(value))}

    return convert


def _strategy(target: str) -> Convert:
    def convert(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        if value is None:
            return {}
        if value not in ("no", "steps"):
            raise ValueError(f"{value!r} is not available: rollstream evaluates every eval_steps (steps) or never (no)")
        return {target: value}

    return convert


def _columns(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    columns = _json_object(value)
    return {"data.columns": columns} if columns else {}


def _json_table(target: str) -> Convert:
    def convert(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
        table = _json_object(value)
        return {target: table} if table else {}

    return convert


def _loss_scale(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if value not in ("default", "last_round"):
        raise ValueError(f"{value!r} is not available: rollstream trains every model turn (default) or the last "
                         f"assistant round (last_round)")
    return {"rollout.loss_scale": value}


def _truncation(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    if value is None:
        return {}
    if value not in ("left", "delete"):
        raise ValueError(f"{value!r} is not available: GRPO prompts are truncated left or deleted (as ms-swift "
                         f"asserts for GRPO)")
    return {"grpo.truncation_strategy": value}


def _device_cpu(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"learner.device": "cpu"} if _as_bool(value) else {}


def _plugins(value: Any, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"run.external_plugins": [str(v) for v in _as_list(value)]}


# ---------------------------------------------------------------------------------------------------
# The table

_TABLE: dict[str, SwiftArg] = {}


def _add(arg: SwiftArg) -> None:
    if arg.name in _TABLE:
        raise AssertionError(f"ms-swift argument {arg.name} is in the table twice")
    default = _DEFAULTS.get(arg.name, _TRL_DEFAULTS.get(arg.name, _RUNTIME_DEFAULTS.get(arg.name)))
    _TABLE[arg.name] = SwiftArg(**{**arg.__dict__, "default": default})


def _same(section: str, *names: str, why: str = "", skip_none: bool = False) -> None:
    """Accepted: the rollstream field of the same name in ``section``."""
    for name in names:
        target = f"{section}.{name}"
        _add(SwiftArg(name, ACCEPTED, (target,), why, _skip_none(target) if skip_none else None))


def _map(name: str, targets: str | tuple[str, ...], why: str, convert: Convert | None = None,
         alias_of: str | None = None) -> None:
    targets = (targets,) if isinstance(targets, str) else targets
    _add(SwiftArg(name, MAPPED, targets, why, convert or _skip_none(targets[0]), alias_of=alias_of))


def _not_needed(why: str, *names: str, harmless: Callable[[Any], bool] | None = None) -> None:
    for name in names:
        _add(SwiftArg(name, NOT_NEEDED, (), why, harmless=harmless))


def _refuse(why: str, *names: str, harmless: Callable[[Any], bool] | None = None) -> None:
    for name in names:
        _add(SwiftArg(name, REFUSED, (), why, harmless=harmless))


def _falsy(value: Any) -> bool:
    return value in (None, False, 0, "", [], {}, "false", "False", "none", "None")


# --- accepted: same name, same meaning -------------------------------------------------------------
_same("run", "seed", "output_dir", "log_completions", skip_none=True)
_same("model", "model", "model_revision", "use_hf", skip_none=True)
_same("data", "dataset", "val_dataset", "system", "split_dataset_ratio", "dataset_shuffle", "data_seed",
      "max_length", "enable_thinking", "response_prefix", "disable_auto_column_mapping", skip_none=True)
_same("grpo", "num_generations", "per_device_train_batch_size", "generation_batch_size", "steps_per_generation",
      "gradient_accumulation_steps", "num_iterations", "temperature", "top_p", "top_k", "repetition_penalty",
      "max_completion_length", "beta", "epsilon", "epsilon_high", "delta", "importance_sampling_level", "tau_pos",
      "tau_neg", "off_policy_sequence_mask_delta", "advantage_estimator", "kl_in_reward",
      "rollout_importance_sampling_mode", "rollout_importance_sampling_threshold", "top_entropy_quantile",
      "log_entropy", "dynamic_sample", "max_resample_times", "overlong_filter", skip_none=True)
_same("rollout", "min_p", "multi_turn_scheduler", "max_turns", "use_gym_env", "gym_env", skip_none=True)
_same("reward", "reward_funcs", "reward_weights", "cosine_min_len_value_wrong", "cosine_max_len_value_wrong",
      "cosine_min_len_value_correct", "cosine_max_len_value_correct", "cosine_max_len", "repetition_n_grams",
      "repetition_max_penalty", "soft_max_length", "soft_cache_length", skip_none=True)
_same("learner", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
      "warmup_ratio", "save_total_limit", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
      "gradient_checkpointing", "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "ref_model",
      "freeze_vit", "freeze_aligner", skip_none=True)
_same("eval", "per_device_eval_batch_size", "eval_on_start", skip_none=True)
_same("data", "chat_template_kwargs", why="TRL's name (GRPOConfig); ms-swift has enable_thinking", skip_none=True)
_same("run", "num_completions_to_print", why="TRL's name (GRPOConfig), not an ms-swift argument", skip_none=True)
_same("rollout", "environment_factory", "max_tool_calling_iterations",
      why="TRL's name (GRPOTrainer / GRPOConfig), not an ms-swift argument", skip_none=True)
_map("tools", "rollout.tools", "TRL's GRPOTrainer(tools=...): \"module:function\" names (one is a list of one)",
     lambda value, args: {"rollout.tools": [str(v) for v in _as_list(value)]})

# --- mapped: another name, or a converted value ----------------------------------------------------
_map("max_steps", "run.max_steps", "-1 (transformers' off) is 0", _max_steps)
_map("num_train_epochs", "data.num_train_epochs", "a whole number (ms-swift takes a float)", _epochs("data.num_train_epochs"))
_map("max_epochs", "data.num_train_epochs", "ms-swift's override of num_train_epochs", _epochs("data.num_train_epochs"))
_map("external_plugins", "run.external_plugins", "a list (one path is a list of one)", _plugins)
_map("report_to", "run.report_to", "tensorboard and wandb; none is []", _report_to)
_map("log_level", "run.log_level", "passive leaves it; critical is error", _log_level)
_map("torch_dtype", ("model.torch_dtype", "rollout.dtype"),
     "the learner's and the engine's dtype (ms-swift's vLLM takes the model's); None keeps rollstream's", _torch_dtype)
_map("columns", "data.columns", "a table (ms-swift's JSON text is parsed)", _columns)
_map("max_new_tokens", "grpo.max_completion_length", "ms-swift's old name of max_completion_length",
     alias_of="max_completion_length")
_map("response_length", "grpo.max_completion_length", "ms-swift's PPO name of max_completion_length",
     alias_of="max_completion_length")
_map("max_prompt_length", "data.max_length", "TRL's name of the prompt cap (ms-swift: max_length)")
_map("truncation_strategy", "grpo.truncation_strategy", "left or delete (ms-swift asserts these for GRPO)", _truncation)
_map("loss_type", "grpo.loss_type", "grpo, bnpo, dr_grpo, dapo, cispo, sapo; a list of one is its value "
     "(real and fipo are refused)", _loss_type)
_map("scale_rewards", "grpo.scale_rewards", "ms-swift < 3.10's true/false is group/none", _scale_rewards)
_map("num_generations_eval", "eval.eval_num_generations", "completions per held-out prompt")
_map("mask_truncated_completions", "grpo.overlong_filter", "TRL's name of overlong_filter")
_map("async_generate", "grpo.max_staleness",
     "true = rollouts with the previous weights (max_staleness 1), false = on-policy (0)", _async_generate)
_map("stop_words", "rollout.stop", "stop strings of every turn")
_map("vllm_mode", "rollout.engine", "server = vLLM servers (rollout.engine \"server\"); colocate = the engine "
     "inside the rollout worker (\"async\"); sharing the learner's GPU is sleep_level", _vllm_mode)
_map("vllm_server_host", "rollout.server_urls", "http://HOST:PORT per host, with vllm_server_port", _server_urls_from_host)
_map("vllm_server_port", "rollout.server_urls", "joined with vllm_server_host (one port, or one per host)", _server_port)
_map("vllm_server_base_url", "rollout.server_urls", "the URLs as given", _base_urls)
_map("vllm_max_model_len", "rollout.max_model_len", "None derives it from the model and the lengths")
_map("vllm_enforce_eager", "rollout.enforce_eager", "skip CUDA graphs")
_map("vllm_limit_mm_per_prompt", "rollout.limit_mm_per_prompt", "a table (JSON text is parsed)",
     _json_table("rollout.limit_mm_per_prompt"))
_map("vllm_max_num_seqs", "rollout.max_num_seqs", "None derives it as ms-swift")
_map("vllm_tensor_parallel_size", "rollout.tensor_parallel_size", "1 in this build (rollout.tensor_parallel_size)")
_map("vllm_enable_lora", "rollout.weight_transport",
     "true = \"lora\" (adapters hot-swapped); false leaves rollstream's choice (lora under LoRA training)",
     _true_sets("rollout.weight_transport", "lora"))
_map("sleep_level", "rollout.colocate", "1 or 2 = share the learner's GPU, vLLM asleep while it trains", _sleep_level)
_map("train_type", "learner.train_type", "full or lora (ms-swift v3's name)", _train_type)
_map("tuner_type", "learner.train_type", "full or lora (ms-swift v4's name)", _train_type)
_map("padding_free", "learner.max_tokens_per_batch",
     "true = packed micro-batches of per_device_train_batch_size * (max_length + max_completion_length) tokens, "
     "one mini-batch per row as ms-swift packs it (needs max_length)", _padding_free)
_map("lr_scheduler_type", "learner.lr_scheduler_type", "constant, linear, cosine; constant_with_warmup is constant",
     _lr_scheduler)
_map("warmup_steps", "learner.warmup_ratio", "0, or a fraction below 1 (transformers 5: a ratio)", _warmup_steps)
_map("save_steps", "learner.save_steps", "optimizer steps between checkpoints", _steps("learner.save_steps"))
_map("eval_strategy", "eval.eval_strategy", "no or steps (epoch is refused)", _strategy("eval.eval_strategy"))
_map("evaluation_strategy", "eval.eval_strategy", "transformers' old name of eval_strategy",
     _strategy("eval.eval_strategy"), alias_of="eval_strategy")
_map("eval_steps", "eval.eval_steps", "counted in policy versions (one per generation batch: one optimizer step "
     "at steps_per_generation = gradient_accumulation_steps, num_iterations = 1)", _steps("eval.eval_steps"))
_map("reward_model", "reward.reward_model", "one model (a local directory, a Hub id or an http(s) URL)", _reward_model)
_map("loss_scale", "rollout.loss_scale", "default or last_round", _loss_scale)
_map("use_cpu", "learner.device", "true = \"cpu\"", _device_cpu)
_map("no_cuda", "learner.device", "transformers 4's use_cpu: true = \"cpu\"", _device_cpu, alias_of="use_cpu")

# --- not needed: accepted, no effect here -----------------------------------------------------------
_not_needed("rollstream always samples with vLLM (false, transformers' generate in ms-swift, samples the same "
            "distribution)", "use_vllm")
_not_needed("rollstream trains GRPO and its variants only", "rlhf_type", harmless=lambda v: v in (None, "grpo"))
_not_needed("the architecture comes from the model's config.json", "model_type", "model_suffix", "model_dir",
            "model_info", "model_meta", "experts_impl")
_not_needed("transformers picks the attention kernel", "attn_impl")
_not_needed("written by ms-swift at start (the run's processes, objects and versions), not an argument",
            "rank", "local_rank", "local_world_size", "hub", "training_args", "vllm_client", "swift_version",
            "template_meta")
_not_needed("ms-swift's count of training processes; a converted args.json folds it into "
            "per_device_train_batch_size (one learner process, the same global mini-batch)", "global_world_size")
_not_needed("every optimizer step is logged (metrics.jsonl, report_to)", "logging_steps", "logging_first_step",
            "logging_strategy", "log_on_each_node", "logging_nan_inf_filter", "log_level_replica", "disable_tqdm",
            "skip_memory_metrics", "include_num_input_tokens_seen", "include_tokens_per_second", "logging_dir",
            "debug")
_not_needed("the name trackers show; rollstream's run.name names the Redis keys and the output directory",
            "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id")
_not_needed("the feeder streams rows to the rollout; there is no torch DataLoader", "dataloader_num_workers",
            "dataloader_persistent_workers", "dataloader_prefetch_factor", "dataloader_pin_memory",
            "dataloader_multiprocessing_context", "dataloader_in_order", "dataloader_drop_last", "dataset_num_proc",
            "load_from_cache_file", "download_mode", "remove_unused_columns", "lazy_tokenize", "label_names",
            "length_column_name", "train_sampling_strategy", "group_by_length", "ignore_data_skip",
            "train_dataloader_shuffle", "shuffle_buffer_size", "stopping_strategy", "val_dataset_shuffle", "strict")
_not_needed("the learner trains in model.torch_dtype (ms-swift's torch_dtype maps there); there is no AMP",
            "fp16", "bf16", "bf16_full_eval", "fp16_full_eval", "tf32", "half_precision_backend", "fp16_backend",
            "fp16_opt_level")
_not_needed("the learner is one torch process or its own FSDP2 group (grpo.world_size), not DDP",
            "ddp_timeout", "ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers",
            "ddp_static_graph", "average_tokens_across_devices", "accelerator_config", "split_batches",
            "dispatch_batches")
_not_needed("the learner's optimizer is AdamW", "optim",
            harmless=lambda v: v in (None, "adamw_torch", "adamw_torch_fused", "adamw_hf"))
_not_needed("a checkpoint always holds the weights, optimizer, scheduler and RNG states as safetensors and "
            "torch files", "save_only_model", "save_on_each_node", "save_safetensors", "safe_serialization",
            "max_shard_size", "enable_jit_checkpoint", "create_checkpoint_symlink", "add_version",
            "overwrite_output_dir", "resume_only_model", "restore_callback_states_from_checkpoint")
_not_needed("checkpoints follow save_steps (0 = at the end only; the final weights are always saved)",
            "save_strategy", harmless=lambda v: v in (None, "steps", "no"))
_not_needed("evaluation scores the held-out prompts with the training rewards; no loss-based best model",
            "metric_for_best_model", "greater_is_better", "prediction_loss_only", "eval_do_concat_batches",
            "eval_use_gather_object", "eval_accumulation_steps", "include_for_metrics", "batch_eval_metrics",
            "eval_delay", "metric", "eval_metric", "acc_strategy", "include_inputs_for_metrics",
            "predict_with_generate", "generation_max_length", "generation_num_beams", "generation_config",
            "sortish_sampler", "past_index", "jit_mode_eval", "use_legacy_prediction_loop")
_not_needed("a launcher's or a notebook's switch: rollstream's commands say what runs", "do_train", "do_eval",
            "do_predict", "ignore_args_error", "load_args", "load_data_args", "check_model")
_not_needed("Hub logins come from the Hugging Face environment (HF_TOKEN, huggingface-cli login)", "hub_token",
            "local_repo_path")
_not_needed("has no effect in a GRPO run (ms-swift's PPO arguments)", "num_ppo_epochs", "whiten_rewards", "kl_coef",
            "cliprange", "vf_coef", "cliprange_value", "gamma", "lam", "num_mini_batches",
            "local_rollout_forward_batch_size", "num_sample_generations", "missing_eos_penalty")
_not_needed("has no effect in a GRPO run (ms-swift's DPO/KTO/CPO/SimPO/RM arguments)", "label_smoothing",
            "rpo_alpha", "ld_alpha", "discopop_tau", "loss_weights", "cpo_alpha", "simpo_gamma", "desirable_weight",
            "undesirable_weight", "center_rewards_coefficient", "label_smoothing_factor")
_not_needed("has no effect in a GRPO run without a teacher (ms-swift's GKD / on-policy distillation arguments)",
            "lmbda", "seq_kd", "sft_alpha", "gkd_logits_topk", "offload_teacher_model", "teacher_kl_coef",
            "teacher_tag_key", "teacher_adapters", "teacher_model_type", "teacher_model_revision", "teacher_deepspeed")
_not_needed("has no effect unless loss_type is real or fipo (not available)", "real_tau", "fipo_decay_rate",
            "fipo_clip_range", "fipo_clip_high_only", "fipo_safety_threshold")
_not_needed("has no effect unless advantage_reweight = rlsd (not available)", "rlsd_lambda",
            "rlsd_reweight_clip_range", "rlsd_lambda_warmup_steps", "rlsd_lambda_decay_steps", "rlsd_negative_only")
_not_needed("has no effect unless sdar_loss_coef > 0 (not available)", "sdar_gate_beta")
_not_needed("has no effect without the CHORD SFT dataset (not available)", "chord_sft_per_device_train_batch_size",
            "chord_enable_phi_function", "chord_mu_warmup_steps", "chord_mu_decay_steps", "chord_mu_peak",
            "chord_mu_valley")
_not_needed("has no effect unless train_type names that tuner (rollstream trains full or lora)",
            "lora_ga_batch_size", "lora_ga_iters", "lora_ga_max_length", "lora_ga_direction", "lora_ga_scale",
            "lora_ga_stable_gamma", "fourier_n_frequency", "fourier_scaling", "boft_block_size", "boft_block_num",
            "boft_n_butterfly_factor", "boft_dropout", "vera_rank", "vera_projection_prng_key", "vera_dropout",
            "vera_d_initial", "adapter_act", "adapter_length", "adalora_target_r", "adalora_init_r", "adalora_tinit",
            "adalora_tfinal", "adalora_deltaT", "adalora_beta1", "adalora_beta2", "adalora_orth_reg_weight",
            "llamapro_num_new_blocks", "llamapro_num_groups", "reft_layer_key", "reft_layers", "reft_rank",
            "reft_intervention_type", "reft_args")
_not_needed("has no effect unless use_galore or lisa_activated_layers is set (not available)",
            "galore_target_modules", "galore_rank", "galore_update_proj_gap", "galore_scale", "galore_proj_type",
            "galore_optim_per_parameter", "galore_with_embedding", "galore_quantization", "galore_proj_quant",
            "galore_proj_bits", "galore_proj_group_size", "galore_cos_threshold", "galore_gamma_proj",
            "galore_queue_size", "lisa_step_interval")
_not_needed("has no effect unless quant_method is set (not available)", "quant_bits", "hqq_axis",
            "bnb_4bit_compute_dtype", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage")
_not_needed("has no effect unless report_to holds swanlab (not available)", "swanlab_token", "swanlab_project",
            "swanlab_workspace", "swanlab_exp_name", "swanlab_notification_method", "swanlab_webhook_url",
            "swanlab_secret", "swanlab_sender_email", "swanlab_receiver_email", "swanlab_smtp_server",
            "swanlab_smtp_port", "swanlab_email_language", "swanlab_mode")
_not_needed("has no effect without push_to_hub (not available)", "hub_private_repo", "hub_model_id", "hub_strategy",
            "hub_always_push", "hub_revision", "push_to_hub_model_id", "push_to_hub_organization",
            "push_to_hub_token")
_not_needed("has no effect unless use_ray is set (not available)", "ray_exp_name", "device_groups", "ray_scope")
_not_needed("has no effect unless eval_use_evalscope is set (not available)", "eval_dataset_args",
            "eval_generation_config", "extra_eval_args")
_not_needed("has no effect unless fsdp is set (not available)", "fsdp_min_num_params",
            "fsdp_transformer_layer_cls_to_wrap", "mp_parameters")
_not_needed("has no effect unless packing is set (not available)", "packing_length", "packing_num_proc",
            "packing_strategy")
_not_needed("a sequence-classification (reward model) or embedding training argument", "num_labels",
            "problem_type", "mrl_dims")
_not_needed("self-cognition SFT data only", "model_name", "model_author")
_not_needed("prompts are padded where the learner batches them; the side does not change the loss",
            "padding_side")
_not_needed("rollstream renders every prompt with the tokenizer's chat template (jinja)", "template_backend")
_not_needed("Qwen3's thinking switch is data.enable_thinking; the empty-think prefix is the template's own",
            "add_non_thinking_prefix", "disable_ignore_empty_think", "is_binary_loss_scale")
_not_needed("vLLM engine internals rollstream leaves at vLLM's defaults", "vllm_disable_custom_all_reduce",
            "vllm_enable_prefix_caching", "vllm_disable_cascade_attn", "vllm_mm_processor_cache_gb")
_not_needed("rollstream's in-process engine is always vLLM's AsyncLLM", "vllm_use_async_engine")
_not_needed("vLLM's max_lora_rank is derived from learner.lora_rank", "vllm_max_lora_rank")
_not_needed("rollstream's rollout runs the multi-turn scheduler and sees every row; nothing to pass to the servers",
            "vllm_server_pass_dataset")
_not_needed("ms-swift's wait for the servers at start; rollstream waits per request (rollout.server_timeout_s)",
            "vllm_server_timeout")
_not_needed("ms-swift's NCCL weight-sync channel to its servers; rollstream's weights travel by "
            "rollout.weight_transport", "vllm_server_group_port", "enable_flattened_weight_sync",
            "move_model_batches", "ds3_gather_for_generation")
_not_needed("inference-only generation arguments", "stream", "logprobs", "top_logprobs")
_not_needed("the log-probs are kept only for the tokens a model writes", "use_logits_to_keep")
_not_needed("has no effect on a model without vision tower gradients to save", "vit_gradient_checkpointing",
            "gradient_checkpointing_kwargs")
_not_needed("torch's own caching allocator decides", "torch_empty_cache_steps", "use_cache", "max_memory",
            "liger_kernel_config")
_not_needed("GRPO has no SFT loss to alter (ms-swift: SFT only)", "enable_dft_loss", "enable_channel_loss")
_not_needed("wandb logs every metrics row; unique prompts are not counted", "wandb_log_unique_prompts")
_not_needed("the learner's device is learner.device (one device per learner process)", "device_map",
            "use_mps_device", "use_ipex", "tpu_num_cores", "tpu_metrics_debug", "torchdynamo")
_not_needed("rollstream's runs are seeded (run.seed, data.data_seed); CUDA kernels may still differ run to run",
            "full_determinism")
_not_needed("ms-swift's NPU patches", "enable_npu_model_patch")

# --- refused: names a feature rollstream lacks (ms-swift's default is accepted) ---------------------
_refuse("DeepSpeed is not available: the learner is one torch process or rollstream's own FSDP2 group "
        "(grpo.world_size, torchrun; docs/learner.md)", "deepspeed", "zero_hpz_partition_size",
        "deepspeed_autotp_size")
_refuse("transformers/accelerate FSDP is not available: the multi-process learner is rollstream's own FSDP2 "
        "(grpo.world_size, torchrun)", "fsdp", "fsdp_config", "parallelism_config")
_refuse("sequence parallelism is not available; lower the lengths or use learner.max_tokens_per_batch",
        "sequence_parallel_size")
_refuse("Ray is not available: rollstream's stages are separate processes over Redis (Procfile)", "use_ray")
_refuse("quantized (QLoRA-style) training is not available; train full weights or LoRA on the full-precision "
        "base", "quant_method")
_refuse("the LoRA adapter is peft's", "tuner_backend", "use_swift_lora",
        harmless=lambda v: v in (None, "peft", False))
_refuse("an adapter to start from is not available; merge it into the model first (ms-swift: swift export "
        "--merge_lora true) and give the merged directory as model", "adapters", "ref_adapters",
        "reward_adapters", "lora_modules")
_refuse("resuming an ms-swift checkpoint is not available; a rollstream run resumes with `rollstream train "
        "--resume`", "resume_from_checkpoint", "ckpt_dir")
_refuse("LoRA options beyond rank, alpha, dropout and target_modules are not available", "lora_bias", "lora_dtype",
        "lorap_lr_ratio", "use_rslora", "use_dora", "init_weights", "target_regex", "target_parameters",
        "modules_to_save")
_refuse("choosing trainable parameters is not available: full training trains every weight (the vision tower "
        "and aligner by freeze_vit / freeze_aligner), LoRA the adapter", "freeze_parameters",
        "freeze_parameters_regex", "freeze_parameters_ratio", "trainable_parameters", "trainable_parameters_regex",
        "freeze_llm")
_refuse("GaLore / LISA are not available", "use_galore", "lisa_activated_layers")
_refuse("separate learning rates for the vision tower / aligner are not available", "vit_lr", "aligner_lr")
_refuse("a custom optimizer or its arguments are not available (AdamW with learner.adam_*)", "optimizer",
        "optim_args", "optim_target_modules", "adafactor")
_refuse("transformers 4's deprecated per-GPU batch sizes are not available; give per_device_train_batch_size / "
        "per_device_eval_batch_size", "per_gpu_train_batch_size", "per_gpu_eval_batch_size")
_refuse("scheduler arguments are not available (constant, linear, cosine to 0 after warmup_ratio)",
        "lr_scheduler_kwargs")
_refuse("the Liger kernel loss is not available", "use_liger_kernel")
_refuse("torch.compile of the learner is not available", "torch_compile", "torch_compile_backend",
        "torch_compile_mode")
_refuse("NEFTune is not available", "neftune_noise_alpha")
_refuse("the MoE router auxiliary loss is not available", "router_aux_loss_coef")
_refuse("the learner's batch size is fixed by the config", "auto_find_batch_size")
_refuse("uploading to a hub is not available", "push_to_hub")
_refuse("loading the best checkpoint at the end is not available (checkpoints are kept by save_total_limit)",
        "load_best_model_at_end")
_refuse("early stopping is not available; set max_steps", "early_stop_interval")
_refuse("trainer callbacks are not available; rollstream's hooks are reward, scheduler and env plugins",
        "callbacks")
_refuse("DLRover flash checkpoints are not available", "use_flash_ckpt")
_refuse("EvalScope evaluation is not available; evaluation samples data.val_dataset (or split_dataset_ratio) "
        "and scores it with the training rewards", "eval_use_evalscope", "eval_dataset")
_refuse("ms-swift's eval_limit caps EvalScope's datasets, which are not available (rollstream's eval.eval_limit "
        "caps the held-out prompts: set it in [eval])", "eval_limit")
_refuse("ms-swift's built-in templates are not available: rollstream renders prompts with the tokenizer's chat "
        "template; give another as model.chat_template (jinja text or a .jinja file)", "template")
_refuse("agent templates are not available: tool schemas reach the tokenizer's chat template from the dataset's "
        "tools column", "agent_template")
_refuse("prompts are always rendered with the chat template", "use_chat_template",
        harmless=lambda v: v in (None, True, "true", "True"))
_refuse("keeping earlier turns' thinking is the chat template's choice (model.chat_template)", "preserve_thinking")
_refuse("image preprocessing options are not available (the processor's defaults apply)", "max_pixels",
        "norm_bbox")
_refuse("adding tokens to the vocabulary is not available", "new_special_tokens")
_refuse("model loading options are not available (rope scaling, init strategy, from_pretrained keywords); the "
        "model's own config.json applies", "rope_scaling", "init_strategy", "model_kwargs")
_refuse("ms-swift's max_model_len stretches the model's context with rope_scaling, which is not available (the "
        "engine's context is vllm_max_model_len, rollstream's rollout.max_model_len)", "max_model_len")
_refuse("only causal language models are trained", "task_type", harmless=lambda v: v in (None, "causal_lm"))
_refuse("ms-swift's cached, streamed, interleaved and registered datasets are not available: data.dataset "
        "takes files, folders and Hub ids", "cached_dataset", "cached_val_dataset", "streaming", "interleave_prob",
        "custom_dataset_info", "custom_register_path")
_refuse("packing is not available for GRPO rows; padding_free (learner.max_tokens_per_batch) packs a mini-batch",
        "packing")
_refuse("beam search is not available: GRPO samples", "num_beams", harmless=lambda v: v in (None, 1))
_refuse("guided decoding is not available", "structured_outputs_regex")
_refuse("the multi-turn length limit is per turn (max_completion_length each turn)",
        "completion_length_limit_scope", harmless=lambda v: v in (None, "per_round"))
_refuse("pipeline, data and expert parallel vLLM are not available; run several rollout workers instead",
        "vllm_pipeline_parallel_size", "vllm_data_parallel_size", "vllm_enable_expert_parallel")
_refuse("vLLM options beyond rollout.* are not available (quantization, reasoning parser, speculative decoding, "
        "engine keywords)", "vllm_quantization", "vllm_reasoning_parser", "vllm_speculative_config",
        "vllm_engine_kwargs")
_refuse("the in-process engine takes vLLM's default 0.9 of its GPU (rollout.kv_cache_gib sizes a CPU engine "
        "only): give each rollout worker its own GPU, or start `vllm serve --gpu-memory-utilization F` and set "
        "rollout.engine = \"server\"", "vllm_gpu_memory_utilization")
_refuse("offloading is not available: the learner and the rollout engine run as separate processes (or share a "
        "GPU with rollout.colocate)", "offload_optimizer", "offload_model")
_refuse("rollout off-policy metrics are logged only with rollout_importance_sampling_mode",
        "log_rollout_offpolicy_metrics")
_refuse("a teacher model (GKD, on-policy distillation) is not available", "teacher_model", "teacher_model_server")
_refuse("CHORD (an SFT dataset mixed into GRPO) is not available", "chord_sft_dataset")
_refuse("RLSD advantage reweighting is not available", "advantage_reweight")
_refuse("the SDAR distillation loss is not available", "sdar_loss_coef")
_refuse("a custom reward-model plugin is not available: reward.reward_model scores with a local "
        "sequence-classification model or an http(s) service; other logic is a reward function "
        "(run.external_plugins)", "reward_model_plugin", "reward_template")
_not_needed("the reward and reference models' types come from their own config.json, their revision is the "
            "one model.model_revision names or the Hub's default", "reward_model_type", "reward_model_revision",
            "ref_model_type", "ref_model_revision")


# ---------------------------------------------------------------------------------------------------
# Lookup and translation


def table() -> dict[str, SwiftArg]:
    """Every ms-swift argument the table knows, by name (in the table's order)."""
    return dict(_TABLE)


def lookup(name: str) -> SwiftArg | None:
    return _TABLE.get(name)


def counts() -> dict[str, int]:
    """How many arguments are accepted / mapped / not needed / refused."""
    return {kind: sum(a.kind == kind for a in _TABLE.values()) for kind in KINDS}


def translate(name: str, value: Any, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"section.field": value}`` for one ms-swift argument; a SwiftArgError names the argument, the value and
    why it is refused. ``given`` holds the other ms-swift arguments of the same source (for pairs such as
    vllm_server_host and vllm_server_port)."""
    arg = _TABLE.get(name)
    if arg is None:
        raise SwiftArgError(f"{name} is not an ms-swift GRPO argument{_did_you_mean(name)}")
    try:
        if arg.convert is not None and arg.kind in (ACCEPTED, MAPPED):
            return arg.convert(value, given or {name: value})
        return arg.translate(value)
    except (ValueError, TypeError) as exc:
        raise SwiftArgError(f"ms-swift's {name}={_show(value)} is refused: {exc}") from None


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _did_you_mean(name: str) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(_TABLE), n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def homes(name: str) -> tuple[str, ...]:
    """The rollstream fields an accepted or mapped ms-swift argument sets."""
    arg = _TABLE.get(name)
    return arg.targets if arg is not None and arg.kind in (ACCEPTED, MAPPED) else ()


# ---------------------------------------------------------------------------------------------------
# Command-line flags, as ms-swift writes them: --name value [value ...], --name=value, true/false


def parse_flags(tokens: Iterable[str]) -> dict[str, Any]:
    """``["--reward_funcs", "accuracy", "format", "--num_generations", "8"]`` -> ``{"reward_funcs": ["accuracy",
    "format"], "num_generations": 8}``: each token parses as JSON-ish (true/false, none, numbers, {...}, [...]),
    several tokens are a list, a flag alone is true. Unknown names, repeated flags and stray values are a
    SwiftArgError."""
    out: dict[str, Any] = {}
    name: str | None = None
    values: list[Any] = []

    def finish() -> None:
        if name is None:
            return
        if name in out:
            raise SwiftArgError(f"--{name} is given twice; give it once (several values follow one flag: "
                                f"--{name} a b)")
        out[name] = True if not values else values[0] if len(values) == 1 else values

    for token in tokens:
        if token.startswith("--") and len(token) > 2 and not _is_number(token):
            finish()
            name, _, inline = token[2:].partition("=")
            name = name.replace("-", "_")
            if name not in _TABLE:
                raise SwiftArgError(f"--{name}: not a rollstream flag nor an ms-swift GRPO argument{_did_you_mean(name)}")
            values = [_parse_token(inline)] if inline else []
        elif name is None:
            raise SwiftArgError(f"unexpected argument {token!r} (ms-swift flags are --name value)")
        else:
            values.append(_parse_token(token))
    finish()
    return out


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _parse_token(token: str) -> Any:
    lowered = token.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(token)
    except ValueError:
        pass
    if _is_number(token) and lowered not in ("nan", "inf", "-inf", "infinity"):
        return float(token)
    if token[:1] in "{[":
        try:
            return json.loads(token)
        except json.JSONDecodeError:
            return token
    return token


# ---------------------------------------------------------------------------------------------------
# An ms-swift run's args.json


@dataclass
class Conversion:
    """What ``from_args_json`` made of an args.json."""

    values: dict[str, Any] = field(default_factory=dict)
    """"section.field" -> value: the rollstream config."""
    carried: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """ms-swift name -> the rollstream fields it set."""
    refused: list[tuple[str, Any, str]] = field(default_factory=list)
    """(name, value, reason): set to something rollstream lacks; not carried."""
    no_effect: list[tuple[str, Any, str]] = field(default_factory=list)
    """(name, value, reason): set away from ms-swift's default, accepted, no effect here."""
    at_default: list[str] = field(default_factory=list)
    """At ms-swift's default and without effect here (or nothing to carry)."""
    unknown: list[tuple[str, Any]] = field(default_factory=list)
    """Not in the table (another ms-swift version's argument?): not carried."""
    notes: list[str] = field(default_factory=list)
    """How values that ms-swift filled in at start or that depend on each other were carried."""
    changes: list[tuple[str, Any, str]] = field(default_factory=list)
    """(name, ms-swift's value, what rollstream does instead): the converted run would not train what the
    ms-swift run trained (every refused argument, the training processes, the precision, an unknown argument
    set to something); ``rollstream config from-swift`` writes the config only with --accept-changes."""

    def take(self, name: str, value: Any, arg: SortedArg, translate: Callable[..., dict[str, Any]],
             given: Mapping[str, Any], at_default: bool) -> None:
        """Sort one argument of the table: refused, no effect, at its default, or carried (``translate(name,
        value, given)``: the rollstream values it sets; a SwiftArgError refuses it). The first of two
        arguments setting one field keeps it (a note says so)."""
        if arg.kind in (REFUSED, NOT_NEEDED):
            if not arg.is_harmless(value):
                self.refused.append((name, value, arg.why))
            elif at_default or arg.kind == REFUSED:
                self.at_default.append(name)
            else:
                self.no_effect.append((name, value, arg.why))
            return
        try:
            assigned = translate(name, value, given)
        except SwiftArgError as exc:
            self.refused.append((name, value, str(exc).split(" is refused: ", 1)[-1]))
            return
        if not assigned:
            self.at_default.append(name)
            return
        for dotted, new in assigned.items():
            old = self.values.get(dotted, _MISSING)
            if old is not _MISSING and old != new:
                owner = next(n for n, t in self.carried.items() if dotted in t)
                self.notes.append(f"{name}={_show(value)} and {owner} both set {dotted}; kept {owner}'s {_show(old)}")
                continue
            self.values[dotted] = new
        self.carried[name] = tuple(assigned)


# What an ms-swift command (or launch file) that leaves these arguments out trains, where rollstream's own
# default differs in what trains: ms-swift's train_type is lora (rollstream's TOML default is full).
_COMMAND_DEFAULTS: dict[str, tuple[Any, tuple[str, ...]]] = {
    "learner.train_type": ("lora", ("train_type", "tuner_type")),
}


def command_defaults(given: Mapping[str, Any]) -> dict[str, Any]:
    """``{"section.field": value}``: ms-swift's defaults that an ms-swift command line (``--rlhf_type grpo ...``
    without ``-c``) or launch file takes where ``given`` leaves the argument out, so it trains what ms-swift
    trains (LoRA, at ms-swift's 1e-4); a native TOML keeps rollstream's (full, 1e-5)."""
    return {dotted: value for dotted, (value, names) in _COMMAND_DEFAULTS.items()
            if not any(name in given for name in names)}


_MODEL_MAX = re.compile(r"max_model_len=(\d+)")


def from_args_json(args: Mapping[str, Any]) -> Conversion:
    """Convert the ``args.json`` an ms-swift run writes (every argument, most at their defaults, after
    ms-swift's own start-up filled some in) into rollstream config values, sorting every argument into
    carried / refused / no effect / at default / unknown."""
    conv = Conversion()
    args = dict(args)
    if args.get("rlhf_type", "grpo") != "grpo":
        raise SwiftArgError(f"rlhf_type={args['rlhf_type']!r}: rollstream converts GRPO runs only (rlhf_type grpo)")
    env = dict(args.pop("ENV", None) or {})  # a launch file's environment (`swift rlhf x.yaml`)
    given = dict(args)
    _couple(args, conv)
    for name, value in args.items():
        arg = _TABLE.get(name)
        if arg is None:
            conv.unknown.append((name, value))
            continue
        conv.take(name, value, arg, translate, args, is_default(name, value))
    for dotted, value in list(conv.values.items()):
        if isinstance(value, Deferred):
            try:
                conv.values[dotted] = value.resolve(lambda key: conv.values.get(key, _ROLLSTREAM_DEFAULTS.get(key)))
            except ValueError as exc:
                del conv.values[dotted]
                conv.carried.pop("padding_free", None)
                conv.refused.append(("padding_free", True, str(exc)))
    for dotted, value in command_defaults(given).items():  # a launch file that leaves train_type out
        conv.values[dotted] = value
        conv.notes.append(f"{dotted} = {_show(value)}: ms-swift's default where the run does not give train_type "
                          f"(learning rate 1e-4 unless learning_rate is given), as ms-swift trains it")
    if env:
        conv.notes.append(f"ENV not carried: set these in the environment of every rollstream process: "
                          f"{', '.join(f'{k}={v}' for k, v in env.items())}")
    conv.changes = _training_changes(given, env, conv)
    return conv


# rollstream's learner dtype where a converted run does not set model.torch_dtype (pipeline.config's default).
_ROLLSTREAM_DTYPE = "float32"


def _training_changes(given: Mapping[str, Any], env: Mapping[str, Any], conv: Conversion) -> list[tuple[str, Any, str]]:
    """Where the converted config would not train what the ms-swift run trained (Conversion.changes)."""
    changes = [(name, value, f"not carried (refused): {why}") for name, value, why in conv.refused]
    # args.json records the processes (global_world_size); a launch file's ENV asks for them (NPROC_PER_NODE)
    counts = [(int(str(v)), name) for name, v in (("global_world_size", given.get("global_world_size")),
                                              ("NPROC_PER_NODE", env.get("NPROC_PER_NODE")))
              if str(v).isdigit()]
    processes, source = max(counts, default=(1, ""))
    if processes > 1:
        batch = conv.values.get("grpo.per_device_train_batch_size")
        folded = f"per_device_train_batch_size {batch} in it (the same global mini-batch)" if source == (
            "global_world_size") and batch else "per_device_train_batch_size as given (a smaller global mini-batch)"
        changes.append((source, processes, (f"ms-swift trained in {processes} processes (DDP, DeepSpeed or FSDP); "
                        f"rollstream's learner is one process with {folded}; grpo.world_size = {processes} shards it "
                        f"over {processes} processes with FSDP2 instead (torchrun, docs/learner.md)")))
    dtype = conv.values.get("model.torch_dtype", _ROLLSTREAM_DTYPE)
    amp = "bfloat16" if _truthy(given.get("bf16")) else "float16" if _truthy(given.get("fp16")) else None
    if given.get("torch_dtype") is None:
        trained = f"{amp} mixed precision over the model's own dtype" if amp else "the model's own dtype (config.json)"
        changes.append(("torch_dtype", None, (f"ms-swift trains in {trained}; rollstream's learner and engine in "
                        f"{dtype}: set torch_dtype (bfloat16 on a GPU)")))
    elif amp and amp != dtype:
        flag = "bf16" if amp == "bfloat16" else "fp16"
        changes.append((flag, True, (f"ms-swift trains with {amp} mixed precision over {given['torch_dtype']} "
                        f"weights; rollstream's learner trains in model.torch_dtype = {dtype}, with no mixed "
                        f"precision: set torch_dtype = {amp} for {amp} weights")))
    changes += [(name, value, ("not carried: not an ms-swift argument rollstream knows (another ms-swift "
                 "version's?); check what it does")) for name, value in conv.unknown if not _falsy(value)]
    return changes


def command_changes(flags: Mapping[str, Any], get: Callable[[str], Any],
                    environ: Mapping[str, str]) -> list[tuple[str, Any, str]]:
    """The command line's counterpart of Conversion.changes, for ms-swift flags given to ``rollstream train``
    (and every command that reads a config): a mixed-precision flag the learner's dtype does not match, and
    ms-swift's launcher variable NPROC_PER_NODE > 1 for a one-process learner. ``get("section.field")`` reads
    the loaded config. A refused flag is already an error when the config loads; train_type takes ms-swift's
    default (``command_defaults``)."""
    changes = []
    dtype = get("model.torch_dtype")
    for flag, amp in (("bf16", "bfloat16"), ("fp16", "float16")):
        if _truthy(flags.get(flag)) and dtype != amp:
            changes.append((flag, True, (f"ms-swift trains with {amp} mixed precision; rollstream's learner trains "
                            f"in model.torch_dtype = {dtype}: give --torch_dtype {amp} (the learner's and the "
                            f"engine's dtype), or leave --{flag} out")))
    nproc = environ.get("NPROC_PER_NODE", "")
    if "rlhf_type" in flags and nproc.isdigit() and int(nproc) > 1 and get("grpo.world_size") == 1:
        changes.append(("NPROC_PER_NODE", int(nproc), (f"ms-swift's launcher starts {nproc} training processes; "
                        f"rollstream's learner is one process: set grpo.world_size = {nproc} (FSDP2, started by "
                        f"torchrun: docs/learner.md), or unset NPROC_PER_NODE")))
    return changes


def _truthy(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.lower() == "true")


# rollstream's defaults that a Deferred may read when the args.json did not set them (kept here: this module
# imports nothing from the config).
_ROLLSTREAM_DEFAULTS = {"grpo.per_device_train_batch_size": 8, "grpo.max_completion_length": 512, "data.max_length": None}


def _couple(args: dict[str, Any], conv: Conversion) -> None:
    """Arguments that ms-swift filled in at start, or that only mean something together, before the
    one-by-one conversion (each rule says what it did in ``conv.notes``)."""

    def drop(name: str, why: str) -> None:
        if name in args:
            conv.notes.append(f"{name}={_show(args.pop(name))} not carried: {why}")

    primary = args.get("max_completion_length")
    for alias in ("max_new_tokens", "response_length"):
        if alias in args and args[alias] in (None, primary):
            args.pop(alias)
            conv.at_default.append(alias)
    if "evaluation_strategy" in args and args["evaluation_strategy"] in (None, args.get("eval_strategy")):
        args.pop("evaluation_strategy")
        conv.at_default.append("evaluation_strategy")
    if "no_cuda" in args and not args["no_cuda"]:
        args.pop("no_cuda")
        conv.at_default.append("no_cuda")
    if args.get("eval_strategy") == "no":
        drop("eval_steps", "evaluation is off (eval_strategy no)")
    if args.get("save_strategy") == "no":
        drop("save_steps", "save_strategy no (rollstream saves the final weights; learner.save_steps = 0)")
    if args.get("generation_batch_size") is not None and args.get("steps_per_generation") is not None:
        drop("generation_batch_size", f"derived from steps_per_generation={args['steps_per_generation']} "
             "(rollstream takes one of the two)")
    for name in ("output_dir", "logging_dir"):
        drop(name, "the ms-swift run's own directory; rollstream writes runs/<name>-<time> unless run.output_dir is set")
    if args.get("ref_model") is not None and args.get("ref_model") == args.get("model"):
        drop("ref_model", "ms-swift's copy of model (its full-training default); rollstream's reference is a frozen "
             "copy of the initial policy by default")
    template = args.get("template")
    meta = f"{args.get('model_meta') or ''} {args.get('template_meta') or ''}"
    if template and (f"template='{template}'" in meta or f"template_type='{template}'" in meta):
        drop("template", "ms-swift's own template for this model type, filled in at start; rollstream renders "
             "prompts with the tokenizer's chat template (model.chat_template to give another)")
    model_max = _MODEL_MAX.search(str(args.get("model_info") or ""))
    if model_max and args.get("max_length") == int(model_max[1]):
        drop("max_length", f"ms-swift's default, the model's maximum ({model_max[1]}); rollstream derives the prompt "
             "cap as rollout.max_model_len - max_completion_length")
    if args.get("train_type", args.get("tuner_type")) == "full":
        for name in ("lora_rank", "lora_alpha", "lora_dropout", "target_modules", "vllm_enable_lora"):
            if name in args:
                args.pop(name)
                conv.at_default.append(name)
    world = args.get("global_world_size")
    if isinstance(world, int) and world > 1:
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if isinstance(args.get(name), int):
                args[name] *= world
                conv.notes.append(f"{name}: {args[name] // world} per device x {world} ms-swift training processes "
                                  f"(global_world_size) = {args[name]} in rollstream's one learner process (the same "
                                  f"global mini-batch; grpo.world_size for an FSDP2 learner)")


# ---------------------------------------------------------------------------------------------------
# The documentation page


def render_markdown() -> str:
    """docs/swift-arguments.md: every argument with its disposition."""
    c = counts()
    lines = [
        "# ms-swift arguments",
        "",
        (
            "<!-- generated: .venv/bin/python -m config.swift_args > docs/swift-arguments.md "
            "(tests/test_swift_args.py checks it); edit the table in config/swift_args.py -->"
        ),
        "",
        (
            "Every argument of ms-swift's `swift rlhf --rlhf_type grpo` (its `RLHFArguments` at v3.12.6 and main, "
            "with the transformers `TrainingArguments` under it, and the values ms-swift writes into `args.json` at "
            "start) and a few TRL names, as rollstream takes them: in a TOML file (at the top level, or inside the "
            "section of the rollstream field), as `rollstream train` / `config show` flags (`--reward_funcs "
            "accuracy format`), and in `rollstream config from-swift args.json` "
            "([Configuration](configuration.md#ms-swift-arguments))."
        ),
        "",
        (
            "The default column is ms-swift main's. Where rollstream's own default differs from ms-swift "
            "3.12.6's, the README's table of defaults lists it (tests/test_swift_defaults.py checks it against "
            "that release's source, tests/data_swift/swift_defaults.json). `--rlhf_type grpo` flags without `-c` train LoRA without "
            "`--train_type`, as ms-swift. `config from-swift` lists every refused argument, training-process count "
            "and precision it would change under \"changes what trains\" and writes nothing (exit 3) until "
            "`--accept-changes`."
        ),
        "",
        f"- **accepted** ({c[ACCEPTED]}): the rollstream field of the same name and meaning;",
        f"- **mapped** ({c[MAPPED]}): a rollstream field under another name, or a converted value;",
        (
            f"- **not needed** ({c[NOT_NEEDED]}): accepted without effect, for the reason given (a few take "
            "only some values);"
        ),
        (
            f"- **refused** ({c[REFUSED]}): a feature rollstream lacks; ms-swift's default is accepted (it asks "
            "for nothing), any other value is an error giving the reason."
        ),
        "",
        f"{sum(c.values())} arguments in all.",
        "",
        "| argument | ms-swift default | disposition | rollstream | why / how |",
        "|---|---|---|---|---|",
    ]
    for arg in sorted(_TABLE.values(), key=lambda a: (KINDS.index(a.kind), a.name)):
        where = ", ".join(f"`{t}`" for t in arg.targets)
        default = "" if arg.name in _RUNTIME_DEFAULTS else f"`{_cell(_show(arg.default))}`"
        lines.append(f"| `{arg.name}` | {default} | {arg.kind} | {where} | {_cell(arg.why)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_grouped() -> str:
    """The same table, short: accepted names, mapped ones with their fields, refused and not needed ones grouped
    by reason (``python -m config.swift_args --grouped``: for a release note)."""
    c = counts()
    lines = [
        (
            f"{sum(c.values())} ms-swift arguments: {c[ACCEPTED]} accepted, {c[MAPPED]} mapped, {c[NOT_NEEDED]} "
            f"not needed, {c[REFUSED]} refused (docs/swift-arguments.md)."
        ),
        "",
        f"Accepted ({c[ACCEPTED]}, same name and meaning): "
        + ", ".join(f"`{a.name}`" for a in sorted(_TABLE.values(), key=lambda a: a.name) if a.kind == ACCEPTED),
        "",
        f"Mapped ({c[MAPPED]}):",
    ]
    lines += [f"- `{a.name}` -> {', '.join(f'`{t}`' for t in a.targets)}: {a.why}"
              for a in sorted(_TABLE.values(), key=lambda a: a.name) if a.kind == MAPPED]
    for kind in (REFUSED, NOT_NEEDED):
        by_reason: dict[str, list[str]] = {}
        for a in _TABLE.values():
            if a.kind == kind:
                by_reason.setdefault(a.why, []).append(a.name)
        lines += ["", f"{kind.capitalize()} ({c[kind]}):"]
        lines += [f"- {', '.join(f'`{n}`' for n in names)}: {why}" for why, names in by_reason.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # regenerate the page: python -m config.swift_args > docs/swift-arguments.md
    import sys

    print(render_grouped() if "--grouped" in sys.argv[1:] else render_markdown(), end="")
