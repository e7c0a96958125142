"""``swift.infer_engine`` (ms-swift 4)."""

from swift._shim import TransformersEngine  # noqa: F401
from swift.infer_engine.protocol import (  # noqa: F401
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    InferRequest,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
)
