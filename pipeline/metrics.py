"""Every Prometheus metric name, in one place (prefix ``rollstream_``, base units, ``_total`` counters).

Labels are of low cardinality only: run, stage, worker, edge, reason, reward. Never prompt or
request ids. ``serve()`` exposes ``/metrics`` and ``/healthz`` on 127.0.0.1 by default.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from pipeline.errors import UserError

# No `*_created` samples: they double every counter's and histogram's lines in each scrape (a third of
# its size and CPU) and nothing here reads them; Prometheus detects counter resets without them.
disable_created_metrics()

_W = ("run", "stage", "worker")

RECORDS_IN = Counter("rollstream_records_in_total", "Records delivered to a stage", _W + ("edge",))
RECORDS_OUT = Counter("rollstream_records_out_total", "Records produced by a stage", _W + ("edge",))
RECORDS_ACKED = Counter("rollstream_records_acked_total", "Input records acked", _W + ("edge",))
RECORDS_RETRIED = Counter("rollstream_records_retried_total", "Handle attempts that failed and were retried", _W)
RECORDS_DEAD = Counter(
    "rollstream_records_dead_lettered_total", "Records moved to the dead-letter stream", _W + ("reason",)
)
DEAD_LETTER_REASONS = ("undecodable", "handler_error")  # the worker runtime's `reason` label values
REDELIVERIES = Counter("rollstream_redeliveries_total", "Entries reclaimed from dead consumers", _W + ("edge",))
HANDLE_SECONDS = Histogram(
    "rollstream_handle_seconds",
    "Time spent in a stage's handle()",
    _W,
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
)
HELD = Gauge("rollstream_held_records", "Inputs a stage holds unacked while it buffers", _W)
IN_FLIGHT = Gauge("rollstream_in_flight_records", "Records inside handle() right now", _W)
WORKER_UP = Gauge("rollstream_worker_up", "1 while the worker runs", _W)
HEARTBEAT = Gauge("rollstream_worker_heartbeat_timestamp_seconds", "Last time the worker loop turned", _W)
LAST_PROGRESS = Gauge(
    "rollstream_worker_last_progress_timestamp_seconds", "Last time the worker acked an input or produced an output", _W
)
QUEUE_DEPTH = Gauge("rollstream_queue_depth", "Entries in an edge's stream", ("run", "edge"))
QUEUE_PENDING = Gauge("rollstream_queue_pending", "Delivered but unacked entries on an edge", ("run", "edge"))
QUEUE_LAG = Gauge("rollstream_queue_lag", "Entries not yet delivered to the edge's group", ("run", "edge"))
QUEUE_OLDEST_PENDING = Gauge(
    "rollstream_queue_oldest_pending_seconds", "Idle time of the oldest delivered-but-unacked entry", ("run", "edge")
)

# Staleness and versions (learner, feeder, rollout).
LEARNER_VERSION = Gauge("rollstream_learner_version", "Policy version the learner has published", ("run",))
MAX_STALENESS = Gauge("rollstream_max_staleness", "The run's grpo.max_staleness (for alerts on the limit)", ("run",))
ROLLOUT_VERSION = Gauge("rollstream_rollout_policy_version", "Weights version a rollout worker uses", _W)
ROLLOUT_OLDEST_VERSION = Gauge(
    "rollstream_rollout_oldest_version_in_use",
    "Oldest weights version a request still in this rollout worker's engine started on (its version when idle)",
    _W,
)
STALENESS = Histogram(
    "rollstream_trajectory_staleness",
    "Learner version minus the trajectory's policy_version, at training time",
    ("run",),
    buckets=(0, 1, 2, 3, 4, 8, 16),
)
STALE_DROPPED = Counter("rollstream_stale_dropped_total", "Trajectories dropped for exceeding max_staleness", ("run",))

# Groups not trained and sent back to the feeder (advantage: zero_std under dynamic_sample).
GROUPS_DROPPED = Counter("rollstream_groups_dropped_total", "Prompt groups dropped, by reason", ("run", "reason"))
GROUP_DROP_REASONS = ("zero_std", "reward_error")  # the advantage stage's reasons, exported at 0 from the start
RESAMPLES = Counter("rollstream_resamples_total", "New attempts of a prompt asked by dynamic sampling", ("run",))
PROMPTS_TRUNCATED = Counter(
    "rollstream_prompts_truncated_total", "Prompts over data.max_length, by truncation_strategy", ("run", "strategy")
)
ADMISSION_WAIT = Counter(
    "rollstream_feeder_admission_wait_seconds_total", "Time the feeder waited on max_staleness", ("run",)
)

# Rollout.
TOKENS_GENERATED = Counter("rollstream_tokens_generated_total", "Completion tokens generated", _W)
TOKENS_PER_SECOND = Gauge(
    "rollstream_rollout_tokens_per_second", "Completion tokens generated per second, over the last 10 s", _W
)
REQUESTS_IN_FLIGHT = Gauge("rollstream_rollout_requests_in_flight", "Engine requests in flight", _W)
ENGINE_QUEUE = Gauge(
    "rollstream_rollout_engine_queue_length", "Requests inside the engine not finished yet (waiting or running)", _W
)
ENVS_LIVE = Gauge("rollstream_rollout_envs_live", "Gym environments live in a rollout worker (reset, not closed)", _W)
ENV_FAILURES = Counter(
    "rollstream_rollout_env_failures_total",
    "Rollout requests whose environment raised or timed out on every attempt (then reward.on_error applies)",
    _W,
)
AGENT_FAILURES = Counter(
    "rollstream_rollout_agent_failures_total",
    "Agent-program episodes (rollout.agent) that raised, timed out, returned a non-reward or made no call",
    _W,
)
TURNS = Histogram(
    "rollstream_rollout_turns",
    "Turns per trajectory (1 for single-turn; a multi-turn scheduler's rollout_infos['num_turns'])",
    _W,
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
)
WEIGHT_SYNC_SECONDS = Histogram(
    "rollstream_weight_sync_seconds",
    "Pause + load + resume of new weights in the engine",
    _W,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
)
# The weights group (rollout.weight_transport = "broadcast"; weights/membership.py).
WEIGHT_GROUP_MEMBERS = Gauge("rollstream_weight_group_members", "Rollout engines in the weights group now", ("run",))
WEIGHT_GROUP_EPOCH = Gauge("rollstream_weight_group_epoch", "The weights group's membership epoch", ("run",))
WEIGHT_ROUND_SECONDS = Histogram(
    "rollstream_weight_round_seconds",
    "One broadcast round on the learner: send every byte, until every member holds the version",
    ("run",),
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
WEIGHT_ROUND_BYTES_PER_SECOND = Gauge(
    "rollstream_weight_round_bytes_per_second", "Bytes of the last round over its send time", ("run",)
)
WEIGHT_ROUNDS_FAILED = Counter(
    "rollstream_weight_rounds_failed_total", "Broadcast rounds or group formations that failed", ("run", "reason")
)
WEIGHT_MEMBER_ERRORS = Counter(
    "rollstream_weight_member_errors_total",
    "A rollout worker's failures in the weights group (unreachable learner, failed join or round)",
    _W + ("reason",),
)
SERVER_RETRIES = Counter(
    "rollstream_rollout_server_retries_total", "Server-mode requests moved to another vLLM server after a failure", _W
)

# Reward.
REWARD_CALLS = Counter("rollstream_reward_calls_total", "Reward function calls", _W + ("reward",))
REWARD_ERRORS = Counter("rollstream_reward_errors_total", "Reward function failures", _W + ("reward",))
REWARD_TIMEOUTS = Counter(
    "rollstream_reward_timeouts_total", "Reward calls over reward.timeout_s (also counted as errors)", _W + ("reward",)
)
REWARD_SECONDS = Histogram(
    "rollstream_reward_seconds",
    "Time of one reward function call (one request or one group), retries excluded",
    _W + ("reward",),
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
)
REWARD_FAILED = Counter(
    "rollstream_reward_failed_records_total",
    "Records whose scoring failed after retries (or every function returned None/NaN), by reward.on_error",
    _W + ("on_error",),
)
SANDBOX_RUNS = Counter(
    "rollstream_reward_sandbox_runs_total",
    "code_execution test-case runs by outcome (passed, wrong_answer, timeout, memory, refused, ...)",
    ("run", "outcome"),
)

# Training: ms-swift's metric names, Prometheus style (``rewards/accuracy/mean`` -> label reward=accuracy).
TRAIN_GAUGES: dict[str, Gauge] = {
    name: Gauge(f"rollstream_train_{name}", f"Training metric `{name}` at the last optimizer step", ("run",))
    for name in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "loss",
        "kl",
        "grad_norm",
        "learning_rate",
        "completions_mean_length",
        "completions_min_length",
        "completions_max_length",
        "completions_clipped_ratio",
        "clip_ratio_region_mean",
        "clip_ratio_low_mean",
        "clip_ratio_high_mean",
        "cispo_clip_ratio",
        "off_policy_sequence_mask_dropped_token_ratio",
        "entropy_mean",
        "samples_per_second",
        "tokens_per_second",
        "staleness_mean",
        "staleness_max",
        "sampling_sampling_logp_difference_mean",
        "sampling_sampling_logp_difference_max",
        "tools_call_frequency",
        "tools_failure_frequency",
        "tools_template_rewrite_frequency",
        "agent_branch_frequency",
        "step",
    )
}
TRAIN_REWARD_MEAN = Gauge("rollstream_train_reward_func_mean", "Mean of one reward function", ("run", "reward"))
TRAIN_REWARD_STD = Gauge("rollstream_train_reward_func_std", "Std of one reward function", ("run", "reward"))
TRAIN_NAN_SKIPPED = Counter(
    "rollstream_train_nan_skipped_total", "Optimizer steps skipped for a non-finite loss or grad norm", ("run",)
)
# ms-swift's per-function rows: ``rewards/<func>/mean`` -> TRAIN_REWARD_MEAN{reward="<func>"}.
_REWARD_FUNC_ROW = re.compile(r"rewards/(?P<func>.+)/(?P<stat>mean|std)")


def train_gauge_name(metric: str) -> str:
    """ms-swift name -> our gauge key: ``completions/mean_length`` -> ``completions_mean_length``."""
    return metric.replace("/", "_")


def set_train_gauges(run: str, row: dict[str, Any]) -> None:
    """Export one optimizer step's metrics.jsonl row (ms-swift's names) as the training gauges."""
    for key, value in row.items():
        if not isinstance(value, (int, float)):
            continue
        gauge = TRAIN_GAUGES.get(train_gauge_name(key))
        if gauge is not None:
            gauge.labels(run).set(value)
            continue
        match = _REWARD_FUNC_ROW.fullmatch(key)
        if match is not None:
            per_func = TRAIN_REWARD_MEAN if match["stat"] == "mean" else TRAIN_REWARD_STD
            per_func.labels(run, match["func"]).set(value)
    if row.get("nan_skipped"):
        TRAIN_NAN_SKIPPED.labels(run).inc()


# Evaluation (stages/evaluate.py): one row per evaluated version, its ``eval_<name>`` keys as gauges.
EVAL_GAUGES: dict[str, Gauge] = {
    name: Gauge(f"rollstream_eval_{name}", f"Evaluation metric `eval_{name}` of the last evaluated version", ("run",))
    for name in (
        "reward",
        "reward_std",
        "completions_mean_length",
        "completions_clipped_ratio",
        "runtime",
        "policy_version",
    )
}
EVAL_REWARD_MEAN = Gauge(
    "rollstream_eval_reward_func_mean", "Mean of one reward function on the held-out set", ("run", "reward")
)
EVAL_PASS_AT_K = Gauge("rollstream_eval_pass_at_k", "Unbiased pass@k of the accuracy reward, held-out set", ("run", "k"))
EVAL_SKIPPED = Counter(
    "rollstream_eval_skipped_versions_total", "Due versions not evaluated (a newer one came first, weights gone)", ("run",)
)
EVAL_FAILED = Counter("rollstream_eval_failed_total", "Evaluations that raised (see the evaluate worker's log)", ("run",))
_EVAL_FUNC_ROW = re.compile(r"eval_rewards/(?P<func>.+)/mean")
_EVAL_PASS_ROW = re.compile(r"eval_pass@(?P<k>\d+)")


def set_eval_gauges(run: str, row: dict[str, Any]) -> None:
    """Export one evaluation row (``eval_reward``, ``eval_rewards/<func>/mean``, ``eval_pass@k``, ...)."""
    for key, value in row.items():
        if not isinstance(value, (int, float)):
            continue
        name = train_gauge_name(key.removeprefix("eval_"))
        if key.startswith("eval_") and name in EVAL_GAUGES:
            EVAL_GAUGES[name].labels(run).set(value)
        elif match := _EVAL_FUNC_ROW.fullmatch(key):
            EVAL_REWARD_MEAN.labels(run, match["func"]).set(value)
        elif match := _EVAL_PASS_ROW.fullmatch(key):
            EVAL_PASS_AT_K.labels(run, match["k"]).set(value)
    EVAL_GAUGES["policy_version"].labels(run).set(row["policy_version"])


def init_eval(run: str) -> None:
    """The evaluate stage's counters at 0 from its start (see ``init_run``)."""
    EVAL_SKIPPED.labels(run)
    EVAL_FAILED.labels(run)


