"""The rules that span fields, checked once at load time; each failure one ConfigError naming the field and
the fix. (A single field's type and range are msgspec's, from the schema.)"""

from __future__ import annotations

import math
import re

from config.batch import nearest_multiples
from config.derive import has_eval_data, num_rewards, verifiers_env
from config.schema import Config, ConfigError, DataConfig, LearnerConfig, RewardConfig, RolloutConfig
from pipeline.transport.urls import SENTINEL_FORM, is_sentinel_url, parse_sentinel_url, redact


def check(cfg: Config) -> None:
    """Rules that span fields (one field's type and range are checked by msgspec)."""
    g, r = cfg.grpo, cfg.reward
    if g.temperature == 0 and g.num_generations > 1:
        raise ConfigError(
            f"grpo.temperature=0 with grpo.num_generations={g.num_generations}: greedy sampling makes every "
            f"completion of a group identical, so every advantage is zero and nothing is learned; "
            f"use a temperature > 0 (1.0 is usual)"
        )
    if cfg.run.num_completions_to_print and not cfg.run.log_completions:
        raise ConfigError(
            f"run.num_completions_to_print={cfg.run.num_completions_to_print} with run.log_completions=false: "
            "completions are printed only when they are logged (as TRL); set run.log_completions=true or "
            "run.num_completions_to_print=0"
        )
    rollout_scores = cfg.rollout.environment_factory or cfg.rollout.agent or verifiers_env(cfg.data)
    if not r.reward_funcs and r.reward_model is None and not rollout_scores:
        # (an environment_factory's get_reward may be the only source, as in TRL: the reward stage checks it)
        raise ConfigError(
            'no reward source: set reward.reward_funcs (e.g. reward_funcs = ["accuracy"], or '
            "--set 'reward.reward_funcs=[\"accuracy\"]'), reward.reward_model, or an environment_factory "
            "whose environment defines get_reward()"
        )
    loops = [name for name, on in (("rollout.agent", cfg.rollout.agent), ("rollout.tools", cfg.rollout.tools),
                                   ("rollout.environment_factory", cfg.rollout.environment_factory),
                                   ("a verifiers:<env> dataset", verifiers_env(cfg.data))) if on]
    if len(loops) > 1 and not (loops == ["rollout.tools", "rollout.environment_factory"]):
        raise ConfigError(
            f"{' and '.join(loops)}: each runs the episode's loop its own way; choose one (TRL's tools and "
            f"environment_factory combine with each other only)"
        )
    if (cfg.rollout.tools or cfg.rollout.environment_factory) and cfg.rollout.use_gym_env:
        raise ConfigError(
            "rollout.tools / rollout.environment_factory (TRL's agents) with rollout.use_gym_env (ms-swift's gym "
            "envs): one episode runs one of them; use TRL's environment_factory or ms-swift's gym_env, not both"
        )
    if len(set(r.reward_funcs)) != len(r.reward_funcs) or not all(r.reward_funcs):
        raise ConfigError(f"reward.reward_funcs={r.reward_funcs!r} must name each reward once, none empty")
    if len(r.reward_weights) != num_rewards(r):
        rewards = list(r.reward_funcs) + ([f"reward_model {r.reward_model!r}"] if r.reward_model else [])
        raise ConfigError(
            f"reward.reward_weights={r.reward_weights} must hold one weight per reward, {num_rewards(r)} "
            f"({', '.join(rewards)}), in that order, but holds {len(r.reward_weights)}; "
            f"or leave it unset for 1.0 each"
            + ("; with rollout.use_gym_env the env's reward is one more, the last weight (as ms-swift's "
               "gym_reward; 0.0 leaves it out)" if cfg.rollout.use_gym_env and "env_reward" in r.reward_funcs else "")
        )
    _check_reward_params(r, g.max_completion_length)
    if cfg.learner.sync_ref_model and g.beta == 0:
        raise ConfigError(
            "learner.sync_ref_model=true with grpo.beta=0: there is no reference model to sync "
            "(beta = 0 loads none); set grpo.beta > 0 or learner.sync_ref_model = false"
        )
    if cfg.learner.train_type == "lora" and (cfg.learner.sync_ref_model or cfg.learner.ref_model):
        raise ConfigError(
            "learner.train_type=\"lora\" uses the base model (adapter disabled) as the reference: "
            "learner.sync_ref_model and learner.ref_model do not apply; unset them or train full weights"
        )
    if not cfg.learner.target_modules or not all(cfg.learner.target_modules):
        raise ConfigError(f"learner.target_modules={cfg.learner.target_modules!r} must name at least one module, none empty")
    if cfg.learner.max_tokens_per_batch is not None and g.top_entropy_quantile < 1.0:
        raise ConfigError(
            f"grpo.top_entropy_quantile={g.top_entropy_quantile} with learner.max_tokens_per_batch: the entropy "
            f"quantile is taken over a whole mini-batch, which padding-free micro-batches split; "
            f"unset learner.max_tokens_per_batch or set grpo.top_entropy_quantile = 1.0"
        )
    _check_loss(cfg)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.learner.device):
        raise ConfigError(
            f"learner.device={cfg.learner.device!r} must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" (N the GPU index)"
        )
    if cfg.learner.device.startswith("cuda:") and g.world_size > 1:
        raise ConfigError(
            f"learner.device={cfg.learner.device!r} with grpo.world_size={g.world_size}: each learner process "
            f"trains on the GPU of its local rank; set learner.device = \"cuda\" (CUDA_VISIBLE_DEVICES picks the GPUs)"
        )
    if cfg.learner.own_process and g.world_size > 1:
        raise ConfigError(
            f"learner.own_process = true with grpo.world_size={g.world_size}: a distributed learner's processes "
            "are already its own (torchrun starts them); set learner.own_process = false"
        )
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cfg.run.name):
        raise ConfigError(
            f"run.name={cfg.run.name!r} may hold only letters, digits, '.', '_' and '-' "
            f"(it names the Redis keys and the output directory)"
        )
    _check_rollout(cfg.rollout)
    _check_context(cfg)
    _check_chat_template(cfg.data)
    _check_weight_transport(cfg.rollout, cfg.learner)
    _check_eval(cfg)
    if "env_reward" in r.reward_funcs and not cfg.rollout.use_gym_env:
        raise ConfigError(
            "reward.reward_funcs holds env_reward, the environment's reward, but rollout.use_gym_env is false; "
            "set rollout.use_gym_env = true and rollout.gym_env (or each row's env_config.name)"
        )
    _check_transport_url(cfg.transport.url)


