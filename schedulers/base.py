"""ms-swift's ``MultiTurnScheduler``: ``step`` builds the next turn, ``check_finished`` ends the loop, and
an overridable ``run`` drives it on the engine. Each of the three may be sync or async.

The default ``run`` works on token ids, so the learner trains on exactly the tokens the engine saw: the
trajectory's completion is every turn's reply plus the tokens of whatever the scheduler inserted between
turns (tool output, a tip, the chat template's turn markers). Model tokens get loss mask 1 and their
logprobs; inserted tokens get mask 0 and no logprob, so ``len(rollout_logprobs) == sum(response_loss_mask)``
always (a scheduler that breaks it is an error naming the scheduler and the turn).

Both multi-turn styles are understood from what ``step`` did to the messages:

- new turn: ``step`` appended messages (a user tip, a tool result). The inserted tokens are the chat
  template's text between the reply and the next generation prompt.
- continuation: ``step`` extended the last assistant message. The inserted tokens are the added text; a
  trailing end-of-turn token of the reply is dropped (the message goes on, as a re-rendered history would).

``run`` returns a list of result dicts (one trajectory record each; a list longer than one is ms-swift's
per-turn pattern, the records share the request id). Keys, as ms-swift's ``RolloutOutput``:
``messages``, ``response_token_ids`` / ``response_loss_mask`` / ``rollout_logprobs`` (per round, or flat),
``rollout_infos``, ``finish_reason``, and rollstream's ``prompt_token_ids`` and ``policy_versions``.
"""

from __future__ import annotations

import copy
import inspect
from abc import ABC
from dataclasses import dataclass
from typing import Any

from schedulers.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    Messages,
    RequestConfig,
    RolloutInferRequest,
    extract_logprobs,
)

LOSS_SCALES = ("default", "last_round")
_SENTINEL = "\u2063rollstream-sentinel\u2063"  # finds where the template puts an assistant message's content


class SchedulerError(RuntimeError):
    """A scheduler broke the protocol (bad return, mask/logprob mismatch, rewritten history)."""


async def maybe_await(value: Any) -> Any:
    """``step``, ``check_finished``, ``run`` and the hooks may be sync or async."""
    return await value if inspect.isawaitable(value) else value


