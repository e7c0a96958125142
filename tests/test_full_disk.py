"""A full disk under the learner's output_dir (issue #36 part 4).

A real tmpfs, small enough to fill, holds ``run.output_dir``; a real learner worker (the tiny model, the Redis
transport, ``run.ledger = true``) trains one generation batch, then the disk is filled so that the next
batch's checkpoint / weights snapshot / completions.jsonl rows do not fit. The learner must stop with an
``OutputWriteError`` naming the path (the CLI prints it as one line, exit 2), leave the previous checkpoint
intact and loadable and no temp directory behind, keep the batch's TrainGroups unacked, and, once space is
freed, ``--resume latest`` finishes the run with the ledger exact: every group trained once, none lost.

The test plays the stages upstream of the learner: it writes their TrainGroups to the train edge and their
ledger entries (the feeder's release, the rollout's manifest, the advantage stage's TrainGroup), so the audit
is the same one a whole run gets. Unit tests of the atomic-write helpers run on the same kind of tmpfs.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from config import load_config
from pipeline import ledger
from pipeline.edges import PROMPTS, TRAIN, TRAJECTORIES
from pipeline.errors import UserError
from pipeline.records import (
    GroupClosed,
    PromptTask,
    ScoredTrajectory,
    TrainGroup,
    Trajectory,
    encode,
    pack_f32,
    pack_i32,
)
from pipeline.run_dir import OutputWriteError, atomic_dir, atomic_write_text
from pipeline.stage import FatalStageError
from pipeline.transport.base import ledger_edge

MIB = 2**20
GENERATIONS, GROUPS_PER_BATCH, BATCHES = 4, 2, 3
PROMPT_TEXT = "x" * 120_000  # completions.jsonl carries it twice per row: ~1.9 MiB per batch, more than a snapshot


def _mount(path: Path, size_mib: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {result.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """``mount(size_mib)``: a fresh tmpfs of that size under tmp_path, unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size_mib: int) -> Path:
        path = tmp_path / f"disk{len(mounted)}"
        _mount(path, size_mib)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def free_bytes(path: Path) -> int:
    s = os.statvfs(path)
    return s.f_bavail * s.f_frsize


def fill(disk: Path, leave: int) -> Path:
    """A filler file that leaves ``leave`` bytes free (to a page); delete it to free the space again."""
    filler = disk / "filler"
    size = max(0, free_bytes(disk) - leave) // 4096 * 4096
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    return filler


def allocated(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- the atomic-write helpers


def test_atomic_write_text_that_fails_leaves_the_old_file_and_no_temp(small_disk):
    disk = small_disk(1)
    target = disk / "state.json"
    atomic_write_text(target, "old")
    fill(disk, leave=0)
    with pytest.raises(OutputWriteError) as failed:
        atomic_write_text(target, "y" * 64 * 1024)
    assert failed.value.errno == errno.ENOSPC and failed.value.path == target
    assert str(target) in str(failed.value) and "--resume" in str(failed.value)
    # the CLI prints a UserError as one line (exit 2); the worker neither retries nor dead-letters a fatal one
    assert isinstance(failed.value, UserError) and isinstance(failed.value, FatalStageError)
    assert target.read_text() == "old"
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "state.json"]  # no temp file left


def test_atomic_dir_that_fails_leaves_the_old_directory_and_gives_the_space_back(small_disk):
    disk = small_disk(2)
    final = disk / "checkpoint-1"
    with atomic_dir(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"a" * 1000)
    free_before = free_bytes(disk)
    with pytest.raises(OutputWriteError) as failed, atomic_dir(final) as tmp:
        (tmp / "small").write_bytes(b"b" * 1000)
        (tmp / "model.safetensors").write_bytes(b"b" * 3 * MIB)  # more than the disk holds
    assert failed.value.errno == errno.ENOSPC and failed.value.path == final
    assert (final / "model.safetensors").read_bytes() == b"a" * 1000 and not (final / "small").exists()
    assert [p.name for p in disk.iterdir()] == ["checkpoint-1"]  # the temp directory is gone ...
    assert free_bytes(disk) == free_before  # ... with its space

    with atomic_dir(final) as tmp:  # the same name again: replaced whole
        (tmp / "model.safetensors").write_bytes(b"c" * 10)
    assert [p.name for p in final.iterdir()] == ["model.safetensors"]
    assert (final / "model.safetensors").read_bytes() == b"c" * 10
    assert [p.name for p in disk.iterdir()] == ["checkpoint-1"]


