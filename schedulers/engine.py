"""What a scheduler calls to sample a turn: ``infer_engine.infer_async(request, request_config)``, as in
ms-swift, on top of any token-in/token-out backend (the rollout stage's vLLM engine, or a fake in tests).

The per-request identity (request id, seed, sampling settings) lives in a ``ContextVar`` set by the
rollout stage around each ``scheduler.run``: one scheduler instance serves many concurrent requests, and
asyncio gives every request task its own copy of the context.

Every prompt a scheduler renders goes through the run's chat template (``data.chat.ChatTemplate``: its
keywords, e.g. ``enable_thinking``, and the request's tools), as the rollout's first prompt did. A turn gets
what is left of ``max_model_len``: a conversation may run into the context's end over several turns, and that
turn then ends with finish_reason "length" (the trajectory counts as truncated: completions/clipped_ratio).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from data.chat import ChatTemplate
from data.media import pil_images
from schedulers.base import SchedulerError
from schedulers.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    Messages,
    RequestConfig,
    RolloutInferRequest,
    UsageInfo,
)

# What a RequestConfig field left None means outside a rollout (a notebook, a custom driver): the engine's
# plain sampling. Inside one, None takes the rollout's setting (the request context's config).
_PLAIN_SAMPLING = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "</s>")

# Seeds of successive turns of one request: far apart so they never collide with the next request's seed.
TURN_SEED_STRIDE = 100_003
MAX_SEED = 2**31 - 1


class Sample(Protocol):
    """What a backend's generate returns (read-only: engines.base.Sample is a frozen dataclass)."""

    @property
    def completion_ids(self) -> list[int]: ...

    @property
    def logprobs(self) -> list[float]: ...

    @property
    def finish_reason(self) -> str: ...

    @property
    def min_version(self) -> int: ...

    @property
    def max_version(self) -> int: ...


class TokenBackend(Protocol):
    """Token ids in, token ids + logprobs out (``stages.rollout.VLLMEngine`` implements it)."""

    tokenizer: Any

    async def generate(self, prompt_ids: list[int], *, request_id: str, seed: int | None, max_tokens: int,
                       **sampling: Any) -> Sample: ...


@dataclass
class RequestContext:
    """One rollout request's identity, shared by its turns."""

    request_id: str
    config: RequestConfig
    calls: int = 0  # engine calls so far (turns, plus any extra calls of a custom run)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (oldest, newest) weights per call
    seeds: list[int | None] = field(default_factory=list)  # the engine's seed per call (None: nothing sampled)
    prompt_ids: list[int] | None = None  # the first prompt, as the rollout stage tokenized and truncated it
    tools: list[dict[str, Any]] | None = None  # the request's tool schemas, which every rendering shows the model


CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("rollstream_request", default=None)


@contextlib.contextmanager
def request_context(ctx: RequestContext) -> Iterator[RequestContext]:
    token = CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        CURRENT.reset(token)