def _check_transport_url(url: str) -> None:
    if is_sentinel_url(url):
        try:
            parse_sentinel_url(url)
        except ValueError as exc:
            raise ConfigError(
                f"transport.url={redact(url)!r} is no Sentinel url: {exc}; write it as {SENTINEL_FORM}"
            ) from None
        return
    if not re.match(r"(redis|rediss|unix)://", url):
        raise ConfigError(
            f"transport.url={redact(url)!r} must start with redis://, rediss://, unix://, redis+sentinel:// "
            "or rediss+sentinel://"
        )


def _check_loss(cfg: Config) -> None:
    """The loss_type and scale_rewards combinations that cannot mean what they say."""
    g = cfg.grpo
    if g.loss_type == "cispo" and g.importance_sampling_level != "token":
        raise ConfigError(
            f"grpo.loss_type=\"cispo\" with grpo.importance_sampling_level={g.importance_sampling_level!r}: cispo sums "
            f"token losses, so one ratio per sequence would weight each sequence by its length (TRL warns of it); "
            f"set importance_sampling_level = \"token\", or loss_type = \"grpo\" for GSPO"
        )
    if g.scale_rewards == "gdpo" and g.advantage_estimator != "grpo":
        raise ConfigError(
            f"grpo.scale_rewards=\"gdpo\" with grpo.advantage_estimator={g.advantage_estimator!r}: gdpo's advantage is "
            f"the batch-normalised sum of the per-function group-normalised rewards, which replaces the estimator's "
            f"baseline; set advantage_estimator = \"grpo\" or another scale_rewards (group, batch, none)"
        )
    if g.scale_rewards == "gdpo" and g.kl_in_reward and g.beta != 0:
        raise ConfigError(
            "grpo.scale_rewards=\"gdpo\" with grpo.kl_in_reward=true: gdpo normalises each reward function on its "
            "own, so there is no total reward to subtract beta * KL from (ms-swift turns kl_in_reward off); "
            "set kl_in_reward = false (the KL stays in the loss) or another scale_rewards"
        )
    if g.off_policy_sequence_mask_delta is not None and g.loss_type == "bnpo" and cfg.learner.max_tokens_per_batch:
        raise ConfigError(
            f"grpo.off_policy_sequence_mask_delta={g.off_policy_sequence_mask_delta} with grpo.loss_type=\"bnpo\" and "
            f"learner.max_tokens_per_batch: the mask changes bnpo's token count, which padding-free micro-batches "
            f"must know before their forward passes; unset learner.max_tokens_per_batch or use another loss_type"
        )


