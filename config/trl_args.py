"""TRL's ``GRPOConfig`` by its own names: one table, and ``rollstream config from-trl``'s conversion.

Each field of TRL's ``GRPOConfig`` (trl 1.16.0, over transformers 5.19.0's ``TrainingArguments``; the fields
and their declared defaults below are read from those dataclasses) is one ``TrlArg``, classified as ms-swift's
(config/swift_args.py): accepted, mapped (to which rollstream field), not needed, or refused with the reason.

Where TRL's name is also an ms-swift argument with the same meaning, the ms-swift entry decides (``swift``:
the same fields, the same conversion). A name means one thing in a TOML or on the command line: ms-swift's
where ms-swift has it, TRL's where only TRL has it (``vllm_importance_sampling_correction``,
``sapo_temperature_pos``, ...). TRL's different *defaults* (beta 0, loss_type dapo, temperature 1, learning rate
1e-6, the importance-sampling correction on, ...) apply where the user says "this is a TRL run": ``rollstream
config from-trl grpo_config.json|yaml`` (``from_trl``) fills every field the file leaves out with TRL's default,
so the carried-over run trains what TRL trains, and lists every field that would train differently.

docs/trl-arguments.md is generated from this table (``render_markdown``). Pure: imports only swift_args.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from config import swift_args
from config.swift_args import (
    ACCEPTED,
    KINDS,
    MAPPED,
    NOT_NEEDED,
    REFUSED,
    Conversion,
    SwiftArg,
    SwiftArgError,
    _as_bool,
    _json_object,
    _same_value,
    _show,
)

TRL_VERSION = "1.16.0"
TRANSFORMERS_VERSION = "5.19.0"

Convert = Callable[[Any, Mapping[str, Any]], dict[str, Any]]

# Every GRPOConfig field with its declared default (before __post_init__), in the dataclass's order:
# ``{f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}`` at trl 1.16.0 / transformers 5.19.0.
_DEFAULTS: dict[str, Any] = {
    'output_dir': None, 'per_device_train_batch_size': 8, 'num_train_epochs': 3.0, 'max_steps': -1, 'learning_rate':
    1e-06, 'lr_scheduler_type': 'linear', 'lr_scheduler_kwargs': None, 'warmup_steps': 0, 'optim':
    'adamw_torch_fused', 'optim_args': None, 'weight_decay': 0.0, 'adam_beta1': 0.9, 'adam_beta2': 0.999,
    'adam_epsilon': 1e-08, 'optim_target_modules': None, 'gradient_accumulation_steps': 1,
    'average_tokens_across_devices': True, 'max_grad_norm': 1.0, 'label_smoothing_factor': 0.0, 'bf16': None,
    'fp16': False, 'bf16_full_eval': False, 'fp16_full_eval': False, 'tf32': None, 'gradient_checkpointing': True,
    'gradient_checkpointing_kwargs': None, 'torch_compile': False, 'torch_compile_backend': None,
    'torch_compile_mode': None, 'use_liger_kernel': False, 'liger_kernel_config': None, 'use_cache': False,
    'neftune_noise_alpha': None, 'torch_empty_cache_steps': None, 'auto_find_batch_size': False, 'logging_strategy':
    'steps', 'logging_steps': 10, 'logging_first_step': False, 'log_on_each_node': True, 'logging_nan_inf_filter':
    True, 'include_num_input_tokens_seen': 'no', 'log_level': 'passive', 'log_level_replica': 'warning',
    'disable_tqdm': None, 'report_to': 'none', 'run_name': None, 'project': 'huggingface', 'trackio_space_id': None,
    'trackio_bucket_id': None, 'trackio_static_space_id': None, 'eval_strategy': 'no', 'eval_steps': None,
    'eval_delay': 0, 'per_device_eval_batch_size': 8, 'prediction_loss_only': False, 'eval_on_start': False,
    'eval_do_concat_batches': True, 'eval_use_gather_object': False, 'eval_accumulation_steps': None,
    'include_for_metrics': [], 'batch_eval_metrics': False, 'save_only_model': False, 'save_strategy': 'steps',
    'save_steps': 500, 'save_on_each_node': False, 'save_total_limit': None, 'enable_jit_checkpoint': False,
    'push_to_hub': False, 'hub_token': None, 'hub_private_repo': None, 'hub_model_id': None, 'hub_strategy':
    'every_save', 'hub_always_push': False, 'hub_revision': None, 'load_best_model_at_end': False,
    'metric_for_best_model': None, 'greater_is_better': None, 'ignore_data_skip': False,
    'restore_callback_states_from_checkpoint': False, 'full_determinism': False, 'seed': 42, 'data_seed': None,
    'use_cpu': False, 'accelerator_config': None, 'parallelism_config': None, 'dataloader_drop_last': False,
    'dataloader_num_workers': 0, 'dataloader_pin_memory': True, 'dataloader_persistent_workers': False,
    'dataloader_prefetch_factor': None, 'dataloader_multiprocessing_context': None, 'dataloader_in_order': True,
    'remove_unused_columns': False, 'label_names': None, 'train_sampling_strategy': 'random', 'length_column_name':
    'length', 'ddp_find_unused_parameters': None, 'ddp_bucket_cap_mb': None, 'ddp_broadcast_buffers': None,
    'ddp_static_graph': None, 'ddp_backend': None, 'ddp_timeout': 1800, 'fsdp': None, 'fsdp_config': None,
    'deepspeed': None, 'debug': '', 'skip_memory_metrics': True, 'do_train': False, 'do_eval': False, 'do_predict':
    False, 'resume_from_checkpoint': None, 'local_rank': -1, 'model_init_kwargs': None, 'trust_remote_code': False,
    'router_aux_loss_coef': None, 'disable_dropout': False, 'cast_lm_head_to_fp32': False, 'num_generations': 8,
    'num_generations_eval': None, 'max_completion_length': 512, 'ds3_gather_for_generation': True,
    'shuffle_dataset': True, 'pad_to_multiple_of': 'auto', 'generation_batch_size': None, 'steps_per_generation':
    None, 'temperature': 1.0, 'top_p': 1.0, 'top_k': 0, 'min_p': None, 'generation_kwargs': None,
    'chat_template_kwargs': None, 'repetition_penalty': 1.0, 'cache_implementation': None, 'use_vllm': False,
    'vllm_mode': 'colocate', 'vllm_model_impl': 'vllm', 'vllm_enable_sleep_mode': False,
    'vllm_structured_outputs_regex': None, 'vllm_server_base_url': None, 'vllm_server_host': '0.0.0.0',
    'vllm_server_port': 8000, 'vllm_server_timeout': 240.0, 'vllm_group_port': 51216, 'vllm_gpu_memory_utilization':
    0.3, 'vllm_max_model_length': None, 'vllm_tensor_parallel_size': 1, 'beta': 0.0, 'num_iterations': 1, 'epsilon':
    0.2, 'delta': None, 'epsilon_high': None, 'sapo_temperature_neg': 1.05, 'sapo_temperature_pos': 1.0,
    'vespo_k_pos': 2.0, 'vespo_lambda_pos': 3.0, 'vespo_k_neg': 3.0, 'vespo_lambda_neg': 2.0,
    'importance_sampling_level': 'token', 'reward_weights': None, 'multi_objective_aggregation':
    'sum_then_normalize', 'scale_rewards': 'group', 'loss_type': 'dapo', 'mask_truncated_completions': False,
    'sync_ref_model': False, 'ref_model_mixup_alpha': 0.6, 'ref_model_sync_steps': 512, 'top_entropy_quantile': 1.0,
    'entropy_coef': 0.0, 'use_adaptive_entropy': False, 'entropy_coef_min': 0.0, 'entropy_coef_max': 1.0,
    'entropy_coef_delta': 0.005, 'entropy_target': 0.2, 'max_tool_calling_iterations': None,
    'vllm_importance_sampling_correction': True, 'vllm_importance_sampling_mode': 'sequence_mask',
    'vllm_importance_sampling_clip_max': 3.0, 'vllm_importance_sampling_clip_min': None,
    'off_policy_mask_threshold': None, 'use_bias_correction_kl': True, 'log_completions': False, 'log_multimodal':
    True, 'num_completions_to_print': None, 'log_unique_prompts': False, 'log_completions_hub_repo': None,
    'use_transformers_continuous_batching': False, 'transformers_continuous_batching_config': None,
    'use_transformers_paged': False, 'vllm_importance_sampling_cap': None
}


@dataclass(frozen=True)
class TrlArg:
    name: str
    kind: str
    targets: tuple[str, ...] = ()
    """The rollstream fields it sets ("section.field")."""
    why: str = ""
    """Refused / not needed: the reason; mapped: how the value is converted."""
    convert: Convert | None = None
    harmless: Callable[[Any], bool] | None = None
    """Refused / not needed: the values accepted without effect; None = TRL's default only (refused) or every
    value (not needed)."""
    trains: bool = True
    """Refused: another value changes what trains (False: only resources, logging, the hub)."""
    swift: bool = False
    """Same name and meaning as an ms-swift argument: that entry (config/swift_args.py) converts it."""

    @property
    def default(self) -> Any:
        return _DEFAULTS[self.name]

    def is_harmless(self, value: Any) -> bool:
        if self.harmless is not None:
            return self.harmless(value)
        if self.kind == NOT_NEEDED:
            return True
        return _same_value(value, self.default)


# ---------------------------------------------------------------------------------------------------
# Value converters (a ValueError's message says what is refused and what to do instead)


def _set(target: str) -> Convert:
    def convert(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        return {} if value is None else {target: value}

    return convert


def _flag(target: str) -> Convert:
    def convert(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        return {} if value is None else {target: _as_bool(value)}

    return convert


def _model_init_kwargs(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = _json_object(value) or {}
    out: dict[str, Any] = {}
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype is not None:
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype {dtype!r}: give bfloat16, float16 or float32 (rollstream's model.torch_dtype; "
                             f"TRL's default is float32)")
        out["model.torch_dtype"] = dtype
    if kwargs.get("revision") is not None:
        out["model.model_revision"] = kwargs["revision"]
    other = sorted(set(kwargs) - {"dtype", "torch_dtype", "revision", "attn_implementation", "device_map"})
    if other:
        raise ValueError(f"{', '.join(other)}: from_pretrained keywords beyond dtype and revision are not available")
    return out


def _aggregation(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    if value in (None, "sum_then_normalize"):
        return {}  # the weighted sum, normalised as scale_rewards says: rollstream's advantage
    if value == "normalize_then_sum":  # TRL's GDPO: per function within the group, the weighted sum over the batch
        return {"grpo.scale_rewards": "gdpo"}
    raise ValueError(f"{value!r} is not one of sum_then_normalize, normalize_then_sum")


_IS_NAMES = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_max", "vllm_importance_sampling_cap")
_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _importance_sampling(name: str) -> Convert:
    """TRL's vLLM importance-sampling correction, read together: the first of _IS_NAMES given sets the three
    rollstream fields, with TRL's defaults (on, sequence_mask, 3.0) for the ones not given."""

    def convert(value: Any, given: Mapping[str, Any]) -> dict[str, Any]:
        if next(n for n in _IS_NAMES if n in given or n == name) != name:
            return {}
        if not _as_bool(given.get("vllm_importance_sampling_correction", _DEFAULTS[_IS_NAMES[0]])):
            return {"grpo.rollout_importance_sampling_mode": None}
        mode = given.get("vllm_importance_sampling_mode", _DEFAULTS["vllm_importance_sampling_mode"])
        if mode not in _IS_MODES:
            raise ValueError(f"vllm_importance_sampling_mode {mode!r} is not one of {', '.join(_IS_MODES)}")
        cap = given.get("vllm_importance_sampling_cap")  # TRL's deprecated name wins, as its __post_init__
        clip_max = cap if cap is not None else given.get("vllm_importance_sampling_clip_max",
                                                         _DEFAULTS["vllm_importance_sampling_clip_max"])
        if clip_max is None:
            raise ValueError("no upper bound (vllm_importance_sampling_clip_max = None) is not available: the rollout "
                             "IS weight always has one (grpo.rollout_importance_sampling_threshold)")
        return {"grpo.rollout_importance_sampling_mode": mode,
                "grpo.rollout_importance_sampling_threshold": float(clip_max),
                "grpo.rollout_importance_sampling_convention": "trl"}

    return convert


