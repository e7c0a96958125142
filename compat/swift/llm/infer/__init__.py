"""``swift.llm.infer`` (ms-swift 3)."""

from swift._shim import PtEngine  # noqa: F401
from swift.llm.infer.protocol import (  # noqa: F401
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    RequestConfig,
    RolloutOutput,
)
