"""Observability of a real run: one short in-process pipeline (memory transport, tiny model, the
session's vLLM engine) with ``run.metrics_port`` set, scraped while it runs and, where the `prometheus`
binary is installed (Debian's package; `make test` installs it), scraped by a real Prometheus (every 2 s).

Checks: every metric name the dashboard and the alert rules read is exported; the training gauges
equal the metrics.jsonl row of the same step; /healthz answers JSON; Prometheus's HTTP API has the
run's ``rollstream_`` series; ``train`` left plot.png, config.toml and dead_letters.jsonl behind.

The run may not end before Prometheus has scraped it: the test holds a turn open on the run's engine, the
gate a "pause" weight load waits behind, until Prometheus stores a training sample of the run. The run
cannot load version 1, so cannot sample its last generation batches, before that event.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from config import load_config
from ops import promql
from rollstream import inspect_run, plot
from rollstream import train as graph

pytestmark = pytest.mark.e2e

STEPS = 16  # 4 generation batches of 64 samples, 4 optimizer steps each: ~15 s here
RUN_TIMEOUT_S = 300.0
SCRAPE_TIMEOUT_S = 120.0  # the held weight load itself gives up after 600 s (rollout's drain timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split(" ")[1]), body


async def api_get(port: int, path: str) -> dict:
    """Prometheus's HTTP API (chunked responses: urllib, in a thread, rather than the raw GET above)."""

    def get() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return json.loads(response.read())

    return await asyncio.to_thread(get)