# ---------------------------------------------------------------------------------------------------
# The table

_TABLE: dict[str, TrlArg] = {}


def _add(arg: TrlArg) -> None:
    if arg.name not in _DEFAULTS:
        raise AssertionError(f"{arg.name} is not a field of TRL {TRL_VERSION}'s GRPOConfig")
    if arg.name in _TABLE:
        raise AssertionError(f"TRL field {arg.name} is in the table twice")
    _TABLE[arg.name] = arg


def _as_swift(*names: str, trains: bool = True) -> None:
    """Same name, same meaning as ms-swift's argument: its entry converts it (TRL's default also counts as
    harmless where ms-swift's default differs)."""
    for name in names:
        sw = swift_args.lookup(name)
        if sw is None:
            raise AssertionError(f"{name} is not an ms-swift argument")
        harmless = _trl_or_swift_default(name, sw) if sw.kind in (REFUSED, NOT_NEEDED) else None
        _add(TrlArg(name, sw.kind, sw.targets, sw.why, None, harmless, trains, swift=True))


def _trl_or_swift_default(name: str, sw: SwiftArg) -> Callable[[Any], bool]:
    return lambda value: _same_value(value, _DEFAULTS[name]) or sw.is_harmless(value)


def _map(name: str, targets: str | tuple[str, ...], why: str, convert: Convert | None = None) -> None:
    targets = (targets,) if isinstance(targets, str) else targets
    _add(TrlArg(name, MAPPED, targets, why, convert or _set(targets[0])))