def _check_reward_params(r: RewardConfig, max_completion_length: int) -> None:
    # As ms-swift's GRPO argument checks for the built-ins' parameters.
    if "soft_overlong" in r.reward_funcs:
        if r.soft_cache_length is None:
            raise ConfigError(
                "reward.soft_cache_length must be set when reward_funcs holds soft_overlong "
                "(the punished band before soft_max_length, e.g. soft_cache_length = 128)"
            )
        soft_max = r.soft_max_length or max_completion_length
        if r.soft_cache_length >= soft_max:
            raise ConfigError(
                f"reward.soft_cache_length={r.soft_cache_length} must be below reward.soft_max_length "
                f"({soft_max}{'' if r.soft_max_length else ', from grpo.max_completion_length'})"
            )
    if r.repetition_max_penalty > 0:
        raise ConfigError(
            f"reward.repetition_max_penalty={r.repetition_max_penalty} must be <= 0 (it is a penalty; "
            f"ms-swift's default is -1.0)"
        )


def _check_eval(cfg: Config) -> None:
    """Only when evaluation is on: it needs held-out data, and whole prompt groups per eval batch."""
    e, d = cfg.eval, cfg.data
    if d.val_dataset is not None and d.split_dataset_ratio > 0:
        raise ConfigError(
            f"data.val_dataset={d.val_dataset!r} and data.split_dataset_ratio={d.split_dataset_ratio} are both set; "
            f"the held-out set comes from one of them: unset split_dataset_ratio (0) or val_dataset"
        )
    if e.eval_strategy == "no":
        return
    if not has_eval_data(d):
        raise ConfigError(
            'eval.eval_strategy="steps" needs held-out data: set data.val_dataset to a file, or '
            'data.split_dataset_ratio (e.g. 0.05) to hold out part of the train set; or eval_strategy = "no"'
        )
    check_eval_batch(e.per_device_eval_batch_size, cfg.grpo.world_size, e.eval_num_generations)
    ro = cfg.rollout
    if ro.multi_turn_scheduler:
        raise ConfigError(
            f"evaluation samples single-turn completions; rollout.multi_turn_scheduler="
            f'{ro.multi_turn_scheduler!r} is not evaluated yet: set eval.eval_strategy = "no"'
        )
    if ro.weight_transport == "broadcast" and ro.engine == "server" and not e.share_rollout_engine:
        # Its "own" engine would be the rollout's servers, whose weights the rollout worker loads by
        # broadcast: evaluation could never tell which version they hold while it samples.
        raise ConfigError(
            'eval with rollout.engine = "server" and rollout.weight_transport = "broadcast": evaluation would '
            "sample on the rollout's servers without knowing which version they hold; set "
            "eval.share_rollout_engine = true (in `rollstream train`), or evaluate saved weights with "
            '`rollstream eval` and set eval.eval_strategy = "no" here, or use weight_transport = "file"'
        )


