"""The objects a multi-turn scheduler sees and returns, with ms-swift's class and field names
(``swift.infer_engine.protocol``, formerly ``swift.llm.infer.protocol`` / ``swift.llm.template``), so a
scheduler written for ms-swift builds and reads them as it does there.

Plain dataclasses (ms-swift's ``RolloutOutput`` is a pydantic model; keyword construction and the
flat-list wrapping of its token fields behave the same): they never cross a process boundary (the rollout
stage turns a scheduler's result into a ``Trajectory`` record).
"""

from __future__ import annotations

import time
import uuid as uuid_lib
from dataclasses import asdict, dataclass, field
from typing import Any

Messages = list[dict[str, Any]]


@dataclass
class RolloutInferRequest:
    """One rollout request: the conversation so far plus the dataset row (ms-swift's fields).

    ``data_dict`` carries the row's other columns (``solution``, ...); ``uuid`` is the request id, stable
    across the request's turns.
    """

    messages: Messages
    images: list[Any] = field(default_factory=list)  # paths, URLs or bytes (ms-swift's types, and stored images)
    audios: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    objects: dict[str, Any] = field(default_factory=dict)
    data_dict: dict[str, Any] = field(default_factory=dict)
    uuid: str | None = None

    @staticmethod
    def remove_response(messages: Messages) -> str | None:
        """Pop a trailing assistant message and return its content (ms-swift's, in place)."""
        if messages and messages[-1]["role"] == "assistant":
            return messages.pop()["content"]
        return None

    def to_printable(self) -> dict[str, Any]:
        """The request as a dict, long non-text strings (base64 media) shortened, as ms-swift prints it."""
        return _printable(asdict(self))


def _printable(obj: Any, key: str | None = None) -> Any:
    if isinstance(obj, str) and key not in {"content", "text"} and len(obj) >= 1000:
        return f"<<<base64:{obj[:50]}..>>>"
    if isinstance(obj, list):
        return [_printable(item) for item in obj]
    if isinstance(obj, dict):
        return {k: _printable(v, k) for k, v in obj.items()}
    return obj


def remove_response(messages: Messages) -> str | None:
    """``swift.utils.remove_response``: the same as ``RolloutInferRequest.remove_response``."""
    return RolloutInferRequest.remove_response(messages)


@dataclass
class ChatMessage:
    role: str
    content: Any
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


@dataclass
class ChatCompletionResponseChoice:
    """One turn's reply. ``logprobs`` has ms-swift's (OpenAI's) shape: ``{"content": [{"token_id", "logprob"}]}``,
    one entry per token in ``token_ids``. ``messages`` is filled at the end of a multi-turn rollout."""

    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: dict[str, list[dict[str, Any]]] | None = None
    token_ids: list[int] | None = None
    messages: Messages | None = None
    # rollstream's addition: the oldest and newest weights version that sampled this turn.
    policy_versions: tuple[int, int] = (0, 0)


@dataclass
class UsageInfo:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def _completion_id() -> str:
    return f"chatcmpl-{uuid_lib.uuid4().hex}"


@dataclass
class ChatCompletionResponse:
    """ms-swift's response: ``ChatCompletionResponse(model, choices, usage)``; rollstream's engine fills
    ``model`` with the model directory and ``usage`` with the turn's token counts."""

    model: str = ""
    choices: list[ChatCompletionResponseChoice] = field(default_factory=list)
    usage: UsageInfo | None = None
    id: str = field(default_factory=_completion_id)
    object: str = "chat.completion"
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_token_ids: list[int] | None = None


@dataclass
class RequestConfig:
    """Sampling settings of one request, with ms-swift's names and defaults. A field left ``None`` takes the
    rollout's setting (``grpo`` / ``rollout`` config; ``max_tokens``: ``grpo.max_completion_length``), as
    ms-swift's None means "the deployment's". ``seed`` is the request's base seed: turn k samples with
    ``seed + k - 1`` offsets, so every turn is reproducible and distinct.

    Honoured by the engine: max_tokens, temperature, top_k, top_p, min_p (rollstream's), repetition_penalty,
    stop, seed. n must be 1 (one request per sample, as ms-swift's rollout asserts). The others (num_beams,
    stream, logprobs, top_logprobs, best_of, presence/frequency/length_penalty, return_details,
    structured_outputs_regex) are accepted so ms-swift code builds them; rollstream always returns the token
    ids and their logprobs."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    num_beams: int = 1
    stop: list[str] | None = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    logprobs: bool = False
    top_logprobs: int | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    length_penalty: float = 1.0
    return_details: bool = False
    structured_outputs_regex: str | None = None
    min_p: float | None = None  # rollstream's addition (vLLM's min_p)


def _wrap(value: Any) -> Any:
    """ms-swift's ``_wrap_flat_list``: a flat list of numbers is one round."""
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (list, tuple)):
        return [list(value)]
    return value


@dataclass
class RolloutOutput:
    """What ms-swift's ``run()`` returns (one, or a list: one trajectory record each).

    ``messages``: the final conversation, the last reply last (None: the request's messages plus the
    response's reply). ``response_token_ids`` / ``response_loss_mask`` / ``rollout_logprobs``: one list per
    trained assistant message (the last N assistant messages of ``messages``), or flat for one; empty: the
    response's last reply is the one trained. ``rollout_infos`` reaches the rewards."""

    response: ChatCompletionResponse
    messages: Messages | None = None
    response_token_ids: list[list[int]] = field(default_factory=list)
    response_loss_mask: list[list[int]] = field(default_factory=list)
    rollout_infos: dict[str, Any] = field(default_factory=dict)
    rollout_logprobs: list[list[float]] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None

    def __post_init__(self) -> None:
        self.response_token_ids = _wrap(self.response_token_ids) or []
        self.response_loss_mask = _wrap(self.response_loss_mask) or []
        self.rollout_logprobs = _wrap(self.rollout_logprobs) or []
        self.rollout_infos = dict(self.rollout_infos or {})

    def model_dump(self) -> dict[str, Any]:
        return asdict(self)


def extract_logprobs(choice: ChatCompletionResponseChoice) -> list[float]:
    """The sampled tokens' logprobs of a choice (ms-swift's ``_extract_logprobs_from_choice``)."""
    if not choice.logprobs or "content" not in choice.logprobs:
        return []
    return [item["logprob"] for item in choice.logprobs["content"]]