def init_run(run: str, max_staleness: int) -> None:
    """Export the run-level series at 0 from the start, so alert expressions over them (drops, NaN
    skips) see a 0 instead of no series before the first event (Prometheus practice)."""
    MAX_STALENESS.labels(run).set(max_staleness)
    LEARNER_VERSION.labels(run)
    STALE_DROPPED.labels(run)
    TRAIN_NAN_SKIPPED.labels(run)
    ADMISSION_WAIT.labels(run)
    RESAMPLES.labels(run)
    for reason in GROUP_DROP_REASONS:
        GROUPS_DROPPED.labels(run, reason)


def init_worker(run: str, stage: str, worker: str, consumes: Iterable[str]) -> None:
    """A worker's labelled counters at 0 from its start (see ``init_run``)."""
    w = (run, stage, worker)
    RECORDS_RETRIED.labels(*w)
    for reason in DEAD_LETTER_REASONS:
        RECORDS_DEAD.labels(*w, reason)
    for edge in consumes:
        RECORDS_IN.labels(*w, edge)
        RECORDS_ACKED.labels(*w, edge)
        REDELIVERIES.labels(*w, edge)


class RateMeter:
    """Events per second over a sliding window (tokens/s as a gauge, readable without Prometheus)."""

    def __init__(self, window_s: float = 10.0, started: float | None = None) -> None:
        self.window_s = window_s
        self.started = time.monotonic() if started is None else started
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._total = 0.0

    def add(self, amount: float, at: float) -> None:
        self._events.append((at, amount))
        self._total += amount

    def rate(self, at: float) -> float:
        while self._events and self._events[0][0] <= at - self.window_s:
            self._total -= self._events.popleft()[1]
        # Over the window, or over the meter's life while it is younger than one window.
        span = min(self.window_s, at - self.started)
        return self._total / span if span > 0 else 0.0