def check_eval_batch(per_device_eval_batch_size: int, world_size: int, eval_num_generations: int) -> None:
    """ms-swift's check: the eval completion count (world_size * per_device_eval_batch_size) is a multiple
    of eval_num_generations, so every eval batch holds whole prompt groups."""
    completions = per_device_eval_batch_size * world_size
    if completions % eval_num_generations:
        valid = " or ".join(
            str(v // world_size) for v in nearest_multiples(completions, math.lcm(eval_num_generations, world_size))
        )
        raise ConfigError(
            f"eval.per_device_eval_batch_size={per_device_eval_batch_size}: the eval completion count "
            f"world_size * per_device_eval_batch_size = {world_size} * {per_device_eval_batch_size} = {completions} "
            f"must be divisible by eval.eval_num_generations={eval_num_generations}; nearest valid "
            f"per_device_eval_batch_size: {valid} (or change eval_num_generations, or eval_strategy = \"no\")"
        )


def _check_rollout(ro: RolloutConfig) -> None:
    """What this build cannot run is refused at load time, not in the middle of a run."""
    if ro.weight_transport == "nccl":
        raise ConfigError(
            "rollout.weight_transport='nccl' is now \"broadcast\": one collective broadcast per version, NCCL "
            'when the learner and every engine are on CUDA, gloo otherwise; set weight_transport = "broadcast"'
        )
    if ro.weight_sync_address.strip() in ("0.0.0.0", "::", "[::]", "*"):
        raise ConfigError(
            f"rollout.weight_sync_address={ro.weight_sync_address!r} is a wildcard: the learner advertises this "
            f"address to the rollout workers, so it must be one they can connect to (or \"\" for the learner's "
            f"address towards Redis)"
        )
    if ro.colocate:
        raise ConfigError(
            "rollout.colocate=true needs a GPU whose vLLM supports sleep mode (on CPU sleep() is a no-op, so "
            "the learner and the engine would both hold their memory); set rollout.colocate = false and run "
            "the rollout worker as its own process"
        )
    if ro.engine == "server" and not ro.server_urls:
        raise ConfigError(
            'rollout.engine="server" needs rollout.server_urls, e.g. server_urls = ["http://127.0.0.1:8000"] '
            "(start the servers with `python -m vllm.entrypoints.openai.api_server`, see README)"
        )
    bad = [u for u in ro.server_urls if not re.match(r"https?://", u)]
    if bad:
        raise ConfigError(f"rollout.server_urls: {bad[0]!r} must start with http:// or https://")
    if ro.gym_env is not None and not ro.use_gym_env:
        raise ConfigError(
            f"rollout.gym_env={ro.gym_env!r} with rollout.use_gym_env=false: the env would not be used; "
            f"set use_gym_env = true (or leave it unset) or remove gym_env"
        )
    if ro.weight_load == "in_flight" and (ro.engine == "server" or ro.weight_transport == "lora"):
        what = "rollout.engine = \"server\"" if ro.engine == "server" else "rollout.weight_transport = \"lora\""
        raise ConfigError(
            f"rollout.weight_load=\"in_flight\" with {what}: in-flight loads need the in-process engine with full "
            f"weights (a LoRA request keeps its adapter to the end); use weight_load = \"pause\" or \"drain\""
        )
    if ro.tensor_parallel_size != 1:
        raise ConfigError(
            f"rollout.tensor_parallel_size={ro.tensor_parallel_size}: tensor parallelism needs several GPUs; "
            f"this build runs vLLM on one device, set it to 1"
        )


def context_budget_error(max_model_len: int, max_completion_length: int, max_length: int | None,
                         where: str = "rollout.max_model_len") -> str | None:
    """Pure: why a prompt of data.max_length plus a whole completion cannot fit the context, or None.
    ``where`` says where max_model_len came from (the config, the model's maximum, a server)."""
    if max_completion_length >= max_model_len:
        return (f"grpo.max_completion_length={max_completion_length} leaves no room for a prompt in "
                f"{where}={max_model_len}; lower max_completion_length or raise rollout.max_model_len")
    if max_length is not None and max_length + max_completion_length > max_model_len:
        return (f"data.max_length={max_length} + grpo.max_completion_length={max_completion_length} = "
                f"{max_length + max_completion_length} tokens exceed {where}={max_model_len}: a long prompt's "
                f"completion would be cut short; lower data.max_length to {max_model_len - max_completion_length} "
                f"(or leave it unset to derive it), lower max_completion_length, or raise rollout.max_model_len")
    return None


def _check_context(cfg: Config) -> None:
    # With max_model_len unset the model's maximum decides; the engine checks it at start.
    if cfg.rollout.max_model_len is not None:
        problem = context_budget_error(cfg.rollout.max_model_len, cfg.grpo.max_completion_length, cfg.data.max_length)
        if problem:
            raise ConfigError(problem)


def _check_chat_template(d: DataConfig) -> None:
    reserved = sorted(k for k in d.chat_template_kwargs if k in CHAT_TEMPLATE_ARGUMENTS)
    if reserved:
        raise ConfigError(
            f"data.chat_template_kwargs holds {', '.join(reserved)}: apply_chat_template's own argument(s), "
            f"which rollstream sets (tools come from the dataset's tools column, the template from "
            f"model.chat_template); remove them"
        )
    given = d.chat_template_kwargs.get("enable_thinking", d.enable_thinking)
    if d.enable_thinking is not None and given != d.enable_thinking:
        raise ConfigError(
            f"data.enable_thinking={str(d.enable_thinking).lower()} but data.chat_template_kwargs.enable_thinking="
            f"{str(given).lower() if isinstance(given, bool) else repr(given)}; they disagree: set only one of them"
        )


# apply_chat_template's own arguments (data/chat.py sets them): never a template keyword.
CHAT_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs",
})


# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(lora_rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of ``lora_rank``."""
    for rank in VLLM_LORA_RANKS:
        if rank >= lora_rank:
            return rank
    raise ConfigError(
        f"learner.lora_rank={lora_rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}; "
        f"use 1..{VLLM_LORA_RANKS[-1]}"
    )


def _check_weight_transport(ro: RolloutConfig, lc: LearnerConfig) -> None:
    """The learner writes what its train_type trains; the engine must load that kind of snapshot."""
    if ro.weight_transport == "lora" and lc.train_type != "lora":
        raise ConfigError(
            'rollout.weight_transport=\'lora\' needs learner.train_type = "lora" (the learner publishes full '
            'weights otherwise); set learner.train_type = "lora" or weight_transport = "file"'
        )
    if ro.weight_transport == "file" and lc.train_type == "lora":
        raise ConfigError(
            'rollout.weight_transport=\'file\' with learner.train_type="lora": the learner publishes the '
            'adapter alone, not full weights; set weight_transport = "lora" (or leave it unset)'
        )
    if ro.weight_transport == "broadcast" and lc.train_type == "lora":
        raise ConfigError(
            'rollout.weight_transport=\'broadcast\' with learner.train_type="lora": a broadcast sends full '
            'weights, a LoRA run publishes its adapter; set weight_transport = "lora" (or leave it unset)'
        )
    if lc.own_process and ro.weight_transport == "broadcast":
        raise ConfigError(
            "learner.own_process = true with rollout.weight_transport = \"broadcast\": the broadcast sends from the "
            "learner's own process, where the model is; set learner.own_process = false, or weight_transport = "
            "\"file\""
        )
    # broadcast with rollout.engine = "server": the servers' vLLM workers join the group themselves; whether
    # each server was started for it is checked at the rollout worker's start (ServerEngine.prepare_broadcast).
    if ro.weight_transport == "lora":
        vllm_max_lora_rank(lc.lora_rank)
        if ro.engine == "server":
            raise ConfigError(
                'rollout.weight_transport=\'lora\' with rollout.engine="server" is not available: loading '
                "adapters into a running vllm serve (/v1/load_lora_adapter) is not verified on this build; "
                'use engine = "async" for LoRA training'
            )
