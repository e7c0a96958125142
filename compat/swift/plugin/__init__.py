"""``swift.plugin`` (ms-swift 3): the reward, scheduler, env and context-manager registries."""

from rewards import ORM, AsyncORM, orms  # noqa: F401
from schedulers import (  # noqa: F401
    ContextManager,
    Env,
    MultiTurnScheduler,
    RolloutScheduler,
    context_managers,
    envs,
    multi_turns,
)
from swift._shim import rm_plugins  # noqa: F401
