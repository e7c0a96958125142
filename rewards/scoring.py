"""Reward scoring: score requests with the configured reward functions (and reward model) and their weights.

The core the reward stage (``stages/reward.py``) shells and evaluation calls directly: ``RewardScorer``.

What a reward receives
----------------------
A reward is a callable ``f(completions, **kwargs) -> list[float | None]``, sync or async, called once per
group (a batch of its G requests). ``completions`` goes **by keyword** when ``f`` declares a parameter named
``completions``, or its first parameter is another argument it is given or keyword-only (so TRL's
``def f(prompts, completions, completion_ids, **kw)`` and ``def f(completion_ids, **kw)`` work), else
positionally (ms-swift's ``reward_func(completions, **reward_kwargs)``). Every other argument is a keyword;
the list-valued ones hold one entry per request, in the order of ``completions``:

- ``completions``: the text of the request's last assistant message (for a continuation scheduler: the
  whole continued message, inserted tips included), as ms-swift passes it;
- ``prompts``: the prompt (the content of its last message: the question), TRL's standard format;
- ``messages``: the final conversation: the scheduler's (system, user, assistant 1, inserted user/tool
  message, assistant 2, ...: ``Trajectory.conversation``), else the prompt messages + the completion;
- ``completion_ids``: TRL's ``completion_ids``, flat ``list[int]``: the token ids of ``completions[i]``
  (the last assistant message's, EOS included; what ``response_token_ids[i]`` holds single-turn and
  ``response_token_ids[i][-1]`` holds with a scheduler);
- ``response_token_ids``: ms-swift's: without a scheduler the flat sampled ids (``list[int]``, EOS
  included); with a scheduler ``list[list[int]]``, one list per assistant message after the prompt (a
  continued message is one list, its inserted tokens included; the tokens of an inserted user/tool message
  belong to no list), sliced by the rollout's ``Trajectory.message_spans`` (a record written before that
  field: rebuilt from the loss mask, one list holding every completion token where the mask does not tell
  the messages apart);
- ``finish_reason`` (``stop`` | ``length`` | ``abort``), ``is_truncated`` (``finish_reason == "length"``);
- ``trainer_state``: one ``TrainerState`` (``global_step``: optimizer steps of the newest weights the stage
  saw; ``max_steps``: the run's planned optimizer steps, 0 when unknown; ``epoch``: the requests' epoch, from
  their ``prompt_id`` ``e<epoch>:<row>``; ``num_train_epochs``), not a list;
- ``trajectory_inputs``: ms-swift's dict ``{request_id: [row, ...]}`` (not a list), one row per record of the
  request (a scheduler may split one into several), in turn order; a row holds the dataset columns,
  ``messages``, ``response_token_ids``, ``rollout_infos``, ``finish_reason``, ``is_truncated``, ``prompt_id``,
  ``request_id``, and rollstream's ``record_id``, ``turn``, ``completion``, ``completion_ids``;
- ``rollout_infos`` (and its ms-swift 3.7 name ``multi_turn_infos``): the scheduler's extra info of the
  request's last record; ``trajectory_infos``: a gym rollout's per-step rewards and infos
  (``rollout_infos["trajectory_infos"]``, None for other rollouts);
- ``prompt_id`` (``e<epoch>:<row>``), ``request_id`` (``<prompt_id>/<attempt>/<i>``);
- ``environments`` (TRL's, with ``rollout.environment_factory`` only): one read-only view per request of its
  episode's environment as the episode ended: its plain-data attributes and ``get_reward()``
  (``rewards/environments.py``); an environment class that defines ``get_reward`` is also a reward of its
  own, named after the class, weight 1 (TRL);
- every dataset column (``solution``, ``verification_info``, ...: a column missing in some rows is None
  there; a column named like one of the arguments above is shadowed by it);
- ``log_extra(column, values)`` / ``log_metric(name, value)`` (TRL): ``values`` (one per completion) become
  the column ``column`` of completions.jsonl; ``value`` is averaged over the step's groups into
  metrics.jsonl under ``name`` (under ``reward_metrics/<name>`` where the learner already writes ``name``).

Conventions: ms-swift passes strings, TRL's conversational format passes messages. A reward marked
``@conversational`` (``f.reward_format = "conversational"``) gets ``completions[i]`` = the messages after the
prompt (``[{"role": "assistant", "content": ...}]`` single-turn; a scheduler's inserted user/tool messages and
later replies follow) and ``prompts[i]`` = the prompt messages, and then ``completion_ids[i]`` = every
completion token of the request's last record. Unmarked rewards get strings (ms-swift's, and TRL's standard
format).

Total = sum of weight * score over the functions that returned a number: ``None`` and NaN mean "not
applicable" and are left out (NaN-aware, as TRL). A request is scored once and its total broadcast to
all its records.

Failure policy: a call that raises or exceeds ``reward.timeout_s`` is retried ``reward.max_retries``
times, then ``reward.on_error`` decides (``zero``: that function scores 0; ``drop_group``: the records
carry ``failed`` and the advantage stage drops the group and asks for a resample; ``dead_letter``:
``RewardFailed`` is raised). A request on which every function returned None/NaN fails the same way.
Never silent: a function's first failure is printed on stderr (the console of ``rollstream train``) with
its name and the exception; each failure is logged and carried in ``ScoredTrajectory.reward_errors``
(metrics.jsonl: ``rewards/<name>/failures``). Never endless: the same error (exception type) from one function
on ``run.max_consecutive_errors`` consecutive groups raises ``RewardFunctionError``, which stops the run.
Sync functions run in a pool (``reward.executor``: daemon threads, or processes that a timeout kills), so none
blocks the event loop and a hung one never keeps the process alive after the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import itertools
import math
import numbers
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec

from config import Config
from pipeline import log, metrics
from pipeline.errors import UserError
from pipeline.plugins import load_object, load_plugins
from pipeline.records import ScoredTrajectory, Trajectory
from pipeline.stage import ErrorStreak, FatalStageError
from rewards import UnknownRewardError, get_reward
from rewards.environments import environment_views
from rewards.models import build_reward_model
from rewards.registry import ModelDirSource

REWARD_MODEL = "reward_model"  # the key of a reward model's score in ScoredTrajectory.rewards
PROCESS_START_GRACE_S = 30.0  # a spawned pool process imports torch-free rollstream in ~1-3 s; loaded: more
STANDARD, CONVERSATIONAL = "standard", "conversational"  # TRL's names of the two dataset formats
# completions.jsonl columns the learner writes itself: a log_extra column may not take their name.
COMPLETIONS_COLUMNS = frozenset({
    "step", "generation_batch", "prompt_id", "attempt", "request_id", "policy_version", "max_policy_version",
    "trained_at_version", "prompt", "images", "completion", "messages", "rewards", "reward", "advantage",
    "trajectory_infos", "reward_errors",
})


class RewardFailed(RuntimeError):
    """Scoring failed under ``on_error = dead_letter``: the worker dead-letters the record with this reason.
    ``record_id``: the first record of the request that failed."""

    def __init__(self, reason: str, record_id: str = "") -> None:
        super().__init__(reason)
        self.record_id = record_id


class RewardFunctionError(UserError, FatalStageError):
    """One reward function failed with the same error on ``run.max_consecutive_errors`` consecutive groups:
    the run stops with it (exit code 2) instead of scoring 0 or resampling forever."""


class _CallFailed(Exception):
    """One reward function failed after its retries (the reason is the message; ``kind`` names the error:
    the exception's type, or ``timeout``)."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.kind = kind


def conversational(func: Any) -> Any:
    """Mark a reward written for TRL's conversational format: it gets ``completions[i]`` as messages
    (``completions[i][0]["content"]``) and ``prompts[i]`` as the prompt messages. Returns ``func``."""
    func.reward_format = CONVERSATIONAL
    return func


def reward_format(name: str, func: Any) -> str:
    """The format a reward was written for: ``func.reward_format``, default ``standard`` (strings)."""
    value = getattr(func, "reward_format", STANDARD)
    if value not in (STANDARD, CONVERSATIONAL):
        raise ValueError(
            f"reward {name!r}: reward_format = {value!r}; use {STANDARD!r} (strings, ms-swift's and TRL's standard "
            f"format) or {CONVERSATIONAL!r} (TRL's message lists), or decorate it with rewards.scoring.conversational"
        )
    return value


def takes_completions_by_keyword(func: Any, names: Iterable[str] = ()) -> bool:
    """Does ``func`` take ``completions`` by keyword (TRL passes every argument by keyword) rather than first,
    positionally (ms-swift's ``reward_func(completions, **kwargs)``)? By keyword when it declares a
    ``completions`` parameter, or when its first parameter is another argument it is given (``names``: TRL's
    ``def f(completion_ids, **kwargs)``) or is keyword-only (``def f(**kwargs)``)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: as ms-swift calls it
        return False
    if any(p.name == "completions" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in params):
        return True
    if not params:
        return True
    first = params[0]
    positional = first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD, first.VAR_POSITIONAL)
    return not positional or (first.kind is not first.VAR_POSITIONAL and first.name in set(names))


@dataclass(slots=True)
class TrainerState:
    """The parts of transformers' ``TrainerState`` a reward reads (ms-swift and TRL pass ``trainer_state``)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 1


_EPOCH = re.compile(r"^e(\d+):")


def epoch_of(prompt_id: str) -> int:
    """The epoch of a feeder prompt id ``e<epoch>:<row>`` (0 for any other id)."""
    found = _EPOCH.match(prompt_id)
    return int(found.group(1)) if found else 0


class RewardLog:
    """What one reward call logged through TRL's ``log_extra`` / ``log_metric``."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: Any) -> None:
        """TRL's ``log_extra(column, values)``: one value per completion, a column of completions.jsonl."""
        values = list(values)
        if not isinstance(column, str) or column in COMPLETIONS_COLUMNS:
            raise ValueError(
                f"reward {self.name!r}: log_extra column {column!r} is not a str or is one completions.jsonl "
                f"already has ({', '.join(sorted(COMPLETIONS_COLUMNS))}); choose another name"
            )
        if len(values) != self.size:
            raise ValueError(f"reward {self.name!r}: log_extra({column!r}) got {len(values)} values for {self.size} completions")
        # plain data only: the values travel in records (anything else as its str)
        self.extra[column] = msgspec.to_builtins(values, enc_hook=str, str_keys=True)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric(name, value)``: averaged over the step's groups into metrics.jsonl."""
        if not isinstance(name, str) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ValueError(f"reward {self.name!r}: log_metric({name!r}, {value!r}) needs a str name and a finite number")
        self.metrics.setdefault(name, []).append(float(value))

    def merge(self, extra: dict[str, list[Any]], logged: dict[str, list[float]]) -> None:
        self.extra.update(extra)
        for key, values in logged.items():
            self.metrics.setdefault(key, []).extend(values)


def is_missing(value: Any) -> bool:
    """None or NaN: "not applicable" (TRL's nansum treats both alike)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def weighted_total(scores: dict[str, float | None], weights: dict[str, float]) -> float:
    """Pure: sum of weight * score over the functions that returned a number (None / NaN skipped)."""
    return sum(weights[name] * float(value) for name, value in scores.items() if value is not None and not is_missing(value))


def conversation(t: Trajectory) -> list[dict[str, Any]]:
    """The record's final conversation: the scheduler's, else the prompt messages + the completion."""
    if t.conversation:
        return list(t.conversation)
    return [*t.messages, {"role": "assistant", "content": t.completion}]


def completion_messages(t: Trajectory) -> list[dict[str, Any]]:
    """The messages after the prompt (TRL's conversational ``completions[i]``)."""
    full = conversation(t)
    if t.messages and full[: len(t.messages)] == list(t.messages):
        return full[len(t.messages):]
    return [{"role": "assistant", "content": t.completion}]  # a history rewritten since the prompt


def _sampled_runs(mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each maximal run of trained (mask 1) tokens."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def response_token_ids(t: Trajectory) -> list[int] | list[list[int]]:
    """ms-swift's ``response_token_ids`` of one record (see the module docstring)."""
    ids = t.completion_token_ids().tolist()
    if not t.conversation:
        return ids  # no scheduler: vLLM's flat choice.token_ids
    if t.message_spans:  # the rollout's own boundaries of each assistant message
        return [ids[start:end] for start, end in t.message_spans]
    # A record written before ``message_spans``: rebuilt from the loss mask, where it tells the messages apart.
    replies = sum(1 for m in completion_messages(t) if m.get("role") == "assistant")
    runs = _sampled_runs(t.completion_loss_mask().tolist())
    if replies > 1 and len(runs) == replies:
        # one list per reply, to its last sampled token: the template and inserted message after it are not its
        return [ids[start:end] for start, end in runs]
    return [ids]


def last_reply_ids(t: Trajectory) -> list[int]:
    """The token ids of the record's last assistant message (TRL's ``completion_ids`` of ``completions``)."""
    ids = response_token_ids(t)
    if ids and isinstance(ids[0], list):
        return cast("list[int]", ids[-1])
    return cast("list[int]", ids)


def record_input(t: Trajectory) -> dict[str, Any]:
    """One record as ms-swift's reward row (``trajectory_inputs`` rows), plus rollstream's record fields."""
    return {
        **t.data_dict,
        "messages": conversation(t),
        "response_token_ids": response_token_ids(t),
        "rollout_infos": t.rollout_infos,
        "finish_reason": t.finish_reason,
        "is_truncated": t.is_truncated,
        "prompt_id": t.prompt_id,
        "request_id": t.request_id,
        "record_id": t.record_id,
        "turn": t.turn,
        "completion": t.completion,
        "completion_ids": t.completion_token_ids().tolist(),
    }


def reward_kwargs(
    requests: list[list[Trajectory]], trainer_state: TrainerState | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Pure: ``(completions, kwargs)`` of one reward call over ``requests`` (each: its records, by turn), in
    the standard (string) format; ``conversational_inputs`` gives the other format's ``completions``/``prompts``.
    ``log_extra``/``log_metric`` are added per call. A request is represented by its last record."""
    lasts = [records[-1] for records in requests]
    columns = list(dict.fromkeys(key for t in lasts for key in t.data_dict))
    kwargs: dict[str, Any] = {key: [t.data_dict.get(key) for t in lasts] for key in columns}
    kwargs.update(
        prompts=[t.messages[-1]["content"] if t.messages else "" for t in lasts],
        messages=[conversation(t) for t in lasts],
        completion_ids=[last_reply_ids(t) for t in lasts],
        response_token_ids=[response_token_ids(t) for t in lasts],
        finish_reason=[t.finish_reason for t in lasts],
        is_truncated=[t.is_truncated for t in lasts],
        trainer_state=trainer_state if trainer_state is not None else TrainerState(epoch=float(epoch_of(lasts[0].prompt_id))),
        trajectory_inputs={records[-1].request_id: [record_input(r) for r in records] for records in requests},
        rollout_infos=[t.rollout_infos for t in lasts],
        multi_turn_infos=[t.rollout_infos for t in lasts],
        trajectory_infos=[t.rollout_infos.get("trajectory_infos") for t in lasts],
        prompt_id=[t.prompt_id for t in lasts],
        request_id=[t.request_id for t in lasts],
    )
    snapshots = [t.rollout_infos.get("environment") for t in lasts]
    if any(s is not None for s in snapshots):  # TRL's environment_factory: the episodes' environments
        kwargs["environments"] = environment_views(snapshots)
    return [t.completion for t in lasts], kwargs


def rollout_rewards(requests: list[list[Trajectory]]) -> dict[str, list[float | None]]:
    """Rewards the rollout itself scored (``rollout_infos["rewards"]``, weighted by ``rollout_infos
    ["reward_weights"]``, else 1): a TRL environment's ``get_reward()`` (named after its class), an agent
    program's return value ("agent"), a verifiers trace's named rewards. None for a request without one."""
    given = [records[-1].rollout_infos.get("rewards") or {} for records in requests]
    names = list(dict.fromkeys(name for rewards in given for name in rewards))
    return {name: [rewards.get(name) for rewards in given] for name in names}


def check_environment_reward(cfg: Config, funcs: Mapping[str, Any]) -> None:
    """With no reward function, an environment_factory's class must own the reward (``get_reward``)."""
    spec = cfg.rollout.environment_factory
    if funcs or not spec or ":" not in spec:
        return
    factory = load_object(spec, "rollout.environment_factory")  # a PluginError (a UserError) names the fix
    if isinstance(factory, type) and not callable(getattr(factory, "get_reward", None)):
        raise UserError(
            f"no reward source: reward.reward_funcs is empty and {factory.__name__} (rollout.environment_factory) "
            f"defines no get_reward(); add a reward function (one that reads environments=...) or get_reward"
        )


def conversational_inputs(requests: list[list[Trajectory]]) -> tuple[list[Any], dict[str, Any]]:
    """TRL's conversational format: ``completions`` as the messages after the prompt, and the kwargs that
    change with it (``prompts`` as message lists, ``completion_ids`` as every completion token)."""
    lasts = [records[-1] for records in requests]
    return [completion_messages(t) for t in lasts], {
        "prompts": [list(t.messages) for t in lasts],
        "completion_ids": [t.completion_token_ids().tolist() for t in lasts],
    }


def check_result(name: str, result: Any, expected: int) -> list[float | None]:
    """A reward's return value as floats/None, or a TypeError/ValueError naming the function.

    Any iterable of numbers is accepted (a list, a tuple, a numpy array, a generator); at most
    ``expected + 1`` items are read, so an endless generator is a length error, not a hang. A value must be
    a real number (numpy scalars included) or None/NaN ("not applicable"); +-inf is an error: one infinite
    reward would turn every advantage of its group into NaN."""
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Iterable):
        raise TypeError(f"reward {name!r} returned {type(result).__name__}, expected a list of float | None")
    values = list(itertools.islice(result, expected + 1))
    if len(values) != expected:
        got = f"more than {expected}" if len(values) > expected else str(len(values))
        raise ValueError(f"reward {name!r} returned {got} values for {expected} completions")
    out: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        if not isinstance(value, numbers.Real):  # bool, int, float, Fraction and numpy scalars are Real
            raise TypeError(f"reward {name!r} returned {value!r} at {i}; expected float | None")
        try:
            number = float(value)
        except OverflowError:  # an int beyond float's range
            number = math.inf
        if math.isnan(number):
            out.append(None)
        elif math.isinf(number):
            raise ValueError(
                f"reward {name!r} returned {value!r} at {i}; expected a finite float, or None/NaN"
            )
        else:
            out.append(number)
    return out


# ---------------------------------------------------------------- process pool (reward.executor = processes)

_process_config: Config | None = None
_process_model_dir: ModelDirSource | None = None


def _process_init(config: Config, model_dir: str | None = None) -> None:
    """A pool process: load the run's plugins, so ``get_reward`` finds plugin rewards by name, and build
    the rewards now: their imports (math-verify/sympy: ~1 s) must not count against a call's timeout.
    ``model_dir``: the run's model directory, as the parent resolved it (for a class declaring ``tokenizer``)."""
    global _process_config, _process_model_dir
    _process_config = config
    _process_model_dir = (lambda: Path(model_dir)) if model_dir is not None else None
    load_plugins(config.run.external_plugins)
    for name in config.reward.reward_funcs:
        try:
            get_reward(name, config, _process_model_dir)
        except UnknownRewardError:
            pass  # registered only in the parent process; the call itself reports it, with the reason


def _declares_tokenizer(func: Any) -> bool:
    """Was ``func`` built from a reward class whose ``__init__`` takes ``tokenizer``?"""
    if inspect.isroutine(func):
        return False
    try:
        return "tokenizer" in inspect.signature(type(func)).parameters
    except (TypeError, ValueError):  # a builtin or C type without a signature
        return False


def _process_ready() -> int:
    return 0


def _call_in_process(name: str, completions: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], Any, Any]:
    """One call in a pool process, with its own log_extra/log_metric: what they logged comes back with the result."""
    func = get_reward(name, _process_config, _process_model_dir)
    logged = RewardLog(name, len(completions))
    result = invoke(func, completions, {**kwargs, "log_extra": logged.log_extra, "log_metric": logged.log_metric})
    if inspect.isawaitable(result):
        awaitable = result

        async def wait() -> Any:
            return await awaitable

        result = asyncio.run(wait())
    return list(result), logged.extra, logged.metrics


def _is_async(func: Any) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def invoke(func: Any, completions: list[Any], kwargs: dict[str, Any]) -> Any:
    """Call a reward as ms-swift or TRL would: ``completions`` by keyword where TRL's signature asks for it
    (``takes_completions_by_keyword``), else first, positionally."""
    if takes_completions_by_keyword(func, kwargs):
        return func(completions=completions, **kwargs)
    return func(completions, **kwargs)


class DaemonThreadPool(concurrent.futures.Executor):
    """A fixed pool of daemon threads for sync rewards. A reward hung in one never keeps the process alive
    after the run: ``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) workers at interpreter
    exit, so one ``time.sleep(3600)`` there held a finished run for an hour."""

    def __init__(self, workers: int, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():  # cancelled while queued (its call timed out)
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)

    def shutdown(self, wait: bool = False, *, cancel_futures: bool = True) -> None:
        """Stop the idle threads; a hung call's thread is abandoned (a daemon: it dies with the process)."""
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for thread in self._threads:
                thread.join()


# What a group whose reward function failed gets, by reward.on_error (the first failure's printed line says it).
OUTCOMES = {"zero": "gets 0 from it", "drop_group": "is dropped and resampled", "dead_letter": "is dead-lettered"}


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RewardScorer:
    """The configured reward functions (``reward.reward_funcs``, then ``reward.reward_model``) with their
    weights, their executor pool and failure policy. ``start`` before the first call, ``close`` after.

    ``max_steps``: the run's planned optimizer steps (``trainer_state.max_steps``; 0 when unknown);
    ``global_step`` follows the newest weights (the stage sets it); ``announce`` prints a function's first
    failure (default: stderr); ``model_dir``: how to find the run's model directory, for a reward class that
    declares ``tokenizer`` (resolved here, once, and handed to the process pool's processes)."""

    def __init__(self, cfg: Config, max_steps: int = 0, announce: Callable[[str], None] = _to_stderr,
                 model_dir: ModelDirSource | None = None) -> None:
        self.cfg = cfg
        r = cfg.reward
        self.model_dir = model_dir
        self.funcs: dict[str, Any] = {name: get_reward(name, cfg, model_dir) for name in r.reward_funcs}
        if r.reward_model is not None:
            self.funcs[REWARD_MODEL] = build_reward_model(r.reward_model, cfg)
        check_environment_reward(cfg, self.funcs)
        self.formats = {name: reward_format(name, func) for name, func in self.funcs.items()}
        weights = r.reward_weights if r.reward_weights is not None else [1.0] * len(self.funcs)
        self.weights = dict(zip(self.funcs, weights))
        self.max_steps = cfg.run.max_steps or max_steps  # run.max_steps wins, as in the learner
        self.global_step = 0
        self.announce = announce
        self._threads: DaemonThreadPool | None = None
        self._processes: Any = None
        # function -> its streak of the same error kind (the exception's type, or timeout) on consecutive groups
        self._streaks: dict[str, ErrorStreak] = {}
        self._announced: set[str] = set()
        self.labels: tuple[str, str, str] = (cfg.run.name, "reward", "-")  # (run, stage, worker) of the metrics
        self.log = log.get(stage="reward")

    async def start(self, labels: tuple[str, str, str]) -> None:
        """Export the metrics under ``labels`` and start the process pool (reward.executor = processes)."""
        self.labels = labels
        self.log = log.get(run=labels[0], stage=labels[1], worker=labels[2])
        for name in self.funcs:  # exported at 0 from the start, so error-rate alerts see a series
            for counter in (metrics.REWARD_CALLS, metrics.REWARD_ERRORS, metrics.REWARD_TIMEOUTS):
                counter.labels(*self.labels, name)
        if self.cfg.reward.executor == "processes":
            # Start the pool now: a process's start-up must not count against the first call's timeout.
            pool = self._process_pool()
            ready = [pool.schedule(_process_ready) for _ in range(self.cfg.reward.executor_workers)]
            await asyncio.gather(*(asyncio.wrap_future(f) for f in ready))

    def _thread_pool(self) -> DaemonThreadPool:
        if self._threads is None:
            self._threads = DaemonThreadPool(self.cfg.reward.executor_workers, "reward")
        return self._threads

    def _process_pool(self) -> Any:
        if self._processes is None:
            import multiprocessing

            import pebble

            # spawn, not fork: this process has threads (engine, pools) that a fork would copy mid-state.
            self._processes = pebble.ProcessPool(
                max_workers=self.cfg.reward.executor_workers,
                initializer=_process_init,
                initargs=(self.cfg, self._resolved_model_dir()),
                context=multiprocessing.get_context("spawn"),
            )
        return self._processes

    def _resolved_model_dir(self) -> str | None:
        """The run's model directory, for the pool's processes: only when a reward class declares ``tokenizer``
        (a pool process cannot resolve a built-in model name such as ``tiny`` itself)."""
        if self.model_dir is None or not any(_declares_tokenizer(func) for func in self.funcs.values()):
            return None
        return str(self.model_dir())

    async def close(self) -> None:
        # A hung sync reward cannot be interrupted in a thread: do not wait for it (its thread is a daemon).
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self._processes is not None:
            self._processes.stop()
            self._processes.join(timeout=10)
            self._processes = None
        for func in self.funcs.values():
            aclose = getattr(func, "aclose", None)
            if aclose is not None:
                await aclose()

    def trainer_state(self, requests: list[list[Trajectory]]) -> TrainerState:
        return TrainerState(
            global_step=self.global_step,
            max_steps=self.max_steps,
            epoch=float(epoch_of(requests[0][-1].prompt_id)),
            num_train_epochs=self.cfg.data.num_train_epochs,
        )

    async def score_requests(self, requests: list[list[Trajectory]], attribute: bool = True) -> list[ScoredTrajectory]:
        """Score each request once (every function in one call over all requests) and broadcast the
        total to its records, in order. Raises RewardFailed under on_error = dead_letter, and
        RewardFunctionError when a function failed the same way on run.max_consecutive_errors groups.
        ``attribute=False``: a batch that will be scored again group by group if it fails, so its failure is
        not yet charged to its groups (no streak, no failure count: the retries say which group failed)."""
        on_error = self.cfg.reward.on_error
        completions, kwargs = reward_kwargs(requests, self.trainer_state(requests))
        formats = set(self.formats.values())
        conversational_args = conversational_inputs(requests) if CONVERSATIONAL in formats else None
        per_func: dict[str, list[float | None]] = {}
        failures: list[str] = []
        errors: dict[str, str] = {}
        logged = RewardLog("", len(requests))
        for name, func in self.funcs.items():
            if self.formats[name] == CONVERSATIONAL:
                assert conversational_args is not None  # built when a function is conversational
                messages, changed = conversational_args
                args = (messages, {**kwargs, **changed})
            else:
                args = (completions, kwargs)
            try:
                per_func[name], extra, call_metrics = await self._call(name, func, *args)
            except _CallFailed as exc:
                groups = list(dict.fromkeys(f"{r[0].prompt_id}/{r[0].attempt}" for r in requests))
                if attribute:  # every group of the call failed
                    self._failed(name, exc, on_error, group_ids=groups)
                else:
                    self._failed_tentatively(name, exc, on_error, len(groups))
                failures.append(str(exc))
                errors[name] = str(exc)
                # zero: the failed function scores 0; otherwise the value is never used.
                per_func[name] = [0.0] * len(requests)
                continue
            if name in self._streaks:
                self._streaks[name].succeeded()
            logged.merge(extra, call_metrics)
        for name, values in rollout_rewards(requests).items():
            per_func.setdefault(name, values)  # a reward function of the same name wins
        group_metrics = {key: sum(values) / len(values) for key, values in logged.metrics.items()}
        out: list[ScoredTrajectory] = []
        for i, records in enumerate(requests):
            scores = {name: values[i] for name, values in per_func.items()}
            reasons = list(failures)
            if all(is_missing(v) for v in scores.values()):
                reasons.append("every reward function returned None/NaN")
            failed = ""
            if reasons:
                if attribute:
                    metrics.REWARD_FAILED.labels(*self.labels, on_error).inc(len(records))
                if on_error == "dead_letter":
                    raise RewardFailed("; ".join(reasons), records[0].record_id)
                if on_error == "drop_group":
                    failed = "; ".join(reasons)
            # the rollout's own rewards: the weights it gave (a verifiers trace's), else 1 (TRL's environments)
            given = records[-1].rollout_infos.get("reward_weights") or {}
            total = weighted_total(scores, {**dict.fromkeys(scores, 1.0), **given, **self.weights})
            extra = {column: values[i] for column, values in logged.extra.items()}
            out += [
                ScoredTrajectory(
                    trajectory=t, rewards=scores, reward=total, failed=failed,
                    reward_errors=errors, logged_extra=extra, logged_metrics=group_metrics,
                )
                for t in records
            ]
        return out

    def _failed_tentatively(self, name: str, exc: _CallFailed, on_error: str, groups: int) -> None:
        """A call over a batch of groups failed; each group is scored again on its own, and a group that fails
        again is charged there (``_failed``). Not silent even when every group then succeeds: logged, and
        printed if it is the function's first failure."""
        self.log.warning("reward failed on a batch, scoring its groups one by one", function=name, error=str(exc),
                         on_error=on_error, groups=groups)
        self._print_first(name, f"{exc} on a batch of {groups} groups; each group is scored again on its own, "
                                f"and a group that fails there {OUTCOMES[on_error]}", on_error)

    def _failed(self, name: str, exc: _CallFailed, on_error: str, group_ids: list[str]) -> None:
        """Never silent, never endless: log every failure, print a function's first, and stop the run when
        it fails the same way on run.max_consecutive_errors consecutive groups."""
        streak = self._streaks.setdefault(
            name, ErrorStreak(self.cfg.run.max_consecutive_errors,
                              key=lambda e: e.kind if isinstance(e, _CallFailed) else type(e).__name__)
        )
        # a list, not a generator: every group of the batch is counted, not only those before the first True
        stop = any([streak.failed(group_id, exc) for group_id in group_ids])  # noqa: C419
        count = streak.count
        self.log.warning("reward failed", function=name, error=str(exc), on_error=on_error, consecutive=count)
        self._print_first(name, f"{exc}; its group {OUTCOMES[on_error]}", on_error)
        if stop:
            raise RewardFunctionError(
                f"reward {name!r} failed on {count} consecutive groups with the same error "
                f"(run.max_consecutive_errors = {streak.limit}): {exc}. Fix the function, or raise "
                "run.max_consecutive_errors"
            )

    def _print_first(self, name: str, what: str, on_error: str) -> None:
        if name not in self._announced:
            self._announced.add(name)
            self.announce(
                f"warning: {what} (reward.on_error = {on_error!r}). Later failures are counted in metrics.jsonl "
                f"as rewards/{name}/failures, not printed"
            )

    async def _call(
        self, name: str, func: Any, completions: list[Any], kwargs: dict[str, Any]
    ) -> tuple[list[float | None], dict[str, list[Any]], dict[str, list[float]]]:
        """One reward function over a batch, with reward.timeout_s and reward.max_retries: its values and
        what it logged (log_extra columns, log_metric values) in the attempt that succeeded."""
        r = self.cfg.reward
        labels = (*self.labels, name)
        # In a process pool, pebble times the call from when it starts running (and kills it then); the
        # outer bound only adds room for a replacement process to start after a kill.
        timeout_s = r.timeout_s + PROCESS_START_GRACE_S if self._in_process(name, func) else r.timeout_s
        error, kind = "", ""
        for attempt in range(r.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.05 * 2 ** (attempt - 1), 1.0))  # backoff between attempts
            metrics.REWARD_CALLS.labels(*labels).inc()
            started = time.perf_counter()
            logged = RewardLog(name, len(completions))
            try:
                result = await asyncio.wait_for(self._invoke(name, func, completions, kwargs, logged), timeout=timeout_s)
                values = check_result(name, result, len(completions))
            except TimeoutError:  # asyncio.wait_for, and pebble killing a process over its timeout
                metrics.REWARD_TIMEOUTS.labels(*labels).inc()
                metrics.REWARD_ERRORS.labels(*labels).inc()
                error, kind = f"reward {name!r} timed out after {r.timeout_s} s", "timeout"
                continue
            except Exception as exc:  # noqa: BLE001 - a reward's own bug: retried, then reward.on_error
                metrics.REWARD_ERRORS.labels(*labels).inc()
                error, kind = f"reward {name!r} raised {type(exc).__name__}: {exc}", type(exc).__name__
                continue
            metrics.REWARD_SECONDS.labels(*labels).observe(time.perf_counter() - started)
            return values, logged.extra, logged.metrics
        raise _CallFailed(f"{error} ({r.max_retries + 1} attempts)", kind)

    def _in_process(self, name: str, func: Any) -> bool:
        """Does this call go to the process pool? Sync rewards under executor = processes, except the
        reward model, whose weights live in this process."""
        return self.cfg.reward.executor == "processes" and name != REWARD_MODEL and not _is_async(func)

    async def _invoke(
        self, name: str, func: Any, completions: list[Any], kwargs: dict[str, Any], logged: RewardLog
    ) -> Any:
        if self._in_process(name, func):
            # pebble kills the process of a call over its timeout, so a hang cannot pin the pool.
            future = self._process_pool().schedule(
                _call_in_process, args=(name, completions, kwargs), timeout=self.cfg.reward.timeout_s
            )
            result, extra, call_metrics = await asyncio.wrap_future(future)
            logged.merge(extra, call_metrics)
            return result
        kwargs = {**kwargs, "log_extra": logged.log_extra, "log_metric": logged.log_metric}
        if _is_async(func):
            return await invoke(func, completions, kwargs)
        # Threads (and the reward model, whose weights live here): the loop stays free; a hung call
        # keeps its thread until it returns, which is why reward.executor_workers bounds the pool.
        result = await asyncio.wrap_future(self._thread_pool().submit(invoke, func, completions, kwargs))
        if inspect.isawaitable(result):
            result = await result
        return result
