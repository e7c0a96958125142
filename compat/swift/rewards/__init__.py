"""``swift.rewards`` (ms-swift 4): reward base classes and registries."""

from rewards import ORM, AsyncORM, orms  # noqa: F401
from swift._shim import rm_plugins  # noqa: F401
