"""A learner run as its own Redis worker, SIGKILLed after its first checkpoint and restarted with
`rollstream worker learner --resume latest`: the run finishes with steps continuing, no TrainGroup trained
twice, none lost, and nothing left pending. And SIGTERMed: it finishes the batch in flight, checkpoints
what it trained, acks it, exits 0 within its grace period, and its resume retrains nothing.

A restarted learner numbers its versions after every one its predecessor put out (a number never names
two different weights). The five stage workers are subprocesses, as the Procfile starts them. The learner is killed once it has
trained a generation batch past its checkpoint, so the resume must retrain exactly that batch: its
TrainGroups were held (pending), not acked, because no checkpoint covered them yet.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from procs import kill_spawned, spawn_logged

from pipeline import ledger
from pipeline.records import Feedback, TrainGroup, decode
from pipeline.transport import connect
from stages import CONSUMER_GROUPS, FEEDBACK, STAGE_NAMES, TRAIN
from stages.learner import ISSUED_FILE
from trainer import checkpoint as checkpoints

pytestmark = pytest.mark.e2e

STEPS = 20  # 5 generation batches of 32 completions (4 prompt groups), 4 optimizer steps each
SETTINGS = [
    f"run.max_steps={STEPS}",
    "run.metrics_port=0",
    "grpo.generation_batch_size=32",
    "grpo.per_device_train_batch_size=8",
    "learner.save_steps=8",
    "rollout.max_model_len=256",
    "transport.min_idle_ms=2000",  # another worker reclaims a dead one's pending entries after 2 s
]
# The restarted learner takes over the killed one's pending groups as it starts (Stage.takes_over_at_start),
# not after min_idle_ms: with min_idle_ms far past the run, the run can only finish if it does.
NEVER_IDLE_ENOUGH = "transport.min_idle_ms=600000"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def start_worker(stage: str, settings: list[str], log: Path, *extra: str) -> asyncio.subprocess.Process:
    command = [sys.executable, "-m", "rollstream.cli", "worker", stage, "-c", "configs/demo-redis.toml", *extra]
    for setting in settings:
        command += ["--set", setting]
    return await spawn_logged(command, log)


async def wait_for(condition, processes: dict, logs: Path, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        exited = {name: p.returncode for name, p in processes.items() if p.returncode not in (None, 0)}
        if exited:
            pytest.fail(f"workers failed {exited} while waiting for {what}:\n{tails(logs)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {seconds} s:\n{tails(logs)}")
        await asyncio.sleep(0.05)  # polling files other processes write, with a deadline


def tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.log")))


async def edge_entries(transport, edge: str) -> list:
    entries, after = [], "0"
    while batch := await transport.read(edge, after, 500, 0):
        entries += [decode(d.payload) for d in batch]
        after = batch[-1].id
    return entries


async def resume_learner_and_finish(processes: dict, settings: list[str], logs: Path) -> None:
    """Restart the learner with ``--resume latest`` and wait until every worker has exited 0."""
    processes["learner"] = await start_worker("learner", settings, logs / "learner.log", "--resume", "latest")
    await wait_for(
        lambda: all(p.returncode is not None for p in processes.values()),
        processes,
        logs,
        400,
        "end of the run",
    )
    assert {name: p.returncode for name, p in processes.items()} == dict.fromkeys(STAGE_NAMES, 0), tails(logs)


async def test_sigkilled_learner_worker_resumes_without_retraining_or_losing_a_group(tmp_path, redis_url):
    run, out = f"learner-resume-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    settings = [
        f"run.name={run}",
        f"run.output_dir={json.dumps(str(out))}",
        f"transport.url={redis_url}",
        *SETTINGS,
        NEVER_IDLE_ENOUGH,
    ]
    processes = {
        stage: await start_worker(stage, settings, tmp_path / f"{stage}.log") for stage in STAGE_NAMES
    }
    transport = await connect("redis", run=run, url=redis_url)
    try:
        # Kill the learner once it has trained past its first checkpoint (a batch no checkpoint covers).
        await wait_for(
            lambda: (
                checkpoints.listed(out)
                and max((r["step"] for r in rows(out / "metrics.jsonl")), default=0) > 8
            ),
            processes,
            tmp_path,
            400,
            "step 9",
        )
        os.killpg(processes["learner"].pid, signal.SIGKILL)
        await asyncio.wait_for(processes["learner"].wait(), timeout=60)
        killed_at = checkpoints.latest(out)
        trained_before_kill = max(r["step"] for r in rows(out / "metrics.jsonl"))
        issued = json.loads((out / ISSUED_FILE).read_text())  # the newest version the killed learner put out
        assert issued["run"] == run and issued["version"] >= 3
        assert killed_at.step == 8 < trained_before_kill < STEPS
        held = (await transport.stats(TRAIN, CONSUMER_GROUPS[TRAIN])).pending
        assert held >= 4  # the batch trained after the checkpoint is still pending, not acked

        await resume_learner_and_finish(processes, settings, tmp_path)

        metrics = rows(out / "metrics.jsonl")
        assert [r["step"] for r in metrics] == list(
            range(1, STEPS + 1)
        )  # steps continue: none lost, none twice
        # Versions never repeat: the resumed learner's restored weights (those of version 2) are version
        # issued + 1, so samples of the killed learner's lost versions are as stale as their numbers say.
        resumed = issued["version"] + 1
        assert [r["policy_version"] for r in metrics] == [1] * 4 + [2] * 4 + [
            resumed + 1 + (s - 9) // 4 for s in range(9, STEPS + 1)
        ]
        completions = rows(out / "completions.jsonl")
        requests = Counter(c["request_id"] for c in completions)
        assert set(requests.values()) == {1}, "a trajectory was trained twice"
        assert Counter(c["generation_batch"] for c in completions) == {b: 32 for b in range(STEPS // 4)}
        # No group lost: every TrainGroup the advantage worker produced was trained or dropped with a reason.
        trained = {(c["prompt_id"], c["attempt"]) for c in completions}
        dropped = {
            (f.prompt_id, f.attempt)
            for f in await edge_entries(transport, FEEDBACK)
            if isinstance(f, Feedback) and f.outcome == "dropped"
        }
        produced = {
            (g.prompt_id, g.attempt)
            for g in await edge_entries(transport, TRAIN)
            if isinstance(g, TrainGroup)
        }
        assert produced and produced <= trained | dropped, produced - trained - dropped
        for edge, group in CONSUMER_GROUPS.items():  # nothing left pending anywhere
            assert (await transport.stats(edge, group)).pending == 0, edge
        assert checkpoints.latest(out).step == STEPS and (out / "final" / "model.safetensors").exists()
    finally:
        await kill_spawned(processes.values())
        await transport.delete_run()
        await transport.close()


GRACE_S = 60  # the learner's drain: the batch in flight (seconds on 2 cores), a checkpoint, the acks


async def test_sigtermed_learner_worker_finishes_its_batch_checkpoints_and_resumes_without_retraining(
    tmp_path, redis_url
):
    run, out = f"learner-sigterm-{uuid.uuid4().hex[:6]}", tmp_path / "run"
    settings = [
        f"run.name={run}",
        f"run.output_dir={json.dumps(str(out))}",
        f"transport.url={redis_url}",
        "run.ledger=true",
        *SETTINGS,
        # No periodic checkpoint before the SIGTERM: trained groups are held, and only the drain's
        # checkpoint lets the resumed learner continue (none at all otherwise) and those groups be acked.
        "learner.save_steps=1000",
    ]
    processes = {
        stage: await start_worker(stage, settings, tmp_path / f"{stage}.log") for stage in STAGE_NAMES
    }
    transport = await connect("redis", run=run, url=redis_url)
    try:
        await wait_for(
            lambda: max((r["step"] for r in rows(out / "metrics.jsonl")), default=0) >= 4,
            processes,
            tmp_path,
            400,
            "the first generation batch trained",
        )
        began = time.monotonic()
        processes["learner"].send_signal(signal.SIGTERM)  # the worker process alone, as systemd/Kubernetes
        code = await asyncio.wait_for(processes["learner"].wait(), timeout=GRACE_S)
        drained_s = time.monotonic() - began
        assert code == 0, tails(tmp_path)
        trained = max(r["step"] for r in rows(out / "metrics.jsonl"))
        assert trained % 4 == 0 and trained < STEPS  # whole generation batches: the one in flight finished
        drained = checkpoints.latest(out)
        assert drained is not None and drained.step == trained, "the drain did not checkpoint what it trained"
        # ... and acked every group it trained (with the checkpoint's outputs), none left for a retrain.
        entries, _dead = await ledger.read_transport(transport)
        learner_steps = [e for e in entries if e.stage == "learner"]
        acked = {group for e in learner_steps for group in e.acked}
        trained_groups = {
            ledger.group_of(o.record_id) for e in learner_steps for o in e.outputs if o.outcome == "trained"
        }
        # 4 groups of 8 per generation batch, 4 optimizer steps each: as many groups as steps
        assert len(trained_groups) == trained and trained_groups <= acked, trained_groups - acked

        await resume_learner_and_finish(processes, settings, tmp_path)
        assert [r["step"] for r in rows(out / "metrics.jsonl")] == list(range(1, STEPS + 1))
        # The ledger proves it: every released group trained once or dropped with a reason, none twice.
        audit = ledger.check(*await ledger.read_transport(transport))
        assert audit.ok, ledger.format_audit(audit)
        assert audit.trained == STEPS // 4 * 4 and audit.counts()["duplicated"] == 0
        for edge, group in CONSUMER_GROUPS.items():  # nothing left pending anywhere
            assert (await transport.stats(edge, group)).pending == 0, edge
        print(
            "LEARNER_SIGTERM " + json.dumps({"drain_seconds": round(drained_s, 1), "steps_before": trained})
        )
    finally:
        await kill_spawned(processes.values())
        await transport.delete_run()
        await transport.close()
