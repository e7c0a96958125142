"""The run's configuration: a TOML file plus ``--set section.key=value`` overrides, parsed into one
msgspec Struct per section (``[run]``, ``[model]``, ``[data]``, ``[grpo]``, ``[rollout]``, ``[reward]``,
``[learner]``, ``[eval]``, ``[transport]``) and validated once, at load time.

Names and batch semantics follow ms-swift's GRPO arguments, so a user can carry a config over:

    mini-batch            = per_device_train_batch_size * world_size            (completions)
    generation_batch_size = mini-batch * steps_per_generation                   (completions per cycle)
    prompt_batch_size     = generation_batch_size // num_generations            (prompt groups per cycle)

Every mistake becomes one ``ConfigError`` whose message is a single paragraph naming the field, the
value and what would be valid (the nearest valid key, choice or batch size).

One module per job, each importing only those above it:

- ``schema``: the section structs, their fields' types, ranges, defaults and docstrings;
- ``batch``: ms-swift's batch arithmetic (pure);
- ``swift_args``, ``trl_args``: ms-swift's and TRL's argument tables; ``swift``: applying them to a config;
- ``derive``: the values a loaded config fills in;
- ``validate``: the rules that span fields;
- ``load``: file, flags and overrides into a Config (translate, build, derive, validate);
- ``render``: ``replace``, ``resolved``, ``format_config``, ``resolve_output_dir``.
"""

from config.batch import BatchSizes, derive_batch_sizes, nearest_multiples
from config.derive import has_eval_data, verifiers_env
from config.load import config_from_dict, load_config, parse_override
from config.render import format_config, replace, resolve_output_dir, resolved
from config.schema import (
    DEFAULT_KL_IN_REWARD,
    DEFAULT_LEARNING_RATE,
    DEFAULT_SCALE_REWARDS,
    FIELDS,
    SECTIONS,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    GrpoConfig,
    LearnerConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TransportConfig,
)
from config.validate import (
    CHAT_TEMPLATE_ARGUMENTS,
    check_eval_batch,
    context_budget_error,
    vllm_max_lora_rank,
)

__all__ = [
    "CHAT_TEMPLATE_ARGUMENTS",
    "DEFAULT_KL_IN_REWARD",
    "DEFAULT_LEARNING_RATE",
    "DEFAULT_SCALE_REWARDS",
    "FIELDS",
    "SECTIONS",
    "BatchSizes",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "GrpoConfig",
    "LearnerConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TransportConfig",
    "check_eval_batch",
    "config_from_dict",
    "context_budget_error",
    "derive_batch_sizes",
    "format_config",
    "has_eval_data",
    "load_config",
    "nearest_multiples",
    "parse_override",
    "replace",
    "resolve_output_dir",
    "resolved",
    "verifiers_env",
    "vllm_max_lora_rank",
]
