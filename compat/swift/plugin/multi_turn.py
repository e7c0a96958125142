"""``swift.plugin.multi_turn`` (ms-swift 3): scheduler base classes, the ``multi_turns`` registry, the built-ins."""

from schedulers import (  # noqa: F401
    ContextManager,
    Env,
    GYMScheduler,
    Messages,
    MultiTurnScheduler,
    RolloutScheduler,
    context_managers,
    envs,
    multi_turns,
)
from schedulers.builtin import (  # noqa: F401
    MathTipsMultiTurnScheduler,
    MathTipsScheduler,
    ThinkingModelTipsScheduler,
)