def test_atomic_dir_whose_writer_raises_its_own_error_leaves_nothing(tmp_path):
    with pytest.raises(OutputWriteError) as failed, atomic_dir(tmp_path / "v000001") as tmp:
        (tmp / "half").write_bytes(b"x")
        raise ValueError("the writer failed")
    assert failed.value.errno is None and isinstance(failed.value.__cause__, ValueError)  # not put down to space
    assert list(tmp_path.iterdir()) == []


def test_torch_save_onto_a_full_disk_is_named_a_full_disk(small_disk):
    """torch.save reports ENOSPC as a RuntimeError ("unexpected pos"), safetensors as a SafetensorError:
    neither is an OSError, and a retry of the learner's record after training would ack it untrained-in."""
    import torch
    from safetensors.torch import save_file

    disk = small_disk(1)
    weights = {"w": torch.zeros(512, 1024)}  # 2 MiB
    for name, save in (("optimizer.pt", torch.save), ("model.safetensors", save_file)):
        with pytest.raises(OutputWriteError) as failed, atomic_dir(disk / "checkpoint-1") as tmp:
            save(weights, str(tmp / name))
        assert failed.value.errno == errno.ENOSPC, failed.value
        assert list(disk.iterdir()) == []


# ----------------------------------------------------------------------------- a learner on a full disk


def tiny_vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def upstream_of_batch(batch: int, vocab: int) -> tuple[list[TrainGroup], list]:
    """One generation batch's TrainGroups and the upstream stages' ledger entries for them."""
    rng = np.random.default_rng(batch)
    groups, entries = [], []
    for g in range(GROUPS_PER_BATCH):
        prompt_id = f"e0:{batch * GROUPS_PER_BATCH + g}"
        messages = [{"role": "user", "content": PROMPT_TEXT}]
        records = []
        for i in range(GENERATIONS):
            completion = rng.integers(1, vocab, size=6)
            t = Trajectory(prompt_id=prompt_id, attempt=0, request_id=f"{prompt_id}/0/{i}", generation_batch=batch,
                           prompt_ids=pack_i32(rng.integers(1, vocab, size=8)), completion_ids=pack_i32(completion),
                           logprobs=pack_f32(np.full(len(completion), -2.0)), messages=messages,
                           completion=f"answer {i}", policy_version=0, max_policy_version=0)
            records.append(ScoredTrajectory(trajectory=t, rewards={"accuracy": float(i % 2)}, reward=float(i % 2)))
        group = TrainGroup(prompt_id=prompt_id, attempt=0, generation_batch=batch, records=records,
                           advantages=[1.0, -1.0, 0.5, -0.5])
        task = PromptTask(prompt_id=prompt_id, generation_batch=batch, num_generations=GENERATIONS, messages=messages)
        manifest = GroupClosed(prompt_id=prompt_id, attempt=0, generation_batch=batch,
                               record_ids=[r.record_id for r in records])
        entries += [
            ("feeder", ledger.entry("feeder", "test", [], [(PROMPTS, task)])),
            ("rollout", ledger.entry("rollout", "test", [task.record_id], [(TRAJECTORIES, manifest)])),
            ("advantage", ledger.entry("advantage", "test", [r.record_id for r in records], [(TRAIN, group)])),
        ]
        groups.append(group)
    return groups, entries


async def send_batch(transport, batch: int, vocab: int) -> None:
    groups, entries = upstream_of_batch(batch, vocab)
    for stage, entry in entries:
        await transport.produce(ledger_edge(stage), [encode(entry)])
    await transport.produce(TRAIN, [encode(g) for g in groups])


async def until(condition, task: asyncio.Task, seconds: float, what: str) -> None:
    """``polling.wait_until``, failing at once with the learner's own error if it exits first."""
    from polling import wait_until

    async def check() -> bool:
        if await condition():
            return True
        if task.done():
            task.result()  # raises the learner's error
            pytest.fail(f"the learner exited before {what}")
        return False

    await wait_until(check, what, timeout_s=seconds, interval_s=0.05)


