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

A continued message never carries an end-of-turn token into the next turn's context (ms-swift re-renders
the message, so its model never sees one there): when ``step``'s ``response_token_ids`` keep the reply's
EOS before the inserted text, it is dropped from the context and the trained ids alike.

The default ``run`` returns a list of result dicts (one trajectory record each; a list longer than one is
ms-swift's per-turn pattern, the records share the request id). Keys, as ms-swift's ``RolloutOutput``:
``messages``, ``response_token_ids`` / ``response_loss_mask`` / ``rollout_logprobs`` (per round, or flat),
``rollout_infos``, ``finish_reason``, and rollstream's ``prompt_token_ids`` and ``policy_versions``. An
overriding ``run`` may return those, or ms-swift ``RolloutOutput`` objects (``schedulers/results.py``).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from abc import ABC
from dataclasses import dataclass
from typing import Any

from pipeline.errors import UserError
from pipeline.stage import FatalStageError
from schedulers.protocol import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    Messages,
    RequestConfig,
    RolloutInferRequest,
    RolloutOutput,
    extract_logprobs,
)

LOSS_SCALES = ("default", "last_round")
_SENTINEL = "\u2063rollstream-sentinel\u2063"  # finds where the template puts an assistant message's content


class SchedulerError(RuntimeError):
    """A scheduler broke the protocol (bad return, mask/logprob mismatch, rewritten history)."""


class SchedulerFailed(SchedulerError, FatalStageError, UserError):
    """The scheduler raised the same error on ``run.max_consecutive_errors`` consecutive groups: the run
    stops with it (a retry or a resample would fail the same way, forever)."""


async def maybe_await(value: Any) -> Any:
    """``step``, ``check_finished``, ``run`` and the hooks may be sync or async."""
    return await value if inspect.isawaitable(value) else value


class RolloutScheduler(ABC):
    """ms-swift's ``RolloutScheduler`` (v3.8+): the engine, the tokenizer and a single-turn ``run``.

    Built by keyword once the engine exists, as ms-swift's rollout server builds it:
    ``cls(infer_engine=..., max_turns=..., tokenizer=... (where ``__init__`` declares it), gym settings)``.
    A v3.6/3.7-style subclass (``__init__(self, max_turns=None, *args, **kwargs)``) is built
    ``cls(max_turns=...)`` and gets ``infer_engine`` assigned after; one that passes ``max_turns`` on
    positionally (``super().__init__(max_turns, ...)``) still sets ``max_turns``.
    """

    def __init__(self, infer_engine: Any = None, max_turns: int | None = None, *args: Any, **kwargs: Any) -> None:
        if isinstance(infer_engine, int) and not isinstance(infer_engine, bool) and max_turns is None:
            # a v3.7-style subclass's super().__init__(max_turns, ...): an int is no engine
            infer_engine, max_turns = None, infer_engine
        self.infer_engine: Any = infer_engine
        self._tokenizer = kwargs.get("tokenizer")
        self.max_turns = max_turns

    @property
    def engine(self) -> Any:
        return self.infer_engine

    @property
    def tokenizer(self) -> Any:
        """The tokenizer given to the constructor, else the engine's."""
        if self._tokenizer is not None:
            return self._tokenizer
        return getattr(self.__dict__.get("infer_engine"), "tokenizer", None)

    @property
    def name(self) -> str:
        return type(self).__name__

    def __getattr__(self, key: str) -> Any:
        # As ms-swift: what the scheduler lacks, its engine may have (self.encode, self.render, ...).
        # Only reached when normal lookup failed; dunders and the scheduler's own fields never forward.
        engine = self.__dict__.get("infer_engine")
        if not key.startswith("__") and key not in ("infer_engine", "_tokenizer", "max_turns") and engine is not None:
            try:
                return getattr(engine, key)
            except AttributeError:
                pass
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute {key!r}"
            + (f", nor has its infer_engine ({type(engine).__name__})" if engine is not None else "")
        )

    @staticmethod
    def _extract_logprobs_from_choice(response_choice: ChatCompletionResponseChoice) -> list[float]:
        """The reply's sampled-token logprobs (ms-swift v3.11+): ``[]`` when the choice has none."""
        return extract_logprobs(response_choice)

    async def async_infer(self, infer_requests: list[RolloutInferRequest | dict[str, Any]],
                          request_config: RequestConfig, *, use_tqdm: bool | None = None,
                          **kwargs: Any) -> list[Any]:
        """``run`` on each request concurrently (a dict becomes a ``RolloutInferRequest``); the results
        flattened into one list, as ms-swift's ``async_infer``."""
        if request_config is not None and request_config.n != 1:
            raise SchedulerError(f"{self.name}.async_infer: request_config.n = {request_config.n}; it must be 1")
        requests = [RolloutInferRequest(**r) if isinstance(r, dict) else r for r in infer_requests]
        results = await asyncio.gather(*(maybe_await(self.run(r, request_config, **kwargs)) for r in requests))
        flat: list[Any] = []
        for result in results:
            flat.extend(result if isinstance(result, list) else [result])
        return flat

    async def run(self, infer_request: RolloutInferRequest, request_config: RequestConfig | None = None,
                  **kwargs: Any) -> Any:
        """One reply (ms-swift's single-turn ``RolloutScheduler.run``)."""
        prompt_ids = self.infer_engine.first_prompt_ids(infer_request.messages)
        response = await self.infer_engine.infer_async(infer_request, request_config, prompt_token_ids=prompt_ids,
                                                       **kwargs)
        token_ids = list(response.choices[0].token_ids or [])
        return RolloutOutput(response=response, messages=infer_request.messages, response_token_ids=[token_ids],
                             response_loss_mask=[[1] * len(token_ids)], rollout_infos={"num_turns": 1})


