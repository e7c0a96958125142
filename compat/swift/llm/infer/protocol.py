"""``swift.llm.infer.protocol`` (ms-swift 3): rollstream's protocol objects (``schedulers/protocol.py``)."""

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
