"""``swift.rollout.openenv_wrapper`` (ms-swift 4.4+): the OpenEnv client wrapper ``OpenEnvScheduler`` creates."""

from schedulers.openenv import OpenEnvWrapper  # noqa: F401