def learner_config(run: str, out: Path, redis_url: str):
    return load_config("configs/demo-redis.toml", [
        f"run.name={run}", f"run.output_dir={json.dumps(str(out))}", f"transport.url={redis_url}",
        "run.ledger=true", "run.metrics_port=0", f"run.max_steps={BATCHES}",
        f"grpo.num_generations={GENERATIONS}", f"grpo.generation_batch_size={GENERATIONS * GROUPS_PER_BATCH}",
        f"grpo.per_device_train_batch_size={GENERATIONS * GROUPS_PER_BATCH}",  # one optimizer step per batch
        "grpo.max_staleness=1000", "grpo.beta=0", "learner.save_steps=1", "learner.save_total_limit=1",
        "transport.min_idle_ms=500",  # the resumed learner reclaims the failed one's held groups at once
    ])


async def start_learner(cfg, resume: bool, on_step=None):
    """A learner worker as `rollstream worker learner [--resume latest]` builds it, on its own connection
    (``on_step``: the stage's per-step callback, as the `train` wiring sets it)."""
    from rollstream import train
    from stages.feeder import plan_batches

    rows = train.load_rows(cfg)
    model_dir = train.model_dir_of(cfg)
    stage = train.build_stage("learner", cfg, model_dir=model_dir, rows=rows, output_dir=Path(cfg.run.output_dir))
    stage.on_step = on_step
    if resume:
        stage.resume_from = train.resume_checkpoint(cfg, "latest", plan_batches(cfg, len(rows)).num_batches, worker=True)
    transport = await train.open_transport(cfg)
    worker = train.make_worker(stage, transport, cfg, worker_id=f"learner-{uuid.uuid4().hex[:4]}", metrics_port=0)
    return asyncio.create_task(worker.serve()), transport, model_dir


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # a cut-short row fails here


# The bytes left free after batch 0, per failing write, from batch 0's snapshot and completions rows: the
# publish writes snapshot v2 before it deletes v1 (so it needs one snapshot free and gives it back), then
# metrics.jsonl's row (~1 KiB), then completions.jsonl's rows (~1.9 MiB), then the checkpoint (~3 snapshots).
CASES = {
    "checkpoint": lambda snapshot, rows: snapshot + rows + 512 * 1024,
    "snapshot": lambda snapshot, rows: 64 * 1024,
    "completions": lambda snapshot, rows: (snapshot + rows) // 2,  # rows > snapshot: see PROMPT_TEXT
}


@pytest.mark.parametrize("fails", list(CASES))
async def test_learner_stops_on_a_full_disk_and_resumes_with_the_ledger_exact(fails, small_disk, redis_url):
    from trainer import checkpoint as checkpoints

    disk = small_disk(32)
    out, run = disk / "run", f"full-disk-{fails}-{uuid.uuid4().hex[:6]}"
    cfg = learner_config(run, out, redis_url)
    learner, learner_transport, model_dir = await start_learner(cfg, resume=False)
    vocab = tiny_vocab(Path(model_dir))
    from rollstream.train import open_transport

    upstream = await open_transport(cfg)
    try:
        await send_batch(upstream, 0, vocab)

        async def batch_0_checkpointed_and_acked() -> bool:
            found = checkpoints.latest(out)
            return found is not None and found.step == 1 and (await upstream.stats(TRAIN, "learner")).pending == 0

        await until(batch_0_checkpointed_and_acked, learner, 120, "checkpoint of batch 0")
        snapshots = sorted((out / "weights").iterdir())
        filler = fill(disk, leave=CASES[fails](allocated(snapshots[-1]), (out / "completions.jsonl").stat().st_size))
        free_left = free_bytes(disk)
        await send_batch(upstream, 1, vocab)
        began = time.monotonic()
        with pytest.raises(OutputWriteError) as failed:
            await asyncio.wait_for(learner, 120)
        failed_s = time.monotonic() - began  # batch 1 sent -> the learner stopped
        await learner_transport.close()  # the failed process's connection goes with it
        error = failed.value
        expected = {"checkpoint": out / "checkpoint-2", "completions": out / "completions.jsonl"}
        if fails == "snapshot":
            assert error.path.parent == out / "weights"
        else:
            assert error.path == expected[fails]
        assert error.errno == errno.ENOSPC and str(error.path) in str(error)

        # The previous checkpoint is intact and loadable; no temp directory or half snapshot is left.
        assert [p.name for p in checkpoints.listed(out)] == ["checkpoint-1"]
        kept = checkpoints.load(out / "checkpoint-1")
        assert kept.state["batches_trained"] == 1
        assert not [p.name for p in out.rglob(".*") if p.name.startswith((".checkpoint-", ".v0"))]
        # Batch 1's TrainGroups are held, not acked: no checkpoint covers their training.
        assert (await upstream.stats(TRAIN, "learner")).pending == GROUPS_PER_BATCH
        if fails == "completions":  # the failed write left a cut-short row, which the resume cuts off
            assert (out / "completions.jsonl").stat().st_size > kept.state["completions_bytes"]

        filler.unlink()  # space freed
        stale = out / ".checkpoint-2-killed"  # what a kill mid-write leaves: the resume removes it
        stale.mkdir()
        (stale / "optimizer.pt").write_bytes(b"x" * MIB)
        await send_batch(upstream, 2, vocab)
        resumed_at = time.monotonic()
        learner, learner_transport, _ = await start_learner(cfg, resume=True)
        assert await asyncio.wait_for(learner, 180) == 0
        resumed_s = time.monotonic() - resumed_at
        assert not stale.exists()

        metrics = rows_of(out / "metrics.jsonl")
        assert [r["step"] for r in metrics] == list(range(1, BATCHES + 1))  # no step lost, none twice
        completions = rows_of(out / "completions.jsonl")
        assert set(Counter(c["request_id"] for c in completions).values()) == {1}
        assert Counter(c["generation_batch"] for c in completions) == {b: GROUPS_PER_BATCH * GENERATIONS
                                                                       for b in range(BATCHES)}
        audit = ledger.check(*await ledger.read_transport(upstream))
        assert audit.ok, ledger.format_audit(audit)
        assert audit.released == audit.trained == BATCHES * GROUPS_PER_BATCH and audit.counts()["duplicated"] == 0
        assert (await upstream.stats(TRAIN, "learner")).pending == 0
        assert checkpoints.latest(out).step == BATCHES and (out / "final" / "model.safetensors").exists()
        print("FULL_DISK " + json.dumps({"fails": fails, "error_path": str(error.path.relative_to(out)),
                                         "free_bytes_left": free_left, "seconds_to_error": round(failed_s, 2),
                                         "resume_seconds": round(resumed_s, 1)}))
    finally:
        if not learner.done():
            learner.cancel()
        await learner_transport.close()
        await upstream.delete_run()
        await upstream.close()


