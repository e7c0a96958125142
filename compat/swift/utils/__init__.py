"""``swift.utils`` (ms-swift 3 and 4): the helpers plugins import from it."""

from schedulers import remove_response  # noqa: F401
from swift._shim import get_logger, to_device  # noqa: F401
