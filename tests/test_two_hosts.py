"""Two hosts for real (tests/netns.py): the learner, feeder and advantage workers on host "a" with a private
output_dir, the rollout and reward workers on host "b" with another; Redis on a, reached over the veth
pair; no directory one host writes is visible on the other.

- weight_transport = "file": the rollout worker cannot read the learner's snapshot path and must fail
  loudly (a non-zero exit, soon), never stall at version 0;
- weight_transport = "broadcast" (gloo over the veth pair): the run completes, the ledger is clean, every
  trajectory was sampled with one version only, and the engine's log-probs after each sync equal the
  learner's;
- the same with the rollout worker SIGKILLed mid-run (the worker alone): its vLLM engine core is gone
  within seconds, a restarted worker joins the group and the run completes, the ledger still clean.

The namespace tests are marked ``slow`` (``make test`` runs them; ``-m 'not slow'`` skips them). The
output_dir rules every multi-host run depends on are checked here too, without namespaces.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from netns import (  # noqa: F401  (the two_hosts fixture)
    BROADCAST,
    CONFIG,
    STEPS,
    check_clean_run,
    finish,
    start_split,
    two_hosts_fixture,
)
from polling import wait_until
from procs import WorkerProcess, spawn_logged

from pipeline.records import trajectories_in
from pipeline.run_dir import edge_tail
from pipeline.transport import connect
from pipeline.transport.base import newest_record
from stages import TRAJECTORIES, WEIGHTS

PUBLISH_DEADLINE_S = 300  # engine start (10-60 s on a loaded 2-core machine) + one batch + the first publish
FAIL_DEADLINE_S = 60  # from the learner's version 1 to the rollout worker's exit


@pytest.mark.slow
async def test_file_sync_without_a_shared_directory_fails_loudly(two_hosts):
    """Host b cannot see host a's snapshots: its rollout worker must exit with an error (the path and the
    fix in its log) once the learner publishes version 1, instead of sampling at version 0 until every
    prompt times out."""
    run = f"two-hosts-file-{uuid.uuid4().hex[:6]}"
    a, b = await start_split(two_hosts, run, 'rollout.weight_transport="file"')
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
        # 2: the CLI's exit for an error the user must fix (WeightsUnavailable: the path and the fix), not a crash.
        assert rollout.process.returncode == 2, b.log("rollout-0")
    finally:
        await transport.close()
        for workers in (a, b):
            await workers.stop_all()


RUN_DEADLINE_S = 420  # engine start + 4 generation batches, each waiting for its broadcast (max_staleness 0)
ORPHAN_DEADLINE_S = 5.0
KILL_STEPS = 24  # 12 generation batches
RECOVER_DEADLINE_S = 240  # from the kill to the run's end: a restarted engine, 10 batches left


@pytest.mark.slow
async def test_broadcast_across_hosts_completes_with_the_learners_weights(two_hosts):
    run = f"two-hosts-bc-{uuid.uuid4().hex[:6]}"
    a, b = await start_split(two_hosts, run, *BROADCAST)
    try:
        await finish({"a": a, "b": b}, time.monotonic() + RUN_DEADLINE_S)
        await check_clean_run(two_hosts, run)
    finally:
        for workers in (a, b):
            await workers.stop_all()


@pytest.mark.slow
async def test_lora_adapters_cross_hosts_as_redis_blobs(two_hosts):
    """weight_transport = "lora" without a shared directory: host b cannot see host a's adapter snapshots,
    so it loads each from the blob the learner stored in Redis (WeightsPublished.blob), and the run
    completes with the learner's adapters (at max_staleness 0, sampling log-probs equal the learner's)."""
    run = f"two-hosts-lora-{uuid.uuid4().hex[:6]}"
    lora = ("learner.train_type=lora", 'rollout.weight_transport="lora"', "grpo.max_staleness=0",
            "data.split_dataset_ratio=0.05", "eval.eval_limit=2", "eval.eval_steps=2")
    a, b = await start_split(two_hosts, run, *lora)
    await b.start("evaluate")  # its own engine on host b: the adapters from the blobs too
    try:
        await finish({"a": a, "b": b}, time.monotonic() + RUN_DEADLINE_S)
        await check_clean_run(two_hosts, run, via="lora")
        assert not (two_hosts.private["b"] / "out" / "weights").exists()  # nothing written on b's side
        evaluated = [json.loads(line) for line in (two_hosts.private["b"] / "out" / "metrics.jsonl").open()]
        assert STEPS // 2 in [row["policy_version"] for row in evaluated]  # the final version, from its blob
    finally:
        for workers in (a, b):
            await workers.stop_all()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
async def test_a_sigkilled_rollout_host_worker_leaves_no_engine_and_the_run_recovers(two_hosts):
    run = f"two-hosts-kill-{uuid.uuid4().hex[:6]}"
    # Longer than the others: after the kill, batches are left for the restarted worker (4 run in seconds).
    a, b = await start_split(two_hosts, run, *BROADCAST, f"run.max_steps={KILL_STEPS}")
    transport = await connect("redis", run=run, url=two_hosts.test_url)
    try:

        async def sampling_with_broadcast_weights() -> bool:
            assert not a.failed() and not b.failed(), a.log("learner-0") + b.log("rollout-0")
            trajectories = trajectories_in(await edge_tail(transport, TRAJECTORIES, None))
            return any(t.policy_version >= 1 for t in trajectories)

        # Mid-run: the rollout samples with version 1 (received by broadcast); 10 batches are still to come.
        await wait_until(sampling_with_broadcast_weights, "a trajectory of version 1", RUN_DEADLINE_S, 0.5)
        worker = b.running.pop("rollout-0")
        engines = _children(worker.process.pid)
        assert engines, "the rollout worker has no engine-core process"
        os.kill(worker.process.pid, signal.SIGKILL)  # the worker alone: its engine core must follow by itself
        b.exited.append(("rollout-0", await worker.process.wait()))
        killed_at = time.monotonic()
        await wait_until(
            lambda: not any(alive(p) for p in engines),
            "the engine core to die with its worker",
            ORPHAN_DEADLINE_S,
            0.05,
        )
        print(f"TWO-HOSTS engine core gone {time.monotonic() - killed_at:.2f} s after its worker")
        await b.start("rollout")  # a new member: the learner rebuilds the group between rounds
        await finish({"a": a, "b": b}, time.monotonic() + RECOVER_DEADLINE_S)
        await check_clean_run(two_hosts, run, KILL_STEPS)
    finally:
        await transport.close()
        for workers in (a, b):
            await workers.stop_all()


def _children(pid: int) -> list[int]:
    """A process's children (the vLLM engine core of a rollout worker), multiprocessing's resource tracker
    left out."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
    return found