class MetricsServerError(UserError, RuntimeError):
    """The metrics port cannot be bound (in use, not allowed): one line naming the field and the fix."""


async def serve(host: str, port: int, health: Callable[[], dict[str, Any]]) -> asyncio.AbstractServer:
    """Serve ``/metrics`` and ``/healthz`` on host:port. ``health()`` returns a dict with ``ready``
    (200 while true, else 503) and whatever else a prober wants (the last progress time): JSON body."""

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass
            path = request_line.split(b" ")[1].decode() if request_line.count(b" ") >= 2 else "/"
            if path.startswith("/metrics"):
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest()
            elif path.startswith("/healthz"):
                state = health()
                status = "200 OK" if state.get("ready") else "503 Service Unavailable"
                ctype, body = "application/json", json.dumps(state).encode() + b"\n"
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await asyncio.wait_for(writer.drain(), timeout=5)
        except (TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    try:
        return await asyncio.start_server(on_client, host, port)
    except OSError as exc:
        raise MetricsServerError(
            f"cannot serve /metrics on {host}:{port} ({exc.strerror or exc}); set run.metrics_port to a free "
            "base port (stage ports are consecutive from it), --metrics-port for one worker, or 0 to turn it off"
        ) from exc


def now() -> float:
    return time.time()