class MultiTurnScheduler(RolloutScheduler):
    """Subclass it and implement ``step`` (and optionally ``check_finished``), or override ``run``.

    ``infer_engine`` is rollstream's ``schedulers.engine.InferEngine`` (``infer_async``, ``tokenizer``,
    ``render``, ``encode``, ``decode``); ``tokenizer`` is the one given to the constructor, else the engine's.
    """

    # A step() (or a gym context manager) that rewrites earlier messages is an error of the token-level run,
    # unless this is true: then the request's record ends there and a new one starts from the new history.
    split_on_rewrite = False

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
            gap = 0 if request.messages[-1]["role"] == "assistant" else len(inserted)  # a continuation's are its own
            self._add(rounds, continues, ids + inserted, mask + [0] * len(inserted), logprobs, turn, gap)
            turn += 1
        return [*records, _record(request.messages, prompt_messages, prompt_ids, rounds, {**infos, "num_turns": turn},
                                  choice.finish_reason, explicit_mask, versions)]

    # ------------------------------------------------------------ helpers of the default run

    def _add(self, rounds: list[_Round], continues: bool, ids: list[int], mask: list[int],
             logprobs: list[float], turn: int, gap: int = 0) -> None:
        """``gap``: how many of the last ``ids`` are the template's tokens after the message (a new turn's)."""
        check_lengths(ids, mask, logprobs, self.name, turn)
        if continues and rounds:  # a continued assistant message stays one round (ms-swift)
            rounds[-1].extend(ids, mask, logprobs)
        else:
            rounds.append(_Round(list(ids), list(mask), list(logprobs)))
        rounds[-1].message_len = len(rounds[-1].token_ids) - gap

    def _next_turn_tokens(self, before: Messages, after: Messages, ids: list[int], mask: list[int],
                          logprobs: list[float], turn: int, *, given_ids: bool) -> tuple:
        """This turn's tokens plus the inserted ones (mask 0) up to the next generation, from how ``step``
        changed the messages: extended the last assistant message, or appended messages."""
        engine = self.infer_engine
        eos = engine.eos_token_id
        if len(after) == len(before) and after[:-1] == before[:-1] and after[-1]["role"] == "assistant":
            if given_ids:  # the scheduler's response_token_ids already hold the whole continued message
                # ...but the message goes on: an end-of-turn token inside it (vLLM's token_ids keep the reply's
                # EOS, and ms-swift's schedulers append after it) would sit inside the next turn's context,
                # where ms-swift's re-rendered prompt has none. Dropped from the trained ids too, so the
                # learner sees what the engine saw.
                return (*drop_tokens(ids, mask, logprobs, engine.end_of_turn_ids), [])
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
            return ids, mask, logprobs, template_gap(engine, before, after, ids, self.name, turn)
        raise SchedulerError(
            f"scheduler {self.name}, turn {turn}: step() rewrote earlier messages; the default token-level "
            f"run only appends messages or extends the last assistant message. Return response_token_ids "
            f"from step, or override run() to return one record per turn"
        )


def template_gap(engine: Any, before: Messages, after: Messages, ids: list[int], scheduler: str,
                 turn: int) -> list[int]:
    """The chat template's tokens from the end of ``before``'s last (assistant) message, whose reply tokens
    are ``ids``, to the generation prompt after ``after`` (which appends messages to ``before``): the turn's
    closing marker, the inserted messages, the next assistant header. All mask 0."""
    closed = engine.render(before, close_last=True)
    following = engine.render(after)
    if not following.startswith(closed):
        raise SchedulerError(
            f"scheduler {scheduler}, turn {turn}: the chat template renders the new messages as a "
            f"different history; the default token-level run can only append. Override run()"
        )
    marked = copy.deepcopy(before)
    marked[-1]["content"] = _SENTINEL
    tail = engine.render(marked, close_last=True).split(_SENTINEL, 1)[1]
    # the reply's own end-of-turn token already stands for the template's closing marker
    eos = engine.eos_token_id
    eos_text = engine.decode([eos], skip_special_tokens=False) if eos is not None else ""
    if ids and ids[-1] == eos and eos_text and tail.startswith(eos_text):
        tail = tail[len(eos_text):]
    return engine.encode(tail + following[len(closed):])


def drop_tokens(ids: list[int], mask: list[int], logprobs: list[float],
                drop: frozenset[int]) -> tuple[list[int], list[int], list[float]]:
    """``ids`` without the tokens in ``drop``, with their mask entries and (where mask is 1) logprobs."""
    if not drop.intersection(ids):
        return ids, mask, logprobs
    kept_ids, kept_mask, kept_logprobs, lp = [], [], [], iter(logprobs)
    for token, m in zip(ids, mask):
        value = next(lp, None) if m else None
        if token in drop:
            continue
        kept_ids.append(token)
        kept_mask.append(m)
        if m and value is not None:
            kept_logprobs.append(value)
    return kept_ids, kept_mask, kept_logprobs


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
        "response_message_lengths": [r.message_len for r in rounds],
        "policy_versions": (min(v[0] for v in versions), max(v[1] for v in versions)),
    }


@dataclass
class _Round:
    """One assistant message's tokens (a continued message stays one round)."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    message_len: int = 0  # how many leading token_ids are the assistant message's (the rest: the template's gap)

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