def start_prometheus(tmp: Path, target_port: int) -> tuple[subprocess.Popen | None, int, str]:
    """A real Prometheus on a free loopback port scraping the run every 2 s with ops/'s rules.
    Returns (process or None, API port, why not)."""
    binary = shutil.which("prometheus")
    if binary is None:
        return None, 0, "prometheus not found: `apt-get install prometheus` (make test tries)"
    config = yaml.safe_load(promql.PROMETHEUS.read_text())  # ops/prometheus.yml, pointed at this run
    # 2 s: in a full test session the registry holds every earlier test's series, and a busy event
    # loop can take over a second to answer; a timed-out scrape stores nothing.
    config["global"] = {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "2s"}
    config["rule_files"] = [str(promql.ALERTS)]
    config["scrape_configs"] = [
        {"job_name": "rollstream-train", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}
    ]
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    api_port = free_port()
    with open(tmp / "prometheus.log", "w") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{api_port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    return process, api_port, ""


async def wait_ready(process: subprocess.Popen, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {process.returncode}")
        try:
            if (await http_get(port, "/-/ready"))[0] == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.2)  # poll interval
    raise TimeoutError("prometheus did not become ready")


async def wait_scraping(port: int, timeout: float = 60) -> None:
    """Until Prometheus has tried its target once (it applies discovered targets every 5 s): from then
    on it scrapes every 2 s, so even a short run is scraped several times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        targets = (await api_get(port, "/api/v1/targets"))["data"]["activeTargets"]
        if targets and all(t["health"] != "unknown" for t in targets):
            return
        await asyncio.sleep(0.5)  # poll interval
    raise TimeoutError("prometheus did not start scraping its target")


async def wait_for_series(port: int, selector: str, timeout: float) -> list[dict]:
    """Until Prometheus's HTTP API lists a series matching ``selector`` (queryable once a scrape stored it)."""
    match = urllib.parse.quote(selector)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        series = (await api_get(port, f"/api/v1/series?match[]={match}"))["data"]
        if series:
            return series
        await asyncio.sleep(0.5)  # poll interval
    raise TimeoutError(f"prometheus stored no {selector} in {timeout:.0f} s")


async def hold_run_until_scraped(engine, api_port: int, run: str) -> None:
    """Holds a turn open on the run's engine until Prometheus has stored the run's training-step gauge
    (set from the first optimizer step on). A weight load under rollout.weight_load = "pause" waits for
    every running turn, and generation batch b needs version b - max_staleness loaded: so the run cannot
    reach its last batches, hence cannot end, before Prometheus scraped it mid-training."""
    async with engine.running("pause"):
        await wait_for_series(api_port, f'rollstream_train_step{{run="{run}"}}', SCRAPE_TIMEOUT_S)


@pytest.fixture(scope="module")
async def observed(tmp_path_factory, vllm_engine):
    tmp = tmp_path_factory.mktemp("observed")
    port = free_port()
    prometheus, api_port, why_not = start_prometheus(tmp, port)
    hold: asyncio.Task | None = None
    try:
        if prometheus is not None:
            await wait_ready(prometheus, api_port)
            await wait_scraping(api_port)  # "down" until the run serves /metrics
        run = f"e2e-obs-{uuid.uuid4().hex[:8]}"
        cfg = load_config(
            "configs/demo.toml",
            [
                f"run.output_dir={json.dumps(str(tmp / 'run'))}",
                f"run.max_steps={STEPS}",
                f"run.name={run}",
                f"run.metrics_port={port}",
                "rollout.max_model_len=256",
                "rollout.weight_load=pause",  # the gate hold_run_until_scraped holds (the default, said here)
                "grpo.log_entropy=true",  # the entropy panel's gauge is set only when it is logged
            ],
        )
        task = asyncio.create_task(graph.run_pipeline(cfg, engine=vllm_engine))
        scrape, health = "", None
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not task.done():  # the last scrape of the live endpoint that has training gauges in it
            if time.monotonic() > deadline:
                task.cancel()
                raise TimeoutError(f"the observed run did not finish in {RUN_TIMEOUT_S:.0f} s")
            try:
                status, body = await http_get(port, "/metrics")
                if status == 200 and hold is None and prometheus is not None:
                    # /metrics is served once the run's engine holds its start weights and before any
                    # optimizer step, so no load of version >= 1 has begun: the hold starts in time.
                    hold = asyncio.create_task(hold_run_until_scraped(vllm_engine, api_port, run))
                if status == 200 and f'rollstream_train_step{{run="{run}"}}' in body:
                    scrape = body
                    if health is None:  # mid-run; at the very end stopping stages are not ready
                        health = await http_get(port, "/healthz")
            except OSError:
                pass  # not listening yet, or closed at the end
            await asyncio.sleep(0.2)  # poll interval
        result = await task
        hold_error = ""
        if hold is not None:
            try:
                await hold
            except TimeoutError as e:
                hold_error = str(e)
        series: list[dict] = []
        names: list[str] = []
        targets: list[dict] = []
        if prometheus is not None:
            targets = (await api_get(api_port, "/api/v1/targets"))["data"]["activeTargets"]
            # Samples scraped during the run stay in the head block; poll until they are queryable.
            match = urllib.parse.quote(f'{{__name__=~"rollstream_.+",run="{run}"}}')
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not series:
                series = (await api_get(api_port, f"/api/v1/series?match[]={match}"))["data"]
                if not series:
                    await asyncio.sleep(0.5)  # poll interval
            names = (await api_get(api_port, "/api/v1/label/__name__/values"))["data"]
        yield {
            "run": run, "result": result, "scrape": scrape, "health": health,
            "series": series, "names": names, "prometheus": prometheus is not None, "why_not": why_not,
            "targets": [(t["health"], t["lastError"], t["lastScrapeDuration"]) for t in targets],
            "hold_error": hold_error,
        }
    finally:
        if hold is not None and not hold.done():
            hold.cancel()
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=30)


