"""``swift.llm`` (ms-swift 3): the request/response objects and helpers a plugin imports from it."""

from schedulers import (  # noqa: F401
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    Messages,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
)
from schedulers import RolloutInferRequest as InferRequest  # noqa: F401
from swift._shim import PtEngine, Template, to_device  # noqa: F401