def _not_needed(why: str, *names: str, harmless: Callable[[Any], bool] | None = None) -> None:
    for name in names:
        _add(TrlArg(name, NOT_NEEDED, (), why, harmless=harmless))


def _refuse(why: str, *names: str, trains: bool = True, harmless: Callable[[Any], bool] | None = None) -> None:
    for name in names:
        _add(TrlArg(name, REFUSED, (), why, harmless=harmless, trains=trains))


def _off(value: Any) -> bool:
    return value in (None, False, 0, 0.0, "", {}, [], "false", "False", "none", "None")


# Refused values of these ms-swift-shared names change resources, logging or evaluation, not what trains.
_NOT_TRAINING = (
    "output_dir", "report_to", "log_level", "push_to_hub", "load_best_model_at_end", "torch_compile",
    "torch_compile_backend", "torch_compile_mode", "use_liger_kernel", "eval_strategy", "eval_steps", "save_steps",
    "save_total_limit", "per_device_eval_batch_size", "num_generations_eval", "eval_on_start", "use_cpu",
    "vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_tensor_parallel_size",
    "log_completions", "num_completions_to_print", "auto_find_batch_size",
)

# --- TRL-only names, and shared names whose TRL reading differs ------------------------------------
_map("model_init_kwargs", ("model.torch_dtype", "model.model_revision"),
     "dtype (TRL's default float32) is model.torch_dtype, revision model.model_revision; other from_pretrained "
     "keywords are refused", _model_init_kwargs)
