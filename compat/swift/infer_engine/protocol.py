"""``swift.infer_engine.protocol`` (ms-swift 4): rollstream's protocol objects (``schedulers/protocol.py``)."""

from schedulers import (  # noqa: F401
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    UsageInfo,
)
from schedulers import RolloutInferRequest as InferRequest  # noqa: F401
