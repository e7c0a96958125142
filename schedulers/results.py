"""A scheduler's result dict -> the fields of one ``Trajectory`` (pure, given the engine's tokenizer).

Accepts ms-swift's shapes: token ids / masks / logprobs per round (list of lists) or flat, or missing
(then the response choice's tokens, mask 1). ``loss_scale = "last_round"`` masks every round but the last,
unless the scheduler gave an explicit ``response_loss_mask`` (which wins, as in ms-swift).

On the wire the logprobs sit at their tokens' positions (one float per completion token, 0.0 where the
mask is 0), so the learner reads them positionally.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline.records import pack_f32, pack_i32
from schedulers.base import SchedulerError, check_lengths, template_gap
from schedulers.protocol import ChatCompletionResponse, ChatCompletionResponseChoice, extract_logprobs


@dataclass(frozen=True, slots=True)
class TrajectoryParts:
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # one per completion token; 0.0 where loss_mask is 0
    completion: str
    prompt_messages: list[dict[str, Any]]
    finish_reason: str
    rollout_infos: dict[str, Any]
    policy_versions: tuple[int, int]
    conversation: list[dict[str, Any]]  # the final structured conversation, the last reply last
    message_spans: list[tuple[int, int]]  # (start, end) in completion_ids of each assistant message's ids

    def record_fields(self) -> dict[str, Any]:
        """The ``Trajectory`` fields these parts fill, packed as the record carries them."""
        return {
            "prompt_ids": pack_i32(self.prompt_ids),
            "completion_ids": pack_i32(self.completion_ids),
            "logprobs": pack_f32(self.logprobs),
            "loss_mask": pack_i32(self.loss_mask),
            "messages": self.prompt_messages,
            "completion": self.completion,
            "finish_reason": self.finish_reason,
            "rollout_infos": self.rollout_infos,
            "conversation": self.conversation,
            "message_spans": self.message_spans,
            "policy_version": self.policy_versions[0],
            "max_policy_version": self.policy_versions[1],
        }


_MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32
_FINISH_REASONS = ("stop", "length", "abort")


def run_results(value: Any, scheduler: str, request_id: str) -> list[Any]:
    """``run()``'s return as a list of result dicts: a list (or tuple), or one alone, of result dicts or
    ms-swift ``RolloutOutput`` objects (rollstream's, or anything with its fields)."""
    if isinstance(value, dict) or _is_rollout_output(value):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise SchedulerError(
            f"scheduler {scheduler}: run() returned {type(value).__name__} for request {request_id}; "
            f"return a RolloutOutput, a list of them, or a list of result dicts"
        )
    if not value:
        raise SchedulerError(f"scheduler {scheduler}: run() returned no result for request {request_id}")
    return [_from_rollout_output(v) if _is_rollout_output(v) else v for v in value]


def _is_rollout_output(value: Any) -> bool:
    return not isinstance(value, dict) and all(
        hasattr(value, name) for name in ("response", "response_token_ids", "response_loss_mask", "rollout_infos")
    )


def _from_rollout_output(out: Any) -> dict[str, Any]:
    """An ms-swift ``RolloutOutput`` as a result dict. Its token fields hold one list per trained assistant
    message (the last N of ``messages``); the chat template's tokens between them are rendered here, mask 0,
    as ms-swift's template renders the inserted messages at training time."""
    result: dict[str, Any] = {"response": out.response, "rollout_infos": dict(out.rollout_infos or {}),
                              "swift_output": True}
    if out.messages is not None:
        result["messages"] = out.messages
    for key in ("response_token_ids", "response_loss_mask", "rollout_logprobs"):
        value = getattr(out, key, None)
        if value:
            result[key] = value
    return result


def _is_token(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and 0 <= int(value) <= _MAX_TOKEN_ID


def _is_mask(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and value in (0, 1)


def _is_logprob(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


_NONE = object()  # "no bad value found" (None itself may be the bad value)
_EXPECTED = {
    _is_token: f"token ids (ints in 0..{_MAX_TOKEN_ID})",
    _is_mask: "mask values (0 or 1)",
    _is_logprob: "logprobs (finite floats)",
}


def _flat(value: Any, key: str, where: str, check: Any) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise SchedulerError(f"{where}: {key} is {type(value).__name__}; give a list of {_EXPECTED[check]}")
    bad = next((v for v in value if not check(v)), _NONE)
    if bad is not _NONE:
        raise SchedulerError(f"{where}: {key} holds {bad!r}; give {_EXPECTED[check]}")
    return [int(v) if check is not _is_logprob else float(v) for v in value]


def _rounds(value: Any, key: str, where: str, check: Any) -> list[list[Any]]:
    """A per-round (list of lists) or flat field as a list of rounds; [] when absent or empty."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise SchedulerError(
            f"{where}: {key} is {type(value).__name__}; "
            f"give a list of {_EXPECTED[check]}, or one list per round"
        )
    if not value:
        return []
    if isinstance(value[0], (list, tuple)):
        return [_flat(r, f"{key}[{i}]", where, check) for i, r in enumerate(value)]
    return [_flat(value, key, where, check)]


def _messages(value: Any, key: str, where: str) -> list[dict[str, Any]]:
    """Chat messages as they travel in a Trajectory: dicts with str keys and a str role."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(
        isinstance(m, dict) and all(isinstance(k, str) for k in m) and isinstance(m.get("role"), str)
        for m in value
    ):
        raise SchedulerError(f"{where}: {key} must be a list of message dicts with a str 'role'")
    return list(value)


def _choice(response: Any, where: str) -> ChatCompletionResponseChoice | None:
    if response is None:
        return None
    if not (
        isinstance(response, ChatCompletionResponse)
        and isinstance(response.choices, (list, tuple))
        and response.choices
        and isinstance(response.choices[0], ChatCompletionResponseChoice)
    ):
        raise SchedulerError(
            f"{where}: response is {type(response).__name__}; give a ChatCompletionResponse with one choice"
        )
    return response.choices[0]


def _choice_logprobs(choice: ChatCompletionResponseChoice, where: str) -> list[float]:
    try:
        logprobs = extract_logprobs(choice)
    except (TypeError, KeyError, AttributeError):
        raise SchedulerError(
            f"{where}: response.choices[0].logprobs must be {{'content': [{{'token_id', 'logprob'}}, ...]}}"
        ) from None
    return _flat(logprobs, "response.choices[0].logprobs", where, _is_logprob)


def _rollout_infos(value: Any, where: str) -> dict[str, Any]:
    """The scheduler's extra info, checked now: it must travel in the record (msgpack, str keys)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise SchedulerError(f"{where}: rollout_infos must be a dict with str keys")
    try:
        msgspec.msgpack.encode(value)
    except (TypeError, OverflowError, ValueError) as exc:
        raise SchedulerError(
            f"{where}: rollout_infos cannot travel in a record ({exc}); use plain data"
        ) from None
    return dict(value)


def _versions(value: Any, where: str) -> tuple[int, int]:
    if not (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, numbers.Integral) and 0 <= int(v) < 2**63 for v in value)
    ):
        raise SchedulerError(
            f"{where}: policy_versions must be (oldest, newest) non-negative ints, got {value!r}"
        )
    return int(value[0]), int(value[1])


def trajectory_parts(
    result: dict[str, Any],
    engine: Any,
    *,
    loss_scale: str,
    scheduler: str,
    index: int,
    default_versions: tuple[int, int],
    default_messages: list[dict[str, Any]],
) -> TrajectoryParts:
    """One result dict as a Trajectory's fields; anything malformed is a SchedulerError naming the key."""
    where = f"scheduler {scheduler}: run() result {index}"
    if not isinstance(result, dict):
        raise SchedulerError(
            f"{where} is {type(result).__name__}; return a list of dicts "
            f"(messages, response_token_ids, response_loss_mask, rollout_logprobs, rollout_infos)"
        )
    choice = _choice(result.get("response"), where)
    ids = _rounds(result.get("response_token_ids"), "response_token_ids", where, _is_token)
    if not ids and choice is not None:
        ids = [_flat(choice.token_ids or [], "response.choices[0].token_ids", where, _is_token)]
    if not ids:
        raise SchedulerError(f"{where} has no response_token_ids and no response")
    explicit = bool(result.get("explicit_loss_mask", bool(result.get("response_loss_mask"))))
    masks = _rounds(result.get("response_loss_mask"), "response_loss_mask", where, _is_mask) or [
        [1] * len(r) for r in ids
    ]
    flat_logprobs = [
        lp
        for r in _rounds(result.get("rollout_logprobs"), "rollout_logprobs", where, _is_logprob)
        for lp in r
    ]
    if not flat_logprobs and choice is not None:
        flat_logprobs = _choice_logprobs(choice, where)
    if len(masks) != len(ids) or any(len(m) != len(r) for m, r in zip(masks, ids)):
        raise SchedulerError(
            f"{where}: response_loss_mask does not match response_token_ids round for round, token for token"
        )
    messages = [m for m in _messages(result.get("messages"), "messages", where)
                if not (m["role"] == "assistant" and m.get("content") is None)]  # ms-swift 3.12's placeholder
    swift_prompt: list[dict[str, Any]] | None = None
    if result.get("swift_output"):
        # ms-swift: no messages = the request's messages plus the reply; messages end with the last reply
        messages = messages or [*default_messages]
        if not messages or messages[-1]["role"] != "assistant":
            text = choice.message.content if choice is not None else engine.decode([t for r in ids for t in r])
            messages = [*messages, {"role": "assistant", "content": text}]
        lengths = [len(r) for r in ids]  # each round is one assistant message's ids; the layout adds the gaps
        ids, masks, swift_prompt = _swift_layout(messages, ids, masks, engine, where)
    else:
        lengths = _message_lengths(result.get("response_message_lengths"), ids, masks, where)
    spans, start = [], 0
    for r, length in zip(ids, lengths):
        spans.append((start, start + length))
        start += len(r)
    flat_ids = [t for r in ids for t in r]
    flat_mask = [m for r in masks for m in r]
    check_lengths(flat_ids, flat_mask, flat_logprobs, scheduler, len(ids))
    if loss_scale == "last_round" and not explicit and len(ids) > 1:
        # ms-swift's last_round: only the last assistant round is trained; earlier logprobs go too.
        earlier = sum(sum(m) for m in masks[:-1])
        flat_logprobs = flat_logprobs[earlier:]
        flat_mask = [0] * sum(len(m) for m in masks[:-1]) + list(masks[-1])
    positional, it = [], iter(flat_logprobs)
    for m in flat_mask:
        positional.append(next(it) if m else 0.0)
    if messages and messages[-1]["role"] == "assistant":
        completion, prompt_messages = messages[-1].get("content"), messages[:-1]
        if not isinstance(completion, str):
            raise SchedulerError(f"{where}: the last assistant message's content must be a str")
        conversation = messages
    else:
        completion, prompt_messages = engine.decode(flat_ids), messages
        conversation = [*(messages or default_messages), {"role": "assistant", "content": completion}]
    if swift_prompt is not None:
        prompt_messages = swift_prompt
    prompt_ids = result.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = engine.encode(engine.render(prompt_messages or default_messages))
    prompt_ids = _flat(prompt_ids, "prompt_token_ids", where, _is_token)
    if result.get("swift_output"):  # every engine call of the request counts, not only the last response's
        versions = default_versions
    else:
        versions = result.get("policy_versions") or (choice.policy_versions if choice else default_versions)
    finish = result.get("finish_reason") or (choice.finish_reason if choice else None) or "stop"
    if finish not in _FINISH_REASONS:
        raise SchedulerError(f"{where}: finish_reason={finish!r} is not one of {', '.join(_FINISH_REASONS)}")
    return TrajectoryParts(
        prompt_ids=prompt_ids,
        completion_ids=flat_ids,
        loss_mask=flat_mask,
        logprobs=positional,
        completion=completion,
        prompt_messages=_messages(result.get("prompt_messages"), "prompt_messages", where)
        or prompt_messages
        or default_messages,
        finish_reason=finish,
        rollout_infos=_rollout_infos(result.get("rollout_infos"), where),
        policy_versions=_versions(versions, where),
        conversation=_conversation(conversation, where),
        message_spans=spans,
    )


def _message_lengths(value: Any, ids: list[list[int]], masks: list[list[int]], where: str) -> list[int]:
    """How many leading ids of each round are its assistant message's (the rest: the template's tokens up to
    the next message, mask 0): rollstream's ``response_message_lengths`` (the default run gives them), else
    each round but the last up to its last trained token (mask 1, as given: before ``loss_scale`` masked any
    round) and the last whole (no template gap follows it)."""
    if value is None:
        return [max((i + 1 for i, m in enumerate(mask) if m), default=len(mask)) for mask in masks[:-1]] + [
            len(ids[-1])
        ]
    if not (
        isinstance(value, (list, tuple))
        and len(value) == len(ids)
        and all(isinstance(n, numbers.Integral) and 0 <= int(n) <= len(r) for n, r in zip(value, ids))
    ):
        raise SchedulerError(
            f"{where}: response_message_lengths must hold one int per round of response_token_ids, each in "
            f"0..the round's length (how many of its leading ids are the assistant message's), got {value!r}"
        )
    return [int(n) for n in value]


def _swift_layout(messages: list[dict[str, Any]], ids: list[list[int]], masks: list[list[int]], engine: Any,
                  where: str) -> tuple[list[list[int]], list[list[int]], list[dict[str, Any]]]:
    """ms-swift's training layout of a ``RolloutOutput``: its k rounds are the last k assistant messages; the
    prompt is the conversation before the first of them, and each round but the last is followed by the
    template's tokens up to the next one (the closing marker, the inserted user/tool messages, the next
    assistant header), mask 0. Returns the rounds with those gaps, their masks, and the prompt messages."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(ids) > len(assistants):
        raise SchedulerError(
            f"{where}: {len(ids)} rounds of response_token_ids for {len(assistants)} assistant message(s) in "
            f"messages; give one list per trained assistant message (the last ones)"
        )
    trained = assistants[len(assistants) - len(ids):]
    ids, masks = [list(r) for r in ids], [list(m) for m in masks]
    for j in range(len(trained) - 1):
        gap = template_gap(engine, messages[: trained[j] + 1], messages[: trained[j + 1]], ids[j], where, j + 1)
        ids[j] += gap
        masks[j] += [0] * len(gap)
    return ids, masks, messages[: trained[0]]


def _conversation(messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The conversation as it travels in the record (plain data; media parts as their builtins)."""
    try:
        return msgspec.to_builtins(list(messages), str_keys=True)
    except (TypeError, ValueError) as exc:
        raise SchedulerError(f"{where}: messages cannot travel in a record ({exc}); use plain data") from None
