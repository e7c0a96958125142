"""The derived values: what a loaded config fills in where the user left a field unset (batch sizes, ms-swift's
per-estimator defaults, the scheduler a tool or environment implies), remembering which were derived."""

from __future__ import annotations

from config.batch import derive_batch_sizes
from config.schema import (
    DEFAULT_KL_IN_REWARD,
    DEFAULT_LEARNING_RATE,
    DEFAULT_SCALE_REWARDS,
    Config,
    DataConfig,
    RewardConfig,
)


def derive(cfg: Config) -> None:
    """Fill the derived values in place and remember which ones were not given (for replace/format)."""
    g = cfg.grpo
    batch_knobs = ("generation_batch_size", "steps_per_generation", "gradient_accumulation_steps")
    derived = {f"grpo.{knob}" for knob in batch_knobs if getattr(g, knob) is None}
    sizes = derive_batch_sizes(
        num_generations=g.num_generations,
        per_device_train_batch_size=g.per_device_train_batch_size,
        world_size=g.world_size,
        generation_batch_size=g.generation_batch_size,
        steps_per_generation=g.steps_per_generation,
        gradient_accumulation_steps=g.gradient_accumulation_steps,
        effective_batch_size=g.effective_batch_size,
    )
    g.generation_batch_size = sizes.generation_batch_size
    g.steps_per_generation = sizes.steps_per_generation
    g.gradient_accumulation_steps = sizes.gradient_accumulation_steps
    if g.scale_rewards is None:
        derived.add("grpo.scale_rewards")
        g.scale_rewards = DEFAULT_SCALE_REWARDS[g.advantage_estimator]
    if g.kl_in_reward is None:
        derived.add("grpo.kl_in_reward")
        g.kl_in_reward = DEFAULT_KL_IN_REWARD[g.advantage_estimator]
    ro = cfg.rollout
    if ro.weight_transport is None:
        derived.add("rollout.weight_transport")
        ro.weight_transport = "lora" if cfg.learner.train_type == "lora" else "file"
    if ro.max_num_seqs is None:
        derived.add("rollout.max_num_seqs")
        ro.max_num_seqs = g.per_device_train_batch_size * ro.tensor_parallel_size * g.steps_per_generation
    if ro.use_gym_env is None:
        derived.add("rollout.use_gym_env")
        ro.use_gym_env = ro.gym_env is not None
    if ro.loss_scale is None:
        derived.add("rollout.loss_scale")
        ro.loss_scale = "last_round" if ro.use_gym_env else "default"
    if (ro.tools or ro.environment_factory) and ro.multi_turn_scheduler is None:
        derived.add("rollout.multi_turn_scheduler")
        ro.multi_turn_scheduler = "tool_calling"
    if verifiers_env(cfg.data) and ro.multi_turn_scheduler is None:
        derived.add("rollout.multi_turn_scheduler")
        ro.multi_turn_scheduler = "verifiers"
    if ro.agent and ro.multi_turn_scheduler is None:
        derived.add("rollout.multi_turn_scheduler")
        ro.multi_turn_scheduler = "agent"
    r = cfg.reward
    if ro.use_gym_env:
        if ro.multi_turn_scheduler is None:
            derived.add("rollout.multi_turn_scheduler")
            ro.multi_turn_scheduler = "gym_scheduler"
        if "env_reward" not in r.reward_funcs:
            # As ms-swift (4.3+: GRPOTrainer._prepare_rewards, rl_core.score_completions): with use_gym_env the
            # env's total_reward is always one more reward column, after the reward functions and the reward
            # model, and reward_weights (unset: 1.0 each) must hold a weight for it, the last one.
            derived.add("reward.reward_funcs")
            r.reward_funcs = [*r.reward_funcs, "env_reward"]
            n = len(r.reward_funcs) - 1
            if r.reward_model is not None and r.reward_weights is not None and len(r.reward_weights) == n + 2:
                # ms-swift orders [funcs, reward model, gym]; here the reward model scores last: move its weight
                r.reward_weights = [*r.reward_weights[:n], r.reward_weights[n + 1], r.reward_weights[n]]
    if r.reward_weights is None:
        derived.add("reward.reward_weights")
        r.reward_weights = [1.0] * num_rewards(r)
    if cfg.learner.learning_rate is None:
        derived.add("learner.learning_rate")
        cfg.learner.learning_rate = DEFAULT_LEARNING_RATE[cfg.learner.train_type]
    e = cfg.eval
    if e.eval_strategy is None:
        derived.add("eval.eval_strategy")
        e.eval_strategy = "steps" if has_eval_data(cfg.data) else "no"
    if e.eval_num_generations is None:
        derived.add("eval.eval_num_generations")
        e.eval_num_generations = g.num_generations
    if e.eval_temperature is None:
        derived.add("eval.eval_temperature")
        e.eval_temperature = g.temperature
    vars(cfg)["_derived"] = frozenset(derived)  # beside the fields (Config has a __dict__): render.py reads it


def verifiers_env(data: DataConfig) -> str | None:
    """The verifiers environment id of ``data.dataset = "verifiers:<env id>"``, else None."""
    dataset = data.dataset
    if isinstance(dataset, str) and dataset.startswith("verifiers:"):
        return dataset.removeprefix("verifiers:")
    return None


def has_eval_data(data: DataConfig) -> bool:
    """Is there a held-out set: a val_dataset, or a split of the train set?"""
    return data.val_dataset is not None or data.split_dataset_ratio > 0


def num_rewards(r: RewardConfig) -> int:
    # As ms-swift: a reward model is one more reward, after the functions.
    return len(r.reward_funcs) + (r.reward_model is not None)