_map("shuffle_dataset", "data.dataset_shuffle", "TRL's name of dataset_shuffle", _flag("data.dataset_shuffle"))
_map("vllm_max_model_length", "rollout.max_model_len", "TRL's name of vllm_max_model_len")
_map("vllm_enable_sleep_mode", "rollout.colocate", "true = share the learner's GPU, vLLM asleep while it trains",
     lambda value, given: {"rollout.colocate": True} if value is not None and _as_bool(value) else {})
_map("sapo_temperature_pos", "grpo.tau_pos", "TRL's name of ms-swift's tau_pos (sapo's gate, positive advantages)")
_map("sapo_temperature_neg", "grpo.tau_neg", "TRL's name of ms-swift's tau_neg (sapo's gate, other advantages)")
_map("multi_objective_aggregation", "grpo.scale_rewards",
     "sum_then_normalize (TRL's default) = rollstream's; normalize_then_sum = scale_rewards \"gdpo\" (each reward "
     "function normalised within its group, weighted sum normalised over the batch)", _aggregation)
_map("off_policy_mask_threshold", "grpo.off_policy_sequence_mask_delta",
     "TRL's name of ms-swift's off_policy_sequence_mask_delta (DeepSeek-V3.2's sequence mask)")
_map("use_bias_correction_kl", "grpo.use_bias_correction_kl",
     "the KL term times the importance ratio (TRL's default true; rollstream's and ms-swift's false)",
     _flag("grpo.use_bias_correction_kl"))
_IS_TARGETS = ("grpo.rollout_importance_sampling_mode", "grpo.rollout_importance_sampling_threshold",
               "grpo.rollout_importance_sampling_convention")
_map("vllm_importance_sampling_correction", _IS_TARGETS,
     "true (TRL's default) = the rollout IS weight of the engine/learner mismatch, TRL's convention (the sequence "
     "ratio is the product of the token ratios, on the policy term only), with TRL's mode and cap where not "
     "given; false = off", _importance_sampling("vllm_importance_sampling_correction"))
_map("vllm_importance_sampling_mode", _IS_TARGETS,
     "token_truncate, token_mask, sequence_truncate, sequence_mask (TRL's default)",
     _importance_sampling("vllm_importance_sampling_mode"))
_map("vllm_importance_sampling_clip_max", _IS_TARGETS, "the weight's upper bound C (TRL's default 3.0; None is "
     "refused)", _importance_sampling("vllm_importance_sampling_clip_max"))
_map("vllm_importance_sampling_cap", _IS_TARGETS, "TRL's deprecated name of vllm_importance_sampling_clip_max",
     _importance_sampling("vllm_importance_sampling_cap"))
_refuse("a lower bound of the rollout IS weight is not available (the weight is bounded above only)",
        "vllm_importance_sampling_clip_min")
_not_needed("rollstream always samples with vLLM (TRL's false samples with transformers' generate, the same "
            "distribution); TRL corrects the engine/learner mismatch only under use_vllm, rollstream always has "
            "one and corrects it as TRL does (vllm_importance_sampling_correction)", "use_vllm")
_not_needed("the learner has no autocast: it computes in model.torch_dtype (model_init_kwargs' dtype, TRL's "
            "default float32); from-trl lists bf16/fp16 = true over other weights as a change in what trains",
            "bf16", "fp16")