class MultiTurnScheduler(ABC):
    """Subclass it and implement ``step`` (and optionally ``check_finished``), or override ``run``.

    ``infer_engine`` is set by the rollout stage before the first request (``schedulers.engine.InferEngine``);
    ``tokenizer`` is the engine's.
    """

    # A step() (or a gym context manager) that rewrites earlier messages is an error of the token-level run,
    # unless this is true: then the request's record ends there and a new one starts from the new history.
    split_on_rewrite = False

    def __init__(self, max_turns: int | None = None, *args: Any, **kwargs: Any) -> None:
        self.max_turns = max_turns
        self.infer_engine: Any = kwargs.get("infer_engine")
        self._tokenizer = kwargs.get("tokenizer")

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is not None:
            return self._tokenizer
        return getattr(self.infer_engine, "tokenizer", None)

    @property
    def name(self) -> str:
        return type(self).__name__

    # ------------------------------------------------------------ the user's part

    def on_trajectory_start(self, requests: list[RolloutInferRequest]) -> None:
        """Before the first turn (ms-swift's hook): may edit the requests in place."""

    def on_turn_end(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
                    current_turn: int) -> dict[str, Any]:
        """After the reply is appended, before ``check_finished``: may return ``done`` and ``rollout_infos``."""
        return {}

    def step(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
             current_turn: int) -> dict[str, Any]:
        raise NotImplementedError(
            f"{self.name}: implement step(infer_request, response_choice, current_turn) or override run()"
        )

    def check_finished(self, infer_request: RolloutInferRequest, response_choice: ChatCompletionResponseChoice,
                       current_turn: int) -> bool:
        """As ms-swift: stop on a truncated reply or at ``max_turns`` (``current_turn`` starts at 1)."""
        if response_choice.finish_reason == "length":
            return True
        return bool(self.max_turns and current_turn >= self.max_turns)

    # ------------------------------------------------------------ the default token-level loop

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None,
                  **kwargs: Any) -> list[dict[str, Any]]:
        engine = self.infer_engine
        request = infer_request
        await maybe_await(self.on_trajectory_start([request]))
        prompt_messages = copy.deepcopy(request.messages)
        prompt_ids = engine.first_prompt_ids(request.messages)
        rounds: list[_Round] = []
        infos: dict[str, Any] = {}
        explicit_mask = False
        versions: list[tuple[int, int]] = []  # (oldest, newest) weights version of each turn of this record
        records: list[dict[str, Any]] = []  # earlier records of a history rewritten under split_on_rewrite
        turn = 1
        while True:
            context = prompt_ids + [t for r in rounds for t in r.token_ids]
            response: ChatCompletionResponse = await engine.infer_async(
                request, request_config, prompt_token_ids=context, **kwargs
            )
            choice = response.choices[0]
            versions.append(choice.policy_versions)
            messages = request.messages
            continues = bool(messages) and messages[-1]["role"] == "assistant"
            if continues:
                messages[-1]["content"] += choice.message.content
            else:
                messages.append({"role": "assistant", "content": choice.message.content})
            model_ids = list(choice.token_ids or [])
            model_logprobs = extract_logprobs(choice)
            turn_end = await maybe_await(self.on_turn_end(request, choice, turn)) or {}
            infos.update(turn_end.get("rollout_infos") or {})
            stop = bool(await maybe_await(self.check_finished(request, choice, turn)))
            if "done" in turn_end:
                stop = bool(turn_end["done"])
            if self.max_turns and turn >= self.max_turns:  # even when check_finished forgot it
                stop = True
            if stop:
                self._add(rounds, continues, model_ids, [1] * len(model_ids), model_logprobs, turn)
                break
            before = copy.deepcopy(request.messages)
            ret = normalize_step_result(await maybe_await(self.step(request, choice, turn)), self.name, turn)
            request = ret["infer_request"]
            if "response_token_ids" in ret:
                ids = list(ret["response_token_ids"])
                mask = list(ret.get("response_loss_mask") or [1] * len(ids))
                explicit_mask = explicit_mask or "response_loss_mask" in ret
                # an explicit (even empty) rollout_logprobs wins; else the reply's own (ms-swift's fallback)
                logprobs = list(ret["rollout_logprobs"] if ret.get("rollout_logprobs") is not None else model_logprobs)
            else:
                ids, mask, logprobs = model_ids, [1] * len(model_ids), model_logprobs
            infos.update(ret.get("rollout_infos") or {})
            if self.split_on_rewrite and not _extends(before, request.messages):
                # The history was rewritten (a context manager compressed it): this record ends with the
                # reply, and the next one starts from the rewritten history, rendered, as its prompt.
                self._add(rounds, continues, ids, mask, logprobs, turn)
                records.append(_record(before, prompt_messages, prompt_ids, rounds, {**infos, "num_turns": turn},
                                       choice.finish_reason, explicit_mask, versions))
                prompt_messages = copy.deepcopy(request.messages)
                prompt_ids = engine.encode(engine.render(request.messages))
                rounds, versions = [], []
                turn += 1
                continue
            ids, mask, logprobs, inserted = self._next_turn_tokens(
                before, request.messages, ids, mask, logprobs, turn, given_ids="response_token_ids" in ret
            )
            self._add(rounds, continues, ids + inserted, mask + [0] * len(inserted), logprobs, turn)
            turn += 1
        return [*records, _record(request.messages, prompt_messages, prompt_ids, rounds, {**infos, "num_turns": turn},
                                  choice.finish_reason, explicit_mask, versions)]

    # ------------------------------------------------------------ helpers of the default run

    def _add(self, rounds: list[_Round], continues: bool, ids: list[int], mask: list[int],
             logprobs: list[float], turn: int) -> None:
        check_lengths(ids, mask, logprobs, self.name, turn)
        if continues and rounds:  # a continued assistant message stays one round (ms-swift)
            rounds[-1].extend(ids, mask, logprobs)
        else:
            rounds.append(_Round(list(ids), list(mask), list(logprobs)))

    def _next_turn_tokens(self, before: Messages, after: Messages, ids: list[int], mask: list[int],
                          logprobs: list[float], turn: int, *, given_ids: bool) -> tuple:
        """This turn's tokens plus the inserted ones (mask 0) up to the next generation, from how ``step``
        changed the messages: extended the last assistant message, or appended messages."""
        engine = self.infer_engine
        eos = engine.eos_token_id
        if len(after) == len(before) and after[:-1] == before[:-1] and after[-1]["role"] == "assistant":
            if given_ids:  # the scheduler's response_token_ids already hold the whole continued message
                return ids, mask, logprobs, []
            old, new = before[-1]["content"], after[-1]["content"]
            if not new.startswith(old):
                raise SchedulerError(
                    f"scheduler {self.name}, turn {turn}: step() changed the assistant message instead of "
                    f"extending it; return response_token_ids (and response_loss_mask) for the rewritten reply"
                )
            if ids and ids[-1] == eos:  # the message goes on: its end-of-turn token is not part of it
                ids, mask, logprobs = ids[:-1], mask[:-1], logprobs[: len(logprobs) - mask[-1]]
            return ids, mask, logprobs, engine.encode(new[len(old):])
        if len(after) > len(before) and after[: len(before)] == before:
            closed = engine.render(before, close_last=True)
            following = engine.render(after)
            if not following.startswith(closed):
                raise SchedulerError(
                    f"scheduler {self.name}, turn {turn}: the chat template renders the new messages as a "
                    f"different history; the default token-level run can only append. Override run()"
                )
            marked = copy.deepcopy(before)
            marked[-1]["content"] = _SENTINEL
            tail = engine.render(marked, close_last=True).split(_SENTINEL, 1)[1]
            # the reply's own end-of-turn token already stands for the template's closing marker
            eos_text = engine.decode([eos], skip_special_tokens=False) if eos is not None else ""
            if ids and ids[-1] == eos and eos_text and tail.startswith(eos_text):
                tail = tail[len(eos_text):]
            return ids, mask, logprobs, engine.encode(tail + following[len(closed):])
        raise SchedulerError(
            f"scheduler {self.name}, turn {turn}: step() rewrote earlier messages; the default token-level "
            f"run only appends messages or extends the last assistant message. Return response_token_ids "
            f"from step, or override run() to return one record per turn"
        )


