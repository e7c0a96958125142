"""``swift.rollout.gym_env`` (ms-swift 4): the gym ``Env`` base class and the ``envs`` registry."""

from schedulers import Env, envs  # noqa: F401