_refuse("the in-process engine takes vLLM's default 0.9 of its GPU; give each rollout worker its own GPU, or "
        "start `vllm serve --gpu-memory-utilization F` and set rollout.engine = \"server\"",
        "vllm_gpu_memory_utilization", trains=False, harmless=lambda v: v in (0.3, 0.9))
_refuse("rollstream adds no router auxiliary loss (TRL's None takes a MoE model's own coefficient)",
        "router_aux_loss_coef", harmless=lambda v: v in (None, 0, 0.0))
_refuse("disabling dropout is not available: the learner trains in train mode (dropout as the model's config)",
        "disable_dropout", harmless=_off)
_refuse("a float32 lm_head over lower-precision weights is not available (model.torch_dtype = float32 computes "
        "everything in float32)", "cast_lm_head_to_fp32", harmless=_off)
_refuse("extra sampling keywords are not available; rollstream's sampling fields are grpo.temperature, top_p, "
        "top_k, repetition_penalty, rollout.min_p and rollout.stop", "generation_kwargs", harmless=_off)
_refuse("guided decoding is not available", "vllm_structured_outputs_regex", harmless=_off)
_refuse("the entropy bonus is not available", "entropy_coef", harmless=_off)
_refuse("adaptive entropy control is not available", "use_adaptive_entropy", harmless=_off)
_not_needed("has no effect unless use_adaptive_entropy is set (not available)", "entropy_coef_min",
            "entropy_coef_max", "entropy_coef_delta", "entropy_target")
_not_needed("has no effect unless loss_type = vespo (not available)", "vespo_k_pos", "vespo_lambda_pos",
            "vespo_k_neg", "vespo_lambda_neg")
_refuse("models with custom code (trust_remote_code) are not loaded", "trust_remote_code", trains=False,
        harmless=_off)
_refuse("vLLM's transformers backend is not available (rollstream's engine is vLLM's own model code, the same "
        "weights)", "vllm_model_impl", trains=False, harmless=lambda v: v in (None, "vllm"))
_not_needed("rollstream always samples with vLLM", "use_transformers_continuous_batching",
            "transformers_continuous_batching_config", "use_transformers_paged", "cache_implementation")
_not_needed("prompts are padded where the learner batches them; padding does not change the loss",
            "pad_to_multiple_of")
_not_needed("TRL's NCCL weight-sync port; rollstream's weights travel by rollout.weight_transport",
            "vllm_group_port")
_not_needed("completions are logged to <output_dir>/completions.jsonl (log_completions); images stay out, every "
            "prompt is logged", "log_multimodal", "log_unique_prompts")
_refuse("uploading completions to a hub is not available", "log_completions_hub_repo", trains=False,
        harmless=_off)

# --- the rest: ms-swift's argument of the same name and meaning -----------------------------------
for _name in _DEFAULTS:
    if _name not in _TABLE:
        _as_swift(_name, trains=_name not in _NOT_TRAINING)
_TABLE = {name: _TABLE[name] for name in _DEFAULTS}  # the dataclass's order


# ---------------------------------------------------------------------------------------------------
# Lookup and translation: TRL's meaning (from-trl, the docs) ...


def table() -> dict[str, TrlArg]:
    """Every GRPOConfig field, by name, in the dataclass's order."""
    return dict(_TABLE)


def lookup(name: str) -> TrlArg | None:
    return _TABLE.get(name)


def counts() -> dict[str, int]:
    return {kind: sum(a.kind == kind for a in _TABLE.values()) for kind in KINDS}