# ------------------------------------------------------------------------------------------------------
# What every multi-host run depends on, without namespaces.


def test_a_run_over_redis_needs_a_named_output_dir_and_makes_it_absolute(monkeypatch, tmp_path):
    from config import ConfigError, load_config, resolve_output_dir

    unnamed = load_config(CONFIG, ['run.output_dir=""'])
    with pytest.raises(
        ConfigError, match=r'run.output_dir is empty with transport.kind = "redis".*set run.output_dir'
    ):
        resolve_output_dir(unnamed)
    procfile_run, single_run = load_config(CONFIG, []), load_config("configs/demo.toml", [])
    monkeypatch.chdir(tmp_path)
    assert (
        resolve_output_dir(procfile_run) == tmp_path / "runs" / "demo-redis"
    )  # as the Procfile's workers share it
    # One process: the memory transport keeps the relative, time-stamped default.
    single = resolve_output_dir(single_run)
    assert not single.is_absolute() and single.name.startswith("demo-")


@pytest.mark.slow
async def test_a_sigkilled_learner_resumes_and_sends_its_restored_weights_across_hosts(two_hosts):
    """The learner (host a) SIGKILLed past its first checkpoint, restarted with --resume: it opens a new
    group epoch, sends its restored weights to host b, and the run ends as if nothing happened (the steps
    continue without a gap or a repeat, the ledger is clean, no trajectory mixes versions)."""
    from trainer import checkpoint as checkpoints

    run = f"two-hosts-resume-{uuid.uuid4().hex[:6]}"
    a, b = await start_split(
        two_hosts, run, *BROADCAST, f"run.max_steps={KILL_STEPS}", "learner.save_steps=4"
    )
    out = two_hosts.private["a"] / "out"
    try:

        def past_a_checkpoint() -> bool:
            assert not a.failed() and not b.failed(), a.log("learner-0") + b.log("rollout-0")
            metrics = out / "metrics.jsonl"
            steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            return bool(checkpoints.listed(out)) and steps > 4

        await wait_until(past_a_checkpoint, "a step past the first checkpoint", RUN_DEADLINE_S, 0.2)
        learner = a.running.pop("learner-0")
        os.killpg(learner.process.pid, signal.SIGKILL)
        a.exited.append(("learner-0", await learner.process.wait()))
        argv = [
            *a.command,
            "learner",
            "-c",
            a.config,
            "--worker-id",
            f"learner-0-{len(a.exited)}",
            "--resume",
        ]
        for setting in a.settings:
            argv += ["--set", setting]
        process = await spawn_logged(argv, a.log_dir / "learner-0.log")
        a.running["learner-0"] = WorkerProcess("learner", 0, process, f"learner-0-{len(a.exited)}")
        await finish({"a": a, "b": b}, time.monotonic() + RECOVER_DEADLINE_S)
        await check_clean_run(two_hosts, run, KILL_STEPS, restarted_learner=True)
    finally:
        for workers in (a, b):
            await workers.stop_all()
