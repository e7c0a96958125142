"""``swift.llm.utils`` (ms-swift 3)."""

from schedulers import Messages  # noqa: F401
from swift._shim import to_device  # noqa: F401
