"""The objects a multi-turn scheduler sees, with ms-swift's class and field names
(``swift.infer_engine.protocol``), so a scheduler written for ms-swift runs here after changing its imports.

Plain dataclasses: they never cross a process boundary (the rollout stage turns a scheduler's result
into a ``Trajectory`` record).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, Any]]


@dataclass
class RolloutInferRequest:
    """One rollout request: the conversation so far plus the dataset row (ms-swift's fields).

    ``data_dict`` carries the row's other columns (``solution``, ...); ``uuid`` is the request id, stable
    across the request's turns.
    """

    messages: Messages
    images: list[str] = field(default_factory=list)
    audios: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    objects: dict[str, Any] = field(default_factory=dict)
    data_dict: dict[str, Any] = field(default_factory=dict)
    uuid: str | None = None


@dataclass
class ChatMessage:
    role: str
    content: str
    tool_calls: list[dict[str, Any]] | None = None


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
class ChatCompletionResponse:
    choices: list[ChatCompletionResponseChoice]


@dataclass
class RequestConfig:
    """Sampling settings of one request (ms-swift's ``RequestConfig`` names); the rollout stage fills it from
    ``grpo`` / ``rollout`` config. ``seed`` is the request's base seed: turn k samples with ``seed + k - 1``
    offsets, so every turn is reproducible and distinct."""

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1


def extract_logprobs(choice: ChatCompletionResponseChoice) -> list[float]:
    """The sampled tokens' logprobs of a choice (ms-swift's ``_extract_logprobs_from_choice``)."""
    if not choice.logprobs or "content" not in choice.logprobs:
        return []
    return [item["logprob"] for item in choice.logprobs["content"]]
