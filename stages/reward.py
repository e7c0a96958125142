"""Reward: score each request with the configured reward functions (and reward model) and their weights.

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
all its records. The rollout sends each group as one ``TrajectoryGroup`` entry, so a group's records always
reach the same worker (any number of workers share the stream, group by group): each function is called
once per group over its G requests (a batch, as ms-swift and TRL call them; a reward model's forward is
batched), a request a scheduler split into several records is scored once, and under ``dead_letter`` the
whole group goes to the dead edge as that one entry. (Single ``Trajectory`` entries, each with its
group's ``GroupClosed`` manifest, are still scored one by one: older producers and hand-written records.)

Failure policy: a call that raises or exceeds ``reward.timeout_s`` is retried ``reward.max_retries``
times, then ``reward.on_error`` decides (``zero``: that function scores 0; ``drop_group``: the records
carry ``failed`` and the advantage stage drops the group and asks for a resample; ``dead_letter``: the
record is dead-lettered). A request on which every function returned None/NaN fails the same way.
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
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline import metrics
from pipeline.edges import SCORED, WEIGHTS
from pipeline.records import GroupClosed, ScoredTrajectory, Trajectory, TrajectoryGroup
from pipeline.stage import Handled, stop_when_run_finished

REWARD_MODEL = "reward_model"  # the key of a reward model's score in ScoredTrajectory.rewards
PROCESS_START_GRACE_S = 30.0  # a spawned pool process imports torch-free rollstream in ~1-3 s; loaded: more


class RewardFailed(RuntimeError):
    """Scoring failed under ``on_error = dead_letter``: the worker dead-letters the record with this reason."""


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

_process_config: Any = None


def _process_init(config: Any) -> None:
    """A pool process: load the run's plugins, so ``get_reward`` finds plugin rewards by name, and build
    the rewards now: their imports (math-verify/sympy: ~1 s) must not count against a call's timeout."""
    global _process_config
    from pipeline.plugins import load_plugins
    from rewards import UnknownRewardError, get_reward

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
    from rewards import get_reward

    result = get_reward(name, _process_config)(completions, **kwargs)
    if inspect.isawaitable(result):
        result = asyncio.run(result)
    return list(result)


def _is_async(func: Any) -> bool:
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


class Reward:
    name = "reward"
    consumes = ("trajectories",)
    subscribes = (WEIGHTS,)
    concurrency = 8
    MAX_REMEMBERED_FAILURES = 10_000

    def __init__(self, cfg: Any) -> None:
        from rewards import get_reward

        self.cfg = cfg
        r = cfg.reward
        self.funcs: dict[str, Any] = {name: get_reward(name, cfg) for name in r.reward_funcs}
        if r.reward_model is not None:
            from rewards.models import build_reward_model

            self.funcs[REWARD_MODEL] = build_reward_model(r.reward_model, cfg)
        weights = r.reward_weights if r.reward_weights is not None else [1.0] * len(self.funcs)
        self.weights = dict(zip(self.funcs, weights))
        self._failed: OrderedDict[str, str] = OrderedDict()  # record_id -> reason (dead_letter retries)
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._processes: Any = None
        self._labels: tuple[str, str, str] = (cfg.run.name, self.name, "-")

    # ------------------------------------------------------------------ lifecycle

    async def start(self, ctx: Any) -> None:
        self._labels = (ctx.run, ctx.stage, ctx.worker)
        for name in self.funcs:  # exported at 0 from the start, so error-rate alerts see a series
            for counter in (metrics.REWARD_CALLS, metrics.REWARD_ERRORS, metrics.REWARD_TIMEOUTS):
                counter.labels(*self._labels, name)
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

    async def on_broadcast(self, record: Any, ctx: Any) -> list:
        stop_when_run_finished(record, ctx)
        return []

    # ------------------------------------------------------------------ handle

    async def handle(self, record: Any, ctx: Any) -> Handled:
        if isinstance(record, GroupClosed):  # the manifest of a group whose records came one by one
            return Handled(outputs=[(SCORED, record)])
        if record.record_id in self._failed:  # a worker retry of a dead_letter failure: do not re-run it
            raise RewardFailed(self._failed[record.record_id])
        if isinstance(record, Trajectory):  # one record, one request
            scored = await self.score_requests([[record]], record.record_id)
            return Handled(outputs=[(SCORED, s) for s in scored])
        if isinstance(record, TrajectoryGroup):
            by_request: dict[str, list[Trajectory]] = {}
            for t in record.trajectories:
                by_request.setdefault(t.request_id, []).append(t)
            requests = [sorted(rs, key=lambda t: t.turn) for rs in by_request.values()]
            scored = await self.score_requests(requests, record.record_id)
            return Handled(outputs=[(SCORED, s) for s in scored] + [(SCORED, record.manifest)])
        raise TypeError(
            f"reward stage got {type(record).__name__}, expected Trajectory, TrajectoryGroup or GroupClosed"
        )

    # ------------------------------------------------------------------ scoring

    async def score_requests(self, requests: list[list[Trajectory]], input_id: str = "") -> list[ScoredTrajectory]:
        """Score each request once (every function in one call over all requests) and broadcast the
        total to its records. Raises RewardFailed under on_error = dead_letter (remembered under
        ``input_id``, the record being handled, so the worker's retries do not call the functions again)."""
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
                metrics.REWARD_FAILED.labels(*self._labels, on_error).inc(len(records))
                if on_error == "dead_letter":
                    reason = "; ".join(reasons)
                    self._remember_failure(input_id or records[0].record_id, reason)
                    raise RewardFailed(reason)
                if on_error == "drop_group":
                    failed = "; ".join(reasons)
            total = weighted_total(scores, self.weights)
            out += [ScoredTrajectory(trajectory=t, rewards=scores, reward=total, failed=failed) for t in records]
        return out

    def _remember_failure(self, record_id: str, reason: str) -> None:
        self._failed[record_id] = reason
        while len(self._failed) > self.MAX_REMEMBERED_FAILURES:
            self._failed.popitem(last=False)

    async def _call(self, name: str, func: Any, completions: list[str], kwargs: dict[str, Any]) -> list[float | None]:
        """One reward function over a batch, with reward.timeout_s and reward.max_retries."""
        r = self.cfg.reward
        labels = (*self._labels, name)
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