def _extends(before: Messages, after: Messages) -> bool:
    """Did ``step`` only append messages or extend the last assistant message (what the token-level run follows)?"""
    if len(after) > len(before):
        return after[: len(before)] == before
    return (len(after) == len(before) and after[:-1] == before[:-1] and after[-1]["role"] == "assistant"
            and after[-1]["content"].startswith(before[-1]["content"]))


def _record(messages: Messages, prompt_messages: Messages, prompt_ids: list[int], rounds: list[_Round],
            infos: dict[str, Any], finish_reason: str | None, explicit_mask: bool,
            versions: list[tuple[int, int]]) -> dict[str, Any]:
    """One result dict of the default run (ms-swift's RolloutOutput keys, plus rollstream's)."""
    return {
        "messages": messages,
        "prompt_messages": prompt_messages,
        "prompt_token_ids": prompt_ids,
        "response_token_ids": [r.token_ids for r in rounds],
        "response_loss_mask": [r.loss_mask for r in rounds],
        "rollout_logprobs": [r.logprobs for r in rounds],
        "rollout_infos": infos,
        "finish_reason": finish_reason,
        "explicit_loss_mask": explicit_mask,
        "policy_versions": (min(v[0] for v in versions), max(v[1] for v in versions)),
    }


@dataclass
class _Round:
    """One assistant message's tokens (a continued message stays one round)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]

    def extend(self, ids: list[int], mask: list[int], logprobs: list[float]) -> None:
        self.token_ids += ids
        self.loss_mask += mask
        self.logprobs += logprobs


def check_lengths(ids: list[int], mask: list[int], logprobs: list[float], scheduler: str, turn: int) -> None:
    if len(mask) != len(ids):
        raise SchedulerError(
            f"scheduler {scheduler}, turn {turn}: response_loss_mask has {len(mask)} entries for "
            f"{len(ids)} response_token_ids; give one mask value per token"
        )
    if len(logprobs) != sum(mask):
        raise SchedulerError(
            f"scheduler {scheduler}, turn {turn}: {len(logprobs)} rollout_logprobs for {sum(mask)} trained "
            f"tokens (loss mask 1); model tokens need one logprob each, inserted tokens (mask 0) none"
        )


def normalize_step_result(result: Any, scheduler: str, turn: int) -> dict[str, Any]:
    """``step``'s return in any of ms-swift's forms: a dict with ``infer_request``; the older bare request;
    or ``(request, extra_dict)``, whose extra dict becomes ``rollout_infos``."""
    if isinstance(result, RolloutInferRequest):
        return {"infer_request": result}
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], RolloutInferRequest):
        extra = result[1] or {}
        if not isinstance(extra, dict):
            raise SchedulerError(f"scheduler {scheduler}, turn {turn}: step() returned (request, {type(extra).__name__}); "
                                 f"the second item must be a dict")
        return {"infer_request": result[0], "rollout_infos": dict(extra)}
    if isinstance(result, dict) and isinstance(result.get("infer_request"), RolloutInferRequest):
        return result
    raise SchedulerError(
        f"scheduler {scheduler}, turn {turn}: step() returned {type(result).__name__}; return a dict with "
        f"'infer_request' (a RolloutInferRequest) and optionally response_token_ids, response_loss_mask, "
        f"rollout_logprobs, rollout_infos"
    )
