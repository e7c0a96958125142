"""``swift.llm.template`` (ms-swift 3)."""

from schedulers import RolloutInferRequest  # noqa: F401
from schedulers import RolloutInferRequest as InferRequest  # noqa: F401
from swift._shim import Template  # noqa: F401
