"""pipeline/metrics.py: the training-row export, the series exported at 0 from the start, the sliding
tokens/s meter, and the /metrics + /healthz server (its JSON and a busy port's error)."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid

import pytest
from prometheus_client import REGISTRY, generate_latest

from pipeline import metrics


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_a_metrics_row_sets_the_training_gauges() -> None:
    run = f"t-{uuid.uuid4().hex[:8]}"
    row = {
        "step": 12, "reward": 0.75, "reward_std": 0.25, "rewards/accuracy/mean": 0.5, "rewards/accuracy/std": 0.5,
        "rewards/my_plugin/v2/mean": 0.125, "completions/mean_length": 7.5, "completions/max_length": 16.0,
        "clip_ratio/low_mean": 0.01, "entropy/mean": 1.5, "tokens_per_second": 900.0, "staleness/max": 1,
        "time": 1.7e9, "policy_version": 3, "nan_skipped": 0,
    }
    metrics.set_train_gauges(run, row)
    assert value("rollstream_train_step", run=run) == 12
    assert value("rollstream_train_reward", run=run) == 0.75
    assert value("rollstream_train_completions_mean_length", run=run) == 7.5
    assert value("rollstream_train_completions_max_length", run=run) == 16.0
    assert value("rollstream_train_clip_ratio_low_mean", run=run) == 0.01
    assert value("rollstream_train_entropy_mean", run=run) == 1.5
    assert value("rollstream_train_tokens_per_second", run=run) == 900.0
    assert value("rollstream_train_staleness_max", run=run) == 1
    assert value("rollstream_train_reward_func_mean", run=run, reward="accuracy") == 0.5
    assert value("rollstream_train_reward_func_std", run=run, reward="accuracy") == 0.5
    # A plugin's name may hold slashes: everything between rewards/ and /mean is the name.
    assert value("rollstream_train_reward_func_mean", run=run, reward="my_plugin/v2") == 0.125
    assert value("rollstream_train_nan_skipped_total", run=run) is None  # nothing skipped, nothing exported
    metrics.set_train_gauges(run, {"step": 13, "loss": float("nan"), "nan_skipped": 1})
    metrics.set_train_gauges(run, {"step": 14, "nan_skipped": 1})
    assert value("rollstream_train_nan_skipped_total", run=run) == 2


def test_run_and_worker_series_exist_at_zero_from_the_start() -> None:
    run = f"t-{uuid.uuid4().hex[:8]}"
    metrics.init_run(run, max_staleness=2)
    metrics.init_worker(run, "reward", "reward-1", ["trajectories"])
    assert value("rollstream_max_staleness", run=run) == 2
    assert value("rollstream_stale_dropped_total", run=run) == 0
    assert value("rollstream_train_nan_skipped_total", run=run) == 0
    assert value("rollstream_groups_dropped_total", run=run, reason="zero_std") == 0
    w = {"run": run, "stage": "reward", "worker": "reward-1"}
    assert value("rollstream_records_dead_lettered_total", **w, reason="handler_error") == 0
    assert value("rollstream_records_in_total", **w, edge="trajectories") == 0
    assert value("rollstream_redeliveries_total", **w, edge="trajectories") == 0
    assert b"_created" not in generate_latest()  # disabled: a third of every scrape, read by nothing


def test_rate_meter_counts_the_last_window_only() -> None:
    meter = metrics.RateMeter(window_s=10.0, started=100.0)
    assert meter.rate(100.0) == 0.0
    meter.add(50, at=101.0)
    assert meter.rate(102.0) == pytest.approx(25.0)  # younger than a window: over its 2 s of life
    meter.add(100, at=105.0)
    assert meter.rate(110.0) == pytest.approx(15.0)  # 150 tokens over the full 10 s window
    assert meter.rate(111.5) == pytest.approx(10.0)  # the event at 101 left the window
    assert meter.rate(200.0) == 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def get(port: int, path: str) -> tuple[str, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = (await asyncio.wait_for(reader.read(), 10)).decode()
    writer.close()
    head, _, body = data.partition("\r\n\r\n")
    return head.splitlines()[0], body


async def test_healthz_answers_json_and_503_when_not_ready() -> None:
    port = free_port()
    state = {"ready": True, "last_progress": 1.7e9}
    server = await metrics.serve("127.0.0.1", port, lambda: dict(state))
    try:
        status, body = await get(port, "/healthz")
        assert status == "HTTP/1.1 200 OK" and json.loads(body) == state
        state["ready"] = False
        status, body = await get(port, "/healthz")
        assert status == "HTTP/1.1 503 Service Unavailable" and json.loads(body)["ready"] is False
        assert (await get(port, "/nope"))[0] == "HTTP/1.1 404 Not Found"
        # A second server on the same port: one line naming the field and the fix.
        with pytest.raises(metrics.MetricsServerError, match="run.metrics_port"):
            await metrics.serve("127.0.0.1", port, lambda: state)
    finally:
        server.close()
        await server.wait_closed()