def translate(name: str, value: Any, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"section.field": value}`` for one GRPOConfig field read as TRL means it; a SwiftArgError names the
    field, the value and why it is refused. ``given``: the other fields of the same source."""
    arg = _TABLE.get(name)
    if arg is None:
        raise SwiftArgError(f"{name} is not a field of TRL {TRL_VERSION}'s GRPOConfig")
    given = given if given is not None else {name: value}
    try:
        if arg.kind in (REFUSED, NOT_NEEDED):
            if arg.is_harmless(value):
                return {}
            raise ValueError(arg.why)
        if arg.swift:
            return swift_args.translate(name, value, given)
        return arg.convert(value, given) if arg.convert is not None else {arg.targets[0]: value}
    except SwiftArgError as exc:
        raise SwiftArgError(str(exc).replace("ms-swift's ", "TRL's ", 1)) from None
    except (ValueError, TypeError) as exc:
        raise SwiftArgError(f"TRL's {name}={_show(value)} is refused: {exc}") from None


# ... and what a name means in a TOML, a flag or --set: ms-swift's where ms-swift has the name, TRL's where
# only TRL has it (pipeline.config and the command line use these three).


def _trl_only(name: str) -> bool:
    return name in _TABLE and swift_args.lookup(name) is None


def known(name: str) -> SwiftArg | TrlArg | None:
    """The table entry that decides ``name`` as a config key or flag (ms-swift's first)."""
    return swift_args.lookup(name) or (_TABLE[name] if _trl_only(name) else None)


def known_homes(name: str) -> tuple[str, ...]:
    """The rollstream fields an accepted or mapped ms-swift or TRL-only name sets."""
    if not _trl_only(name):
        return swift_args.homes(name)
    arg = _TABLE[name]
    return arg.targets if arg.kind in (ACCEPTED, MAPPED) else ()


def translate_known(name: str, value: Any, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return translate(name, value, given) if _trl_only(name) else swift_args.translate(name, value, given)


def known_names() -> list[str]:
    return [*swift_args.table(), *(name for name in _TABLE if _trl_only(name))]


def parse_flags(tokens: Iterable[str]) -> dict[str, Any]:
    """swift_args.parse_flags, with TRL-only names as flags too (``--vllm_importance_sampling_correction
    false``): the same grammar, each value parsed as there."""
    tokens = list(tokens)
    swift_tokens: list[str] = []
    trl_flags: dict[str, list[Any]] = {}
    current: list[Any] | None = None
    for token in tokens:
        if token.startswith("--") and len(token) > 2 and not swift_args._is_number(token):
            name, _, inline = token[2:].partition("=")
            name = name.replace("-", "_")
            if _trl_only(name):
                if name in trl_flags:
                    raise SwiftArgError(f"--{name} is given twice; give it once (several values follow one flag: "
                                        f"--{name} a b)")
                current = trl_flags[name] = [swift_args._parse_token(inline)] if inline else []
                continue
            current = None
        if current is not None:
            current.append(swift_args._parse_token(token))
        else:
            swift_tokens.append(token)
    out = swift_args.parse_flags(swift_tokens)
    for name, values in trl_flags.items():
        out[name] = True if not values else values[0] if len(values) == 1 else values
    return out


# ---------------------------------------------------------------------------------------------------
# A saved GRPOConfig (``GRPOConfig(...).to_json_string()`` / ``to_dict()``, or the YAML ``trl grpo --config``
# reads)


@dataclass
class TrlConversion(Conversion):
    """What ``from_trl`` made of a GRPOConfig (the ms-swift conversion's fields, and these)."""

    changes: list[tuple[str, Any, str]] = field(default_factory=list)
    """(name, TRL's value, what rollstream does instead): the converted run would not train what TRL trains;
    ``rollstream config from-trl`` writes the config only with --accept-changes."""
    defaults: list[str] = field(default_factory=list)
    """Fields the file left out: TRL's default applied."""
    processes: int = 1
    """TRL's training processes (a saved config's generation_batch_size / (per device x steps_per_generation))."""


def from_trl(data: Mapping[str, Any]) -> TrlConversion:
    """Convert a GRPOConfig's fields into rollstream config values, TRL's defaults filling the fields ``data``
    leaves out (so a carried-over run trains what TRL trains), sorting every field into carried / refused /
    no effect / at default / unknown, and listing what would train differently (``changes``)."""
    conv = TrlConversion()
    conv.unknown = [(k, v) for k, v in data.items() if k not in _DEFAULTS]
    conv.defaults = [k for k in _DEFAULTS if k not in data]
    args = {**_DEFAULTS, **{k: v for k, v in data.items() if k in _DEFAULTS}}
    _post_init(args, conv)
    _couple(args, conv)
    for name, value in args.items():
        at_default = _same_value(value, _DEFAULTS[name]) or name in _FILLED_AT_START
        conv.take(name, value, _TABLE[name], translate, args, at_default)
    for dotted, value in list(conv.values.items()):
        if isinstance(value, swift_args.Deferred):  # padding_free is not a TRL field; nothing defers yet
            del conv.values[dotted]
    # TRL generates each generation batch with the weights it trains next (synchronous, on-policy).
    conv.values["grpo.max_staleness"] = 0
    conv.notes.append("grpo.max_staleness = 0: TRL samples every generation batch with the current weights "
                      "(rollstream's default 1 overlaps generation with training one version behind)")
    conv.changes = _training_changes(args, conv)
    return conv


_MISSING = object()
# Not-needed fields whose saved value TRL's or transformers' __post_init__ filled in (bf16 from fp16, the
# accelerator's config, the masked hub token, pin_memory off on CPU): not the user's choice, not reported.
_FILLED_AT_START = ("bf16", "disable_tqdm", "hub_token", "accelerator_config", "dataloader_pin_memory",
                    "pad_to_multiple_of", "debug")


def _post_init(args: dict[str, Any], conv: TrlConversion) -> None:
    """What GRPOConfig.__post_init__ fills in (a saved config already holds it; a YAML may not)."""
    if args.get("bf16") is None:
        args["bf16"] = not args.get("fp16")
    if isinstance(args.get("scale_rewards"), bool):
        args["scale_rewards"] = "group" if args["scale_rewards"] else "none"
    if args.get("vllm_importance_sampling_cap") is not None:
        args["vllm_importance_sampling_clip_max"] = args.pop("vllm_importance_sampling_cap")
        conv.at_default.append("vllm_importance_sampling_cap")
    else:
        args.pop("vllm_importance_sampling_cap")
        conv.at_default.append("vllm_importance_sampling_cap")


def _couple(args: dict[str, Any], conv: TrlConversion) -> None:
    """Fields that only mean something together, or that TRL reads only under another field's value."""

    def drop(name: str, why: str) -> None:
        value = args.pop(name)
        if not _same_value(value, _DEFAULTS[name]):
            conv.notes.append(f"{name}={_show(value)} not carried: {why}")
        else:
            conv.at_default.append(name)

    drop("output_dir", "the TRL run's own directory; rollstream writes runs/<name>-<time> unless run.output_dir is set")
    server = _as_bool(args.get("use_vllm")) and args.get("vllm_mode") == "server"
    if not server:  # TRL reads the server fields only in server mode
        for name in ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout"):
            drop(name, "TRL reads it only with use_vllm = true and vllm_mode = \"server\"")
    elif args.get("vllm_server_base_url"):
        for name in ("vllm_server_host", "vllm_server_port"):
            drop(name, "vllm_server_base_url wins (as TRL)")
    if not _as_bool(args.get("use_vllm")):
        for name in ("vllm_mode", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                     "vllm_model_impl", "vllm_max_model_length"):
            drop(name, "TRL reads it only with use_vllm = true")
        if _as_bool(args.get("vllm_importance_sampling_correction")):
            conv.notes.append(
                "vllm_importance_sampling_correction = true carried with use_vllm = false: TRL then samples with "
                "its training model (no engine/learner mismatch to correct); rollstream always samples with vLLM "
                "and corrects the mismatch as TRL does with vLLM")
    if args.get("multi_objective_aggregation") == "normalize_then_sum":
        drop("scale_rewards", "multi_objective_aggregation = normalize_then_sum normalises instead (TRL ignores it)")
    # A saved GRPOConfig holds both batch sizes (its __post_init__ derives one); their ratio is the number of
    # training processes: rollstream's one learner takes the same global mini-batch.
    per_device = int(args["per_device_train_batch_size"])
    steps, batch = args.get("steps_per_generation"), args.get("generation_batch_size")
    if steps is None and batch is None:
        steps = args["steps_per_generation"] = args["gradient_accumulation_steps"]
    processes = 1
    if steps is not None and batch is not None:
        processes, rest = divmod(int(batch), per_device * int(steps))
        if rest or processes < 1:
            raise SwiftArgError(f"generation_batch_size={batch} is not per_device_train_batch_size={per_device} x "
                                f"steps_per_generation={steps} x the number of processes (TRL sets one of the two)")
        args.pop("generation_batch_size")
        conv.at_default.append("generation_batch_size")
    if processes > 1:
        args["per_device_train_batch_size"] = per_device * processes
        conv.processes = processes
        conv.notes.append(f"per_device_train_batch_size: {per_device} per device x {processes} TRL processes "
                          f"(generation_batch_size / (per_device_train_batch_size x steps_per_generation)) = "
                          f"{per_device * processes} in rollstream's one learner process (the same global mini-batch)")
    warmup, max_steps = args.get("warmup_steps") or 0, int(args.get("max_steps") or -1)
    if warmup >= 1 and max_steps > 0:
        args["warmup_steps"] = warmup / max_steps  # transformers 5: a warmup_steps below 1 is a ratio
        conv.notes.append(f"warmup_steps={warmup} of max_steps={max_steps}: warmup_ratio {warmup / max_steps:g}")


def _training_changes(args: Mapping[str, Any], conv: TrlConversion) -> list[tuple[str, Any, str]]:
    """Where the converted config would not train what TRL trains."""
    changes = [(name, value, f"not carried (refused): {why}") for name, value, why in conv.refused
               if _TABLE[name].trains]
    processes = conv.processes
    if processes > 1:
        changes.append(("world_size", processes,
                        (f"TRL trained in {processes} processes; rollstream's learner is one process with the same "
                         f"global mini-batch (bnpo then averages over all of it, not per device); grpo.world_size = "
                         f"{processes} shards it over {processes} processes with FSDP2 instead (docs/learner.md)")))
    dtype = conv.values.get("model.torch_dtype", "float32")
    for flag, amp in (("bf16", "bfloat16"), ("fp16", "float16")):
        if _as_bool(args.get(flag)) and dtype != amp:
            changes.append((flag, True, (f"TRL computes under {amp} autocast over {dtype} weights; rollstream's "
                                         f"learner has no autocast and computes in {dtype}: give {flag} = false, or "
                                         f"model_init_kwargs = {{\"dtype\": \"{amp}\"}} for {amp} weights")))
    changes += [(name, value, f"not carried: not a field of TRL {TRL_VERSION}'s GRPOConfig (another TRL version's?)")
                for name, value in conv.unknown if not _off(value)]
    return changes


# ---------------------------------------------------------------------------------------------------
# The documentation page


def render_markdown() -> str:
    """docs/trl-arguments.md: every GRPOConfig field with its disposition."""
    c = counts()
    lines = [
        "# TRL arguments",
        "",
        ("<!-- generated: .venv/bin/python -m config.trl_args > docs/trl-arguments.md "
         "(tests/test_trl_args.py checks it); edit the table in config/trl_args.py -->"),
        "",
        (f"Every field of TRL's `GRPOConfig` (trl {TRL_VERSION}, with the transformers {TRANSFORMERS_VERSION} "
         "`TrainingArguments` under it), as rollstream takes it. The sibling of "
         "[ms-swift arguments](swift-arguments.md): a name ms-swift also has, with the same meaning, converts as "
         "there (\"as ms-swift\" below)."),
        "",
        "## Two ways in",
        "",
        ("- **A saved GRPOConfig**: `rollstream config from-trl grpo_config.json` (`GRPOConfig(...).to_json_string()` "
         "or `to_dict()`), or the YAML `trl grpo --config x.yaml` reads. Every field the file leaves out takes "
         "**TRL's** default, so the converted run trains what TRL trains: `beta` 0, `loss_type` dapo, "
         "`temperature` 1.0, `top_k` 0, `learning_rate` 1e-6, `lr_scheduler_type` linear, `weight_decay` 0, "
         "`adam_beta2` 0.999, `num_train_epochs` 3, `per_device_eval_batch_size` 8, and TRL's vLLM "
         "importance-sampling correction **on** (`sequence_mask`, cap 3.0: `grpo.rollout_importance_sampling_mode` "
         "\"sequence_mask\", `threshold` 3.0, `convention` \"trl\": the sequence ratio is the product of the "
         "token ratios and weights the policy term only, as TRL's `grpo_trainer.py`); `grpo.max_staleness` 0 "
         "(TRL generates synchronously). The TOML goes to stdout (or `-o`), the report to stderr; where a field "
         "would train differently (a refused value, bf16 autocast, several processes) nothing is written and the "
         "command exits 3 unless `--accept-changes`. GRPOConfig holds no model, dataset or reward functions "
         "(`GRPOTrainer`'s arguments): add `model.model`, `data.dataset`, `reward.reward_funcs`."),
        ("- **Names in a TOML, as flags or with `--set`**: TRL's names that ms-swift lacks "
         "(`vllm_importance_sampling_correction`, `sapo_temperature_pos`, `off_policy_mask_threshold`, ...) are "
         "taken like ms-swift's, at the top level or in the section of their field. A name both have means "
         "ms-swift's there, and fields not given keep rollstream's (ms-swift's) defaults: a TOML does not say it "
         "is a TRL run."),
        "",
        ("Metrics: `metrics.jsonl` also carries TRL's names where rollstream's differ: "
         "`sampling/importance_sampling_ratio/mean`, `/min`, `/max` (= `rollout_correction/is_weight_mean`, "
         "`_min`, `_max`: the IS weight's token mean, least and greatest over the step's completion tokens) and "
         "`entropy` (= `entropy/mean`)."),
        "",
        f"- **accepted** ({c[ACCEPTED]}): the rollstream field of the same name and meaning;",
        f"- **mapped** ({c[MAPPED]}): a rollstream field under another name, or a converted value;",
        f"- **not needed** ({c[NOT_NEEDED]}): accepted without effect, for the reason given;",
        (f"- **refused** ({c[REFUSED]}): a feature rollstream lacks; TRL's default is accepted, any other value is "
         "an error giving the reason (from-trl: not carried, and listed)."),
        "",
        f"{sum(c.values())} fields in all.",
        "",
        "| field | TRL default | disposition | rollstream | why / how |",
        "|---|---|---|---|---|",
    ]
    for arg in sorted(_TABLE.values(), key=lambda a: (KINDS.index(a.kind), a.name)):
        where = ", ".join(f"`{t}`" for t in arg.targets)
        why = f"as ms-swift: {arg.why}" if arg.swift and arg.why else "as ms-swift" if arg.swift else arg.why
        lines.append(f"| `{arg.name}` | `{swift_args._cell(_show(arg.default))}` | {arg.kind} | {where} | "
                     f"{swift_args._cell(why)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # regenerate the page: python -m config.trl_args > docs/trl-arguments.md
    print(render_markdown(), end="")
