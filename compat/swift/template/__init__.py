"""``swift.template`` (ms-swift 4)."""

from schedulers import Messages  # noqa: F401
from swift._shim import Template  # noqa: F401