def samples(scrape: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(scrape):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# What this run's configuration cannot export, and why (tests/test_ops.py checks these names against
# pipeline/metrics.py): everything else the dashboard and the alert rules read must be in its scrape.
_BROADCAST = 'the weights group: rollout.weight_transport = "broadcast" only (this run: file)'
_AGENT = "an agent run (tools= or environment_factory) only"
_EVAL = "the evaluate stage: data.split_dataset_ratio > 0 only (this run: off)"
NOT_IN_THIS_RUN = {
    "rollstream_weight_group_members": _BROADCAST,
    "rollstream_weight_group_epoch": _BROADCAST,
    "rollstream_weight_round_seconds_bucket": _BROADCAST,
    "rollstream_weight_round_bytes_per_second": _BROADCAST,
    "rollstream_weight_rounds_failed_total": _BROADCAST + ", from its first failure",
    "rollstream_weight_member_errors_total": _BROADCAST + ", from its first failure",
    "rollstream_eval_reward": _EVAL,
    "rollstream_eval_reward_func_mean": _EVAL,
    "rollstream_eval_pass_at_k": _EVAL,
    "rollstream_eval_runtime": _EVAL,
    "rollstream_eval_policy_version": _EVAL,
    "rollstream_eval_skipped_versions_total": _EVAL,
    "rollstream_eval_failed_total": _EVAL,
    "rollstream_train_cispo_clip_ratio": 'grpo.loss_type = "cispo" only',
    "rollstream_train_off_policy_sequence_mask_dropped_token_ratio": "grpo.off_policy_sequence_mask_delta set only",
    # An agent run's (tools= / environment_factory); serially, an earlier agent test in this process had
    # registered them, so this test passed only in that order.
    "rollstream_train_tools_call_frequency": _AGENT,
    "rollstream_train_tools_failure_frequency": _AGENT,
    "rollstream_train_tools_template_rewrite_frequency": _AGENT,
    "rollstream_train_agent_branch_frequency": _AGENT,
}


def test_every_metric_the_ops_files_read_is_exported(observed) -> None:
    assert observed["result"].exit_code == 0
    assert observed["scrape"], "the run never served /metrics with training gauges"
    exported = {name for name, _ in samples(observed["scrape"])}
    wanted = {n for n in promql.all_metric_names() if n.startswith("rollstream_")}
    assert len(wanted) >= 40
    assert set(NOT_IN_THIS_RUN) <= wanted  # the table names only what the ops files read
    assert wanted - set(NOT_IN_THIS_RUN) - exported == set()


def test_training_gauges_equal_the_metrics_row_of_that_step(observed) -> None:
    run = observed["run"]
    values = samples(observed["scrape"])

    def gauge(name: str, **labels: str) -> float:
        return values[(name, tuple(sorted({"run": run, **labels}.items())))]

    step = int(gauge("rollstream_train_step"))
    rows = [json.loads(line) for line in (observed["result"].output_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["step"] == step)
    assert gauge("rollstream_train_reward") == pytest.approx(row["reward"])
    assert gauge("rollstream_train_reward_func_mean", reward="accuracy") == pytest.approx(row["rewards/accuracy/mean"])
    assert gauge("rollstream_train_reward_func_mean", reward="format") == pytest.approx(row["rewards/format/mean"])
    assert gauge("rollstream_train_kl") == pytest.approx(row["kl"])
    assert gauge("rollstream_train_entropy_mean") == pytest.approx(row["entropy/mean"])
    assert gauge("rollstream_train_tokens_per_second") == pytest.approx(row["tokens_per_second"])
    assert row["tokens_per_second"] > 0
    assert gauge("rollstream_max_staleness") == 1
    assert gauge("rollstream_train_nan_skipped_total") == 0
    tokens = sum(v for (name, _), v in values.items() if name == "rollstream_tokens_generated_total")
    assert tokens > 0
    turns = sum(v for (name, _), v in values.items() if name == "rollstream_rollout_turns_count")
    assert turns > 0  # one observation per trajectory generated so far


def test_healthz_reports_readiness_and_last_progress(observed) -> None:
    status, body = observed["health"]
    state = json.loads(body)
    assert status == 200 and state["ready"] is True
    assert set(state["stages"]) == {"feeder", "rollout", "reward", "advantage", "learner"}
    assert 0 < time.time() - state["last_progress"] < 600


def test_prometheus_scraped_the_run(observed) -> None:
    if not observed["prometheus"]:
        pytest.skip(observed["why_not"])
    names = {s["__name__"] for s in observed["series"]}
    assert names, f"Prometheus holds no series of the run; its target: {observed['targets']} {observed['hold_error']}"
    assert {"rollstream_train_step", "rollstream_learner_version", "rollstream_records_in_total"} <= names
    assert all(s["run"] == observed["run"] and s["job"] == "rollstream-train" for s in observed["series"])
    # Every name the dashboard and alerts read, `up` included, is one Prometheus now knows (but for those
    # this run's configuration cannot export).
    assert promql.all_metric_names() - set(NOT_IN_THIS_RUN) - set(observed["names"]) == set()


def test_train_leaves_plot_config_and_dead_letters(observed) -> None:
    out = observed["result"].output_dir
    assert (out / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = plot.figure(plot.read_rows(out))
    assert [ax.get_title() for ax in fig.axes] == list(plot.PANEL_TITLES)
    info = inspect_run.from_run_dir(out, last=3)
    assert len(info["completions"]) == 3 and set(info["completions"][0]["rewards"]) == {"accuracy", "format"}
    assert info["dead_letters"] == []
    assert f'name = "{observed["run"]}"' in info["config"]
