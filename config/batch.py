"""ms-swift's batch arithmetic, pure: from the given sizes, the generation batch, steps per generation,
gradient accumulation and the prompt groups per cycle (see the package docstring)."""

from __future__ import annotations

import math
from typing import NamedTuple

from config.schema import ConfigError


class BatchSizes(NamedTuple):
    generation_batch_size: int
    steps_per_generation: int
    gradient_accumulation_steps: int
    prompt_batch_size: int


def nearest_multiples(value: int, step: int) -> list[int]:
    """The positive multiples of ``step`` closest to ``value`` from below and above."""
    below = value // step * step
    if below == value:
        return [value]
    return [below, below + step] if below > 0 else [below + step]


def derive_batch_sizes(
    *,
    num_generations: int,
    per_device_train_batch_size: int,
    world_size: int = 1,
    generation_batch_size: int | None = None,
    steps_per_generation: int | None = None,
    gradient_accumulation_steps: int | None = None,
    effective_batch_size: int | None = None,
) -> BatchSizes:
    """ms-swift's GRPO batch arithmetic; raises ConfigError with the nearest valid values."""
    mini_batch = per_device_train_batch_size * world_size
    mini_batch_text = (
        f"per_device_train_batch_size * world_size = {per_device_train_batch_size} * {world_size}"
    )
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ConfigError(
            f"grpo.generation_batch_size={generation_batch_size} and grpo.steps_per_generation="
            f"{steps_per_generation} are both set; set only one (as ms-swift), since steps_per_generation = "
            f"generation_batch_size // (per_device_train_batch_size * world_size) "
            f"(to switch with --set, unset the other: --set grpo.generation_batch_size=none)"
        )
    if effective_batch_size is not None:
        if gradient_accumulation_steps is not None:
            raise ConfigError(
                f"grpo.gradient_accumulation_steps={gradient_accumulation_steps} and "
                f"grpo.effective_batch_size={effective_batch_size} are both set; set only one, since "
                f"gradient_accumulation_steps = "
                f"ceil(effective_batch_size / (per_device_train_batch_size * world_size))"
            )
        gradient_accumulation_steps = math.ceil(effective_batch_size / mini_batch)
    elif gradient_accumulation_steps is None:
        gradient_accumulation_steps = 1

    if generation_batch_size is None:
        if steps_per_generation is None:
            steps_per_generation = gradient_accumulation_steps
        generation_batch_size = mini_batch * steps_per_generation
        origin = (
            f" (= per_device_train_batch_size * world_size * steps_per_generation = "
            f"{per_device_train_batch_size} * {world_size} * {steps_per_generation})"
        )
    else:
        origin = ""
    # Every valid generation batch is a multiple of both, so suggest multiples of their lcm.
    valid = " or ".join(
        map(str, nearest_multiples(generation_batch_size, math.lcm(num_generations, mini_batch)))
    )
    if generation_batch_size % num_generations:
        raise ConfigError(
            f"grpo.generation_batch_size={generation_batch_size}{origin} must be divisible by "
            f"num_generations={num_generations}; nearest valid: {valid} (whole prompt groups per batch)"
        )
    if generation_batch_size % mini_batch:
        raise ConfigError(
            f"grpo.generation_batch_size={generation_batch_size} must be divisible by {mini_batch_text} = "
            f"{mini_batch}; nearest valid: {valid} (whole mini-batches per batch)"
        )
    return BatchSizes(
        generation_batch_size=generation_batch_size,
        steps_per_generation=generation_batch_size // mini_batch,
        gradient_accumulation_steps=gradient_accumulation_steps,
        prompt_batch_size=generation_batch_size // num_generations,
    )
