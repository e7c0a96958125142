"""``swift.plugin.env`` (ms-swift 3): the gym ``Env`` base class and the ``envs`` registry."""

from schedulers import Env, envs  # noqa: F401
