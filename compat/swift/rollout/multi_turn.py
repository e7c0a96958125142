"""``swift.rollout.multi_turn`` (ms-swift 4): scheduler base classes, the ``multi_turns`` registry, the built-ins."""

from schedulers import (  # noqa: F401
    Env,
    GYMScheduler,
    Messages,
    MultiTurnScheduler,
    OpenEnvScheduler,
    RolloutScheduler,
    envs,
    multi_turns,
)
from schedulers.builtin import MathTipsScheduler, ThinkingModelTipsScheduler  # noqa: F401