class InferEngine:
    """ms-swift's ``infer_engine`` as a scheduler sees it: ``infer_async``, ``tokenizer``, chat rendering."""

    def __init__(self, backend: TokenBackend, max_model_len: int, chat: ChatTemplate | None = None) -> None:
        self.backend = backend
        self.tokenizer = backend.tokenizer
        self.max_model_len = max_model_len
        self.chat = chat or ChatTemplate()  # the run's template and keywords; default: the tokenizer's own

    # ------------------------------------------------------------ text <-> tokens

    def render(self, messages: Messages, *, close_last: bool = False, tools: Any = None) -> str:
        """The chat template's text for ``messages``. A trailing assistant message is continued (the model
        goes on writing it) unless ``close_last``; otherwise the text ends with the generation prompt.
        ``tools``: None = the current request's (its ``RolloutInferRequest.tools``)."""
        if tools is None:
            ctx = CURRENT.get()
            tools = ctx.tools if ctx is not None else None
        return self.chat.render(self.tokenizer, messages, tools=tools, close_last=close_last)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def first_prompt_ids(self, messages: Messages) -> list[int]:
        """The request's first prompt: as the rollout stage tokenized (and truncated) it, else rendered."""
        ctx = CURRENT.get()
        if ctx is not None and ctx.prompt_ids is not None:
            return list(ctx.prompt_ids)
        return self.encode(self.render(messages))

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Tokens that end a turn: EOS and the chat template's end-of-turn specials that this vocabulary has.
        A continued assistant message must not carry one inside the next turn's context (ms-swift re-renders
        the message, so its model never sees one there)."""
        ids = {self.eos_token_id} if self.eos_token_id is not None else set()
        special = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        special |= {str(t) for t in (getattr(self.tokenizer, "added_tokens_decoder", None) or {}).values()}
        for token in _END_OF_TURN_TOKENS:
            if token in special:
                token_id = self.tokenizer.convert_tokens_to_ids(token)
                if isinstance(token_id, int) and token_id >= 0:
                    ids.add(token_id)
        return frozenset(ids)

    @property
    def model(self) -> str:
        return str(getattr(self.backend, "model_dir", "") or "")

    # ------------------------------------------------------------ sampling

    async def infer_async(
        self,
        infer_request: RolloutInferRequest,
        request_config: RequestConfig | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        **kwargs: Any,
    ) -> ChatCompletionResponse:
        """Sample one turn. The prompt is ``prompt_token_ids`` when given (the token-level default run),
        else the chat template applied to ``infer_request.messages`` (as ms-swift does)."""
        ctx = CURRENT.get()
        if ctx is None:  # called outside the rollout stage (a notebook, a custom driver)
            ctx = RequestContext(request_id=infer_request.uuid or "request", config=request_config or RequestConfig())
        config = resolve_config(request_config, ctx.config)
        if prompt_token_ids is None:
            prompt_token_ids = self.encode(self.render(infer_request.messages, tools=infer_request.tools))
        ctx.calls += 1
        room = self.max_model_len - len(prompt_token_ids)
        if room <= 0:  # the conversation filled the context: nothing more can be sampled
            lo = hi = getattr(self.backend, "version", 0)
            ctx.versions.append((lo, hi))
            ctx.seeds.append(None)
            return _response([], [], "length", (lo, hi), "", self.model, len(prompt_token_ids))
        seed = None if config.seed is None else (config.seed + (ctx.calls - 1) * TURN_SEED_STRIDE) % MAX_SEED
        ctx.seeds.append(seed)
        sample = await self.backend.generate(
            list(prompt_token_ids),
            request_id=f"{ctx.request_id}/c{ctx.calls}",
            seed=seed,
            max_tokens=min(config.max_tokens or room, room),
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            stop=list(config.stop or []),
            # Image prompts: the request's images so far, one per image token of the (unexpanded) context.
            **({"images": pil_images(infer_request.images)} if infer_request.images else {}),
        )
        versions = (sample.min_version, sample.max_version)
        ctx.versions.append(versions)
        ids = list(sample.completion_ids)
        return _response(ids, list(sample.logprobs), sample.finish_reason, versions, self.decode(ids), self.model,
                         len(prompt_token_ids))


def resolve_config(config: RequestConfig | None, base: RequestConfig) -> RequestConfig:
    """``config``'s settings, each one left None taking ``base``'s (the rollout's), then plain sampling."""
    if config is None:
        config = base
    if config.n != 1:
        raise SchedulerError(
            f"RequestConfig(n={config.n}): a scheduler samples one reply per request (ms-swift asserts n == 1); "
            f"the group's num_generations requests run the scheduler once each"
        )
    resolved = dataclasses.replace(config)
    for name in ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed", "stop"):
        if getattr(resolved, name) is None or (name == "stop" and not resolved.stop):
            value = getattr(base, name)
            setattr(resolved, name, _PLAIN_SAMPLING.get(name) if value is None else value)
    return resolved


def _response(ids: list[int], logprobs: list[float], finish_reason: str, versions: tuple[int, int],
              text: str, model: str = "", prompt_tokens: int = 0) -> ChatCompletionResponse:
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, logprobs)]
    choice = ChatCompletionResponseChoice(
        index=0,
        message=ChatMessage(role="assistant", content=text),
        finish_reason=finish_reason,
        logprobs={"content": content},
        token_ids=ids,
        policy_versions=versions,
    )
    usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=len(ids), total_tokens=prompt_tokens + len(ids))
    return ChatCompletionResponse(model=model, choices=[choice], usage=usage)
