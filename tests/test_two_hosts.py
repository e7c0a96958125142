"""Two hosts for real (tests/netns.py): the learner, feeder and advantage workers on host "a" with a private
output_dir, the rollout and reward workers on host "b" with another; Redis on a, reached over the veth
pair; no directory one host writes is visible on the other.

- weight_sync_mode = "file": the rollout worker cannot read the learner's snapshot path and must fail
  loudly (a non-zero exit, soon), never stall at version 0;

Marked ``slow`` (``make test`` runs it; ``-m 'not slow'`` skips it).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest
from netns import TwoHosts, two_hosts_fixture  # noqa: F401  (the two_hosts fixture)
from procs import Workers

from pipeline.transport import connect
from pipeline.transport.base import newest_record
from stages import WEIGHTS

pytestmark = pytest.mark.slow

CONFIG = "configs/demo-redis.toml"
STEPS = 8  # 4 generation batches of 2 groups x 8 completions, 2 optimizer steps each
PUBLISH_DEADLINE_S = 300  # engine start (10-60 s on a loaded 2-core machine) + one batch + the first publish
FAIL_DEADLINE_S = 60  # from the learner's version 1 to the rollout worker's exit


def run_settings(run: str, hosts: TwoHosts, host: str, *extra: str) -> list[str]:
    return [
        f"run.name={run}",
        f"run.output_dir={json.dumps(str(hosts.private[host] / 'out'))}",
        "run.metrics_port=0",
        "run.ledger=true",
        "run.log_level=warning",
        f"run.max_steps={STEPS}",
        "grpo.num_generations=8",
        "grpo.generation_batch_size=16",
        "grpo.per_device_train_batch_size=8",
        "rollout.max_model_len=256",
        "rollout.engine_threads=1",
        f"transport.url={hosts.url}",
        "transport.min_idle_ms=3000",
        *extra,
    ]


async def start_split(hosts: TwoHosts, run: str, *extra: str) -> tuple[Workers, Workers]:
    """The learner side on a, the rollout side on b."""
    a = hosts.workers_on("a", CONFIG, run_settings(run, hosts, "a", *extra))
    b = hosts.workers_on("b", CONFIG, run_settings(run, hosts, "b", *extra))
    await a.start("learner")
    await a.start("advantage")
    await b.start("rollout")
    await b.start("reward")
    await a.start("feeder")
    return a, b


async def test_file_sync_without_a_shared_directory_fails_loudly(two_hosts):
    """Host b cannot see host a's snapshots: its rollout worker must exit with an error (the path and the
    fix in its log) once the learner publishes version 1, instead of sampling at version 0 until every
    prompt times out."""
    run = f"two-hosts-file-{uuid.uuid4().hex[:6]}"
    a, b = await start_split(two_hosts, run, 'rollout.weight_sync_mode="file"')
    transport = await connect("redis", run=run, url=two_hosts.test_url)
    try:
        rollout = b.running["rollout-0"]
        deadline = time.monotonic() + PUBLISH_DEADLINE_S
        published = False
        while rollout.process.returncode is None:
            for workers, name in ((a, "learner-0"), (b, "reward-0")):
                code = workers.running[name].process.returncode
                assert code is None, f"{name} exited {code} first:\n{workers.log(name)}"
            newest = await newest_record(transport, WEIGHTS)
            if not published and newest is not None and newest.version >= 1:
                published, deadline = True, time.monotonic() + FAIL_DEADLINE_S
            if time.monotonic() > deadline:
                what = (
                    f"{FAIL_DEADLINE_S} s after version 1"
                    if published
                    else f"{PUBLISH_DEADLINE_S} s (no version 1)"
                )
                pytest.fail(
                    f"the rollout worker on host b did not fail within {what}: a silent stall:\n{b.log('rollout-0')}"
                )
            await asyncio.sleep(0.5)  # polling other processes' progress, with a deadline
        assert published, (
            f"the rollout worker exited before any snapshot was published:\n{b.log('rollout-0')}"
        )
        assert rollout.process.returncode != 0, b.log("rollout-0")
    finally:
        await transport.close()
        for workers in (a, b):
            await workers.stop_all()