async def test_any_error_after_training_stops_the_learner_with_the_batch_unacked(tmp_path, redis_url):
    """Not only a write: any error once a batch is trained (here the per-step callback raises) stops the
    learner. Retried, its record would be taken for a redelivery of a trained group and acked with no checkpoint
    covering it, and the rest of the batch held for ever; instead the batch stays unacked and --resume ends the
    run with the ledger exact."""
    from rollstream.train import open_transport
    from trainer import checkpoint as checkpoints

    out, run = tmp_path / "run", f"after-training-{uuid.uuid4().hex[:6]}"
    cfg = learner_config(run, out, redis_url)

    def on_step(row: dict) -> None:
        if row["step"] == 2:
            raise ValueError("the progress callback broke")

    learner, learner_transport, model_dir = await start_learner(cfg, resume=False, on_step=on_step)
    vocab = tiny_vocab(Path(model_dir))
    upstream = await open_transport(cfg)
    try:
        await send_batch(upstream, 0, vocab)
        await send_batch(upstream, 1, vocab)
        with pytest.raises(FatalStageError) as failed:
            await asyncio.wait_for(learner, 120)
        await learner_transport.close()
        assert "ValueError: the progress callback broke" in str(failed.value) and "--resume" in str(failed.value)
        assert [p.name for p in checkpoints.listed(out)] == ["checkpoint-1"]
        assert (await upstream.stats(TRAIN, "learner")).pending == GROUPS_PER_BATCH  # batch 1: held, not acked

        await send_batch(upstream, 2, vocab)
        learner, learner_transport, _ = await start_learner(cfg, resume=True)
        assert await asyncio.wait_for(learner, 180) == 0
        assert [r["step"] for r in rows_of(out / "metrics.jsonl")] == list(range(1, BATCHES + 1))
        audit = ledger.check(*await ledger.read_transport(upstream))
        assert audit.ok, ledger.format_audit(audit)
        assert audit.released == audit.trained == BATCHES * GROUPS_PER_BATCH
        assert (await upstream.stats(TRAIN, "learner")).pending == 0
    finally:
        if not learner.done():
            learner.cancel()
        await learner_transport.close()
        await upstream.delete_run()
        await upstream.close()
