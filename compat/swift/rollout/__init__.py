"""``swift.rollout`` (ms-swift 4): scheduler base classes, gym envs and their registries."""

from schedulers import Env, MultiTurnScheduler, RolloutScheduler, envs, multi_turns  # noqa: F401
