"""Failover mid-run: the Procfile's workers as real processes (as tests/test_chaos.py) over a Sentinel set on
loopback (a primary, two replicas, three sentinels: tests/sentinels.py), ``transport.min_replicas_acked = 1``.
The primary is SIGKILLed while the run trains; the sentinels promote a replica, every worker follows it, the
run finishes, and the ledger (read through the sentinel url, as an operator would) is exact.

Marked ``slow``. Prints its figures as one JSON line (``FAILOVER_RUN {...}``) for docs/sentinel.md.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from polling import wait_until
from procs import Workers, rollstream_cli
from sentinels import SentinelSet
from test_chaos import (
    _at_least,
    finish_run,
    learner_version,
    ledger_check,
    parse_counts,
    settings,
    start_pipeline,
    until,
)

from pipeline.transport import connect

pytestmark = pytest.mark.slow

BATCHES = 8  # generation batches of 4 groups x 8 completions (test_chaos's shape), 2 optimizer steps each
GROUPS_PER_BATCH = 4
NUM_GENERATIONS = 8
RUN_DEADLINE_S = 600


async def test_a_sigkill_of_the_redis_primary_mid_run_loses_nothing_and_trains_nothing_twice(tmp_path):
    cluster = SentinelSet(tmp_path / "sentinel", down_after_ms=1000)
    cluster.start()
    run = f"failover-{uuid.uuid4().hex[:6]}"
    run_settings = settings(
        run, tmp_path / "out", cluster.url, f"run.max_steps={BATCHES * 2}", "transport.min_replicas_acked=1"
    )
    workers = Workers("configs/demo-redis.toml", run_settings, tmp_path / "logs")
    transport = await connect("redis", run=run, url=cluster.url)
    started = time.monotonic()
    deadline = started + RUN_DEADLINE_S
    try:
        await start_pipeline(workers, copies=1)
        # Mid-run: weights out (the learner has trained) and records in flight on every edge.
        await until(lambda: _at_least(transport, 2), deadline, workers, "the second trained batch")
        version_at_kill = await learner_version(transport)
        old = cluster.primary.port
        cluster.primary.kill()
        killed_at = time.monotonic()
        await wait_until(lambda: cluster.primary_port() not in (None, old), "a promoted replica", timeout_s=60)
        promoted_at = time.monotonic()
        await until(
            lambda: _at_least(transport, version_at_kill + 1), deadline, workers, "training to go on after the failover"
        )
        trained_again_at = time.monotonic()
        await finish_run(workers, transport, deadline)
        code, report = await ledger_check(cluster.url, run)
        assert code == 0, report
        counts = parse_counts(report)
        assert counts["lost"] == 0 and counts["duplicated"] == 0, report
        assert counts["trained"] == BATCHES * GROUPS_PER_BATCH, report
        assert counts["records_trained"] == BATCHES * GROUPS_PER_BATCH * NUM_GENERATIONS, report
        code, shown = await rollstream_cli("inspect", "--redis", cluster.url, "--run", run)
        assert code == 0 and "dead letters: none" in shown, shown
        figures = {
            "version_at_kill": version_at_kill,
            "promoted_s": round(promoted_at - killed_at, 2),
            "next_version_s": round(trained_again_at - killed_at, 2),
            "ledger": report.splitlines()[1],
            **counts,
            "seconds": round(time.monotonic() - started, 1),
        }
        print("FAILOVER_RUN " + json.dumps(figures))
    finally:
        await workers.stop_all()
        await transport.close()
        cluster.stop()
