"""Reward scoring: score requests with the configured reward functions (and reward model) and their weights.

The core the reward stage (``stages/reward.py``) shells and evaluation calls directly: ``RewardScorer``.

A reward is ms-swift's ORM protocol: ``(completions: list[str], **kwargs) -> list[float | None]``, sync
or async (see ``rewards/__init__.py``). Each call gets one entry per request in every kwarg:

- every dataset column (``solution``, ``verification_info``, ...);
- ``messages``: the whole conversation, the completion appended as the last assistant turn;
  ``completions`` is that last model turn;
- ``is_truncated``, ``prompt_id``, ``request_id``, ``completion_ids`` (token ids of the last turn);
- ``trajectory_inputs``: every record of the request (a scheduler may split one request into several
  records), as dicts; ``rollout_infos`` (and its ms-swift alias ``multi_turn_infos``): the scheduler's
  extra info of the request's last record; ``trajectory_infos``: a gym rollout's per-step rewards and
  infos (``rollout_infos["trajectory_infos"]``, None for other rollouts).

Total = sum of weight * score over the functions that returned a number: ``None`` and NaN mean "not
applicable" and are left out (NaN-aware, as TRL). A request is scored once and its total broadcast to
all its records.

Failure policy: a call that raises or exceeds ``reward.timeout_s`` is retried ``reward.max_retries``
times, then ``reward.on_error`` decides (``zero``: that function scores 0; ``drop_group``: the records
carry ``failed`` and the advantage stage drops the group and asks for a resample; ``dead_letter``:
``RewardFailed`` is raised). A request on which every function returned None/NaN fails the same way.
Sync functions run in a pool (``reward.executor``: threads, or processes that a timeout kills), so
none blocks the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import itertools
import math
import numbers
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline import metrics
from pipeline.config import Config
from pipeline.plugins import load_plugins
from pipeline.records import ScoredTrajectory, Trajectory
from rewards import UnknownRewardError, get_reward
from rewards.models import build_reward_model

REWARD_MODEL = "reward_model"  # the key of a reward model's score in ScoredTrajectory.rewards
PROCESS_START_GRACE_S = 30.0  # a spawned pool process imports torch-free rollstream in ~1-3 s; loaded: more


class RewardFailed(RuntimeError):
    """Scoring failed under ``on_error = dead_letter``: the worker dead-letters the record with this reason.
    ``record_id``: the first record of the request that failed."""

    def __init__(self, reason: str, record_id: str = "") -> None:
        super().__init__(reason)
        self.record_id = record_id


class _CallFailed(Exception):
    """One reward function failed after its retries (the reason is the message)."""


def is_missing(value: Any) -> bool:
    """None or NaN: "not applicable" (TRL's nansum treats both alike)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def weighted_total(scores: dict[str, float | None], weights: dict[str, float]) -> float:
    """Pure: sum of weight * score over the functions that returned a number (None / NaN skipped)."""
    return sum(weights[name] * float(value) for name, value in scores.items() if not is_missing(value))


def record_input(t: Trajectory) -> dict[str, Any]:
    """One record of a request as a reward sees it in ``trajectory_inputs``."""
    return {
        "record_id": t.record_id,
        "turn": t.turn,
        "messages": conversation(t),
        "completion": t.completion,
        "completion_ids": t.completion_token_ids().tolist(),
        "finish_reason": t.finish_reason,
        "rollout_infos": t.rollout_infos,
    }


def conversation(t: Trajectory) -> list[dict[str, Any]]:
    return [*t.messages, {"role": "assistant", "content": t.completion}]


def reward_kwargs(requests: list[list[Trajectory]]) -> tuple[list[str], dict[str, list[Any]]]:
    """Pure: ``(completions, kwargs)`` for one reward call over ``requests`` (each: its records, by turn).

    A request is represented by its last record (the last model turn); dataset columns come from it
    (a column missing in some rows is None there)."""
    lasts = [records[-1] for records in requests]
    columns = list(dict.fromkeys(key for t in lasts for key in t.data_dict))
    kwargs: dict[str, list[Any]] = {key: [t.data_dict.get(key) for t in lasts] for key in columns}
    kwargs.update(
        messages=[conversation(t) for t in lasts],
        is_truncated=[t.is_truncated for t in lasts],
        trajectory_inputs=[[record_input(r) for r in records] for records in requests],
        rollout_infos=[t.rollout_infos for t in lasts],
        multi_turn_infos=[t.rollout_infos for t in lasts],
        trajectory_infos=[t.rollout_infos.get("trajectory_infos") for t in lasts],
        prompt_id=[t.prompt_id for t in lasts],
        request_id=[t.request_id for t in lasts],
        completion_ids=[t.completion_token_ids().tolist() for t in lasts],
    )
    return [t.completion for t in lasts], kwargs


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


def _process_init(config: Config) -> None:
    """A pool process: load the run's plugins, so ``get_reward`` finds plugin rewards by name, and build
    the rewards now: their imports (math-verify/sympy: ~1 s) must not count against a call's timeout."""
    global _process_config
    _process_config = config
    load_plugins(config.run.external_plugins)
    for name in config.reward.reward_funcs:
        try:
            get_reward(name, config)
        except UnknownRewardError:
            pass  # registered only in the parent process; the call itself reports it, with the reason


def _process_ready() -> int:
    return 0


def _call_in_process(name: str, completions: list[str], kwargs: dict[str, Any]) -> list[Any]:
    result = get_reward(name, _process_config)(completions, **kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(result)
    return list(result)


def _is_async(func: Any) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)



class RewardScorer:
    """The configured reward functions (``reward.reward_funcs``, then ``reward.reward_model``) with their
    weights, their executor pool and failure policy. ``start`` before the first call, ``close`` after."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        r = cfg.reward
        self.funcs: dict[str, Any] = {name: get_reward(name, cfg) for name in r.reward_funcs}
        if r.reward_model is not None:
            self.funcs[REWARD_MODEL] = build_reward_model(r.reward_model, cfg)
        weights = r.reward_weights if r.reward_weights is not None else [1.0] * len(self.funcs)
        self.weights = dict(zip(self.funcs, weights))
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._processes: Any = None
        self.labels: tuple[str, str, str] = (cfg.run.name, "reward", "-")  # (run, stage, worker) of the metrics

    async def start(self, labels: tuple[str, str, str]) -> None:
        """Export the metrics under ``labels`` and start the process pool (reward.executor = processes)."""
        self.labels = labels
        for name in self.funcs:  # exported at 0 from the start, so error-rate alerts see a series
            for counter in (metrics.REWARD_CALLS, metrics.REWARD_ERRORS, metrics.REWARD_TIMEOUTS):
                counter.labels(*self.labels, name)
        if self.cfg.reward.executor == "processes":
            # Start the pool now: a process's start-up must not count against the first call's timeout.
            pool = self._process_pool()
            ready = [pool.schedule(_process_ready) for _ in range(self.cfg.reward.executor_workers)]
            await asyncio.gather(*(asyncio.wrap_future(f) for f in ready))

    def _thread_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                self.cfg.reward.executor_workers, thread_name_prefix="reward"
            )
        return self._threads

    def _process_pool(self) -> Any:
        if self._processes is None:
            import multiprocessing

            import pebble

            # spawn, not fork: this process has threads (engine, pools) that a fork would copy mid-state.
            self._processes = pebble.ProcessPool(
                max_workers=self.cfg.reward.executor_workers,
                initializer=_process_init,
                initargs=(self.cfg,),
                context=multiprocessing.get_context("spawn"),
            )
        return self._processes

    async def close(self) -> None:
        # A hung sync reward cannot be interrupted in a thread: do not wait for it.
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

    async def score_requests(self, requests: list[list[Trajectory]]) -> list[ScoredTrajectory]:
        """Score each request once (every function in one call over all requests) and broadcast the
        total to its records, in order. Raises RewardFailed under on_error = dead_letter."""
        on_error = self.cfg.reward.on_error
        completions, kwargs = reward_kwargs(requests)
        per_func: dict[str, list[float | None]] = {}
        failures: list[str] = []
        for name, func in self.funcs.items():
            try:
                per_func[name] = await self._call(name, func, completions, kwargs)
            except _CallFailed as exc:
                failures.append(str(exc))
                # zero: the failed function scores 0; otherwise the value is never used.
                per_func[name] = [0.0] * len(requests)
        out: list[ScoredTrajectory] = []
        for i, records in enumerate(requests):
            scores = {name: values[i] for name, values in per_func.items()}
            reasons = list(failures)
            if all(is_missing(v) for v in scores.values()):
                reasons.append("every reward function returned None/NaN")
            failed = ""
            if reasons:
                metrics.REWARD_FAILED.labels(*self.labels, on_error).inc(len(records))
                if on_error == "dead_letter":
                    raise RewardFailed("; ".join(reasons), records[0].record_id)
                if on_error == "drop_group":
                    failed = "; ".join(reasons)
            total = weighted_total(scores, self.weights)
            out += [ScoredTrajectory(trajectory=t, rewards=scores, reward=total, failed=failed) for t in records]
        return out

    async def _call(self, name: str, func: Any, completions: list[str], kwargs: dict[str, Any]) -> list[float | None]:
        """One reward function over a batch, with reward.timeout_s and reward.max_retries."""
        r = self.cfg.reward
        labels = (*self.labels, name)
        # In a process pool, pebble times the call from when it starts running (and kills it then); the
        # outer bound only adds room for a replacement process to start after a kill.
        timeout_s = r.timeout_s + PROCESS_START_GRACE_S if self._in_process(name, func) else r.timeout_s
        error = ""
        for attempt in range(r.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.05 * 2 ** (attempt - 1), 1.0))  # backoff between attempts
            metrics.REWARD_CALLS.labels(*labels).inc()
            started = time.perf_counter()
            try:
                result = await asyncio.wait_for(self._invoke(name, func, completions, kwargs), timeout=timeout_s)
                values = check_result(name, result, len(completions))
            except TimeoutError:  # asyncio.wait_for, and pebble killing a process over its timeout
                metrics.REWARD_TIMEOUTS.labels(*labels).inc()
                metrics.REWARD_ERRORS.labels(*labels).inc()
                error = f"reward {name!r} timed out after {r.timeout_s} s"
                continue
            except Exception as exc:  # noqa: BLE001 - a reward's own bug: retried, then reward.on_error
                metrics.REWARD_ERRORS.labels(*labels).inc()
                error = f"reward {name!r} raised {type(exc).__name__}: {exc}"
                continue
            metrics.REWARD_SECONDS.labels(*labels).observe(time.perf_counter() - started)
            return values
        raise _CallFailed(f"{error} ({r.max_retries + 1} attempts)")

    def _in_process(self, name: str, func: Any) -> bool:
        """Does this call go to the process pool? Sync rewards under executor = processes, except the
        reward model, whose weights live in this process."""
        return self.cfg.reward.executor == "processes" and name != REWARD_MODEL and not _is_async(func)

    async def _invoke(self, name: str, func: Any, completions: list[str], kwargs: dict[str, Any]) -> Any:
        if _is_async(func):
            return await func(completions, **kwargs)
        if self._in_process(name, func):
            # pebble kills the process of a call over its timeout, so a hang cannot pin the pool.
            future = self._process_pool().schedule(
                _call_in_process, args=(name, completions, kwargs), timeout=self.cfg.reward.timeout_s
            )
            return await asyncio.wrap_future(future)
        # Threads (and the reward model, whose weights live here): the loop stays free; a hung call
        # keeps its thread until it returns, which is why reward.executor_workers bounds the pool.
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._thread_pool(), functools.partial(func, completions, **kwargs))
        if inspect.isawaitable(result):
            result = await result
        return result
