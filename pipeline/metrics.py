"""Every Prometheus metric name, in one place (prefix ``rollstream_``, base units, ``_total`` counters).

Labels are of low cardinality only: run, stage, worker, edge, reason, reward. Never prompt or
request ids. ``serve()`` exposes ``/metrics`` and ``/healthz`` on 127.0.0.1 by default.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

_W = ("run", "stage", "worker")

RECORDS_IN = Counter("rollstream_records_in_total", "Records delivered to a stage", _W + ("edge",))
RECORDS_OUT = Counter("rollstream_records_out_total", "Records produced by a stage", _W + ("edge",))
RECORDS_ACKED = Counter("rollstream_records_acked_total", "Input records acked", _W + ("edge",))
RECORDS_RETRIED = Counter("rollstream_records_retried_total", "Handle attempts that failed and were retried", _W)
RECORDS_DEAD = Counter(
    "rollstream_records_dead_lettered_total", "Records moved to the dead-letter stream", _W + ("reason",)
)
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
QUEUE_DEPTH = Gauge("rollstream_queue_depth", "Entries in an edge's stream", ("run", "edge"))
QUEUE_PENDING = Gauge("rollstream_queue_pending", "Delivered but unacked entries on an edge", ("run", "edge"))
QUEUE_LAG = Gauge("rollstream_queue_lag", "Entries not yet delivered to the edge's group", ("run", "edge"))
QUEUE_OLDEST_PENDING = Gauge(
    "rollstream_queue_oldest_pending_seconds", "Idle time of the oldest delivered-but-unacked entry", ("run", "edge")
)

# Staleness and versions (learner, feeder, rollout).
LEARNER_VERSION = Gauge("rollstream_learner_version", "Policy version the learner has published", ("run",))
ROLLOUT_VERSION = Gauge("rollstream_rollout_policy_version", "Weights version a rollout worker uses", _W)
STALENESS = Histogram(
    "rollstream_trajectory_staleness",
    "Learner version minus the trajectory's policy_version, at training time",
    ("run",),
    buckets=(0, 1, 2, 3, 4, 8, 16),
)
STALE_DROPPED = Counter("rollstream_stale_dropped_total", "Trajectories dropped for exceeding max_staleness", ("run",))

# Groups not trained and sent back to the feeder (advantage: zero_std under dynamic_sample).
GROUPS_DROPPED = Counter("rollstream_groups_dropped_total", "Prompt groups dropped, by reason", ("run", "reason"))
RESAMPLES = Counter("rollstream_resamples_total", "New attempts of a prompt asked by dynamic sampling", ("run",))
PROMPTS_TRUNCATED = Counter(
    "rollstream_prompts_truncated_total", "Prompts over data.max_length, by truncation_strategy", ("run", "strategy")
)
ADMISSION_WAIT = Counter(
    "rollstream_feeder_admission_wait_seconds_total", "Time the feeder waited on max_staleness", ("run",)
)

# Rollout.
TOKENS_GENERATED = Counter("rollstream_tokens_generated_total", "Completion tokens generated", _W)
REQUESTS_IN_FLIGHT = Gauge("rollstream_rollout_requests_in_flight", "Engine requests in flight", _W)
WEIGHT_SYNC_SECONDS = Histogram(
    "rollstream_weight_sync_seconds",
    "Pause + load + resume of new weights in the engine",
    _W,
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
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

# Training: ms-swift's metric names, Prometheus style (``reward/accuracy/mean`` -> label reward=accuracy).
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
        "completions_clipped_ratio",
        "clip_ratio_region_mean",
        "samples_per_second",
        "staleness_mean",
        "step",
    )
}
TRAIN_REWARD_MEAN = Gauge("rollstream_train_reward_func_mean", "Mean of one reward function", ("run", "reward"))


def train_gauge_name(metric: str) -> str:
    """ms-swift name -> our gauge key: ``completions/mean_length`` -> ``completions_mean_length``."""
    return metric.replace("/", "_")


async def serve(host: str, port: int, health: callable) -> asyncio.AbstractServer:
    """Serve ``/metrics`` and ``/healthz`` (200 while ``health()`` is true, else 503) on host:port."""

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass
            path = request_line.split(b" ")[1].decode() if request_line.count(b" ") >= 2 else "/"
            if path.startswith("/metrics"):
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, generate_latest()
            elif path.startswith("/healthz"):
                ok = bool(health())
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype, body = "text/plain", (b"ok\n" if ok else b"unhealthy\n")
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode() + body)
            await asyncio.wait_for(writer.drain(), timeout=5)
        except (asyncio.TimeoutError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(on_client, host, port)


def now() -> float:
    return time.time()
