"""A scheduler's result dict -> the fields of one ``Trajectory`` (pure, given the engine's tokenizer).

Accepts ms-swift's shapes: token ids / masks / logprobs per round (list of lists) or flat, or missing
(then the response choice's tokens, mask 1). ``loss_scale = "last_round"`` masks every round but the last,
unless the scheduler gave an explicit ``response_loss_mask`` (which wins, as in ms-swift).

On the wire the logprobs sit at their tokens' positions (one float per completion token, 0.0 where the
mask is 0), so the learner reads them positionally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schedulers.base import SchedulerError, check_lengths
from schedulers.protocol import extract_logprobs


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


def _rounds(value: Any) -> list[list[Any]]:
    if not value:
        return []
    return [list(r) for r in value] if isinstance(value[0], (list, tuple)) else [list(value)]


def trajectory_parts(result: dict[str, Any], engine: Any, *, loss_scale: str, scheduler: str, index: int,
                     default_versions: tuple[int, int], default_messages: list[dict[str, Any]]) -> TrajectoryParts:
    if not isinstance(result, dict):
        raise SchedulerError(
            f"scheduler {scheduler}: run() result {index} is {type(result).__name__}; return a list of dicts "
            f"(messages, response_token_ids, response_loss_mask, rollout_logprobs, rollout_infos)"
        )
    choice = result["response"].choices[0] if result.get("response") is not None else None
    ids = _rounds(result.get("response_token_ids")) or ([list(choice.token_ids or [])] if choice else [])
    if not ids:
        raise SchedulerError(f"scheduler {scheduler}: run() result {index} has no response_token_ids and no response")
    explicit = bool(result.get("explicit_loss_mask", bool(result.get("response_loss_mask"))))
    masks = _rounds(result.get("response_loss_mask")) or [[1] * len(r) for r in ids]
    flat_logprobs = [lp for r in _rounds(result.get("rollout_logprobs")) for lp in r]
    if not flat_logprobs and choice is not None:
        flat_logprobs = extract_logprobs(choice)
    if len(masks) != len(ids) or any(len(m) != len(r) for m, r in zip(masks, ids)):
        raise SchedulerError(
            f"scheduler {scheduler}: run() result {index}: response_loss_mask does not match "
            f"response_token_ids round for round, token for token"
        )
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
    messages = result.get("messages") or []
    if messages and messages[-1]["role"] == "assistant":
        completion, prompt_messages = messages[-1]["content"], messages[:-1]
    else:
        completion, prompt_messages = engine.decode(flat_ids), messages
    prompt_ids = result.get("prompt_token_ids")
    if prompt_ids is None:
        prompt_ids = engine.encode(engine.render(prompt_messages or default_messages))
    versions = result.get("policy_versions") or (choice.policy_versions if choice else default_versions)
    finish = result.get("finish_reason") or (choice.finish_reason if choice else None) or "stop"
    return TrajectoryParts(
        prompt_ids=list(prompt_ids),
        completion_ids=flat_ids,
        loss_mask=flat_mask,
        logprobs=positional,
        completion=completion,
        prompt_messages=result.get("prompt_messages") or prompt_messages or default_messages,
        finish_reason=finish,
        rollout_infos=dict(result.get("rollout_infos") or {}),
        policy_versions=(int(versions[0]), int(versions[1])),
    )
