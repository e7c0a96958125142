"""learner.own_process: the trainer in a child process (trainer/process.py) trains exactly as in process (the
same metrics rows, snapshots and checkpoints; the training gauges set in the worker's registry), resumes from
its own checkpoints, stops on non-finite steps with the last good step's checkpoint as in process, and a child
that is killed stops the learner with its exit status instead of hanging it."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from fake_context import FakeContext
from prometheus_client import REGISTRY
from safetensors.torch import load_file
from test_learner_loop import RESUME_OVERRIDES, batch_groups, new_learner

from config import ConfigError, load_config
from pipeline.stage import FatalStageError
from trainer import checkpoint as checkpoints
from trainer.process import TrainerProcess
from trainer.trainer import NonFiniteTrainingError

CHILD = "learner.own_process=true"
TIMING = ("time", "samples_per_second", "tokens_per_second")  # wall-clock columns: differ run to run


async def feed(learner, batches, advantages=None, ctx=None):
    """Start the stage once, then hand it generation batches; returns the context."""
    ctx = ctx or FakeContext(stage="learner", worker="w")
    if not getattr(learner, "_fed", False):
        await learner.start(ctx)
        learner._fed = True
    for b in batches:
        for group in batch_groups(b) if advantages is None else batch_groups(b, advantages):
            await learner.handle(group, ctx)
    return ctx


def rows(out):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def snapshot(out, version):
    return load_file(str(out / "weights" / f"v{version:06d}" / "model.safetensors"))


async def test_a_child_trainer_trains_exactly_as_in_process(tiny_qwen2, tmp_path):
    inline = new_learner(tiny_qwen2, tmp_path / "inline", *RESUME_OVERRIDES)
    child = new_learner(tiny_qwen2, tmp_path / "child", *RESUME_OVERRIDES, CHILD)
    assert isinstance(child.trainer, TrainerProcess)
    ctx = FakeContext(stage="learner", worker="w")
    try:
        await feed(inline, range(4), ctx=FakeContext(stage="learner", worker="w"))
        await feed(child, range(4), ctx=ctx)
        assert child.trainer.step == inline.trainer.step == 8 and child.version == 4 and ctx.stops[-1][1] is True
        assert rows(tmp_path / "child") == rows(tmp_path / "inline")  # every loss, KL, clip and grad norm
        a, b = snapshot(tmp_path / "inline", 4), snapshot(tmp_path / "child", 4)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert [p.name for p in checkpoints.listed(tmp_path / "child")] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
        assert (tmp_path / "child" / "final" / "model.safetensors").exists()
        # /metrics is the worker's: the training gauges are set here from the child's rows.
        last = rows(tmp_path / "child")[-1]
        assert REGISTRY.get_sample_value("rollstream_train_loss", {"run": ctx.run}) == last["loss"]
        assert REGISTRY.get_sample_value("rollstream_train_step", {"run": ctx.run}) == 8
    finally:
        await inline.close()
        await child.close()
    assert child.trainer.pid is None


async def test_a_child_trainer_resumes_from_its_checkpoint(tiny_qwen2, tmp_path):
    straight = new_learner(tiny_qwen2, tmp_path / "straight", *RESUME_OVERRIDES)
    first = new_learner(tiny_qwen2, tmp_path / "run", *RESUME_OVERRIDES, CHILD)
    try:
        await feed(straight, range(4))
        await feed(first, range(2))
    finally:
        await straight.close()
        await first.close()
    ckpt = checkpoints.load(tmp_path / "run" / "checkpoint-4")
    resumed = new_learner(tiny_qwen2, tmp_path / "run", *RESUME_OVERRIDES, CHILD, resume_from=ckpt)
    try:
        await feed(resumed, range(2, 4))
        assert (resumed.trainer.step, resumed.version) == (8, 4)
    finally:
        await resumed.close()
    expected, got = snapshot(tmp_path / "straight", 4), snapshot(tmp_path / "run", 4)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5)  # as the in-process resume test
    assert [r["step"] for r in rows(tmp_path / "run")] == list(range(1, 9))


async def test_non_finite_steps_in_the_child_stop_the_run_with_the_last_good_checkpoint(tiny_qwen2, tmp_path):
    out = tmp_path / "out"
    learner = new_learner(tiny_qwen2, out, "grpo.beta=0", CHILD, num_batches=10)
    try:
        await feed(learner, [0])
        good = snapshot(out, 1)
        await feed(learner, [1, 2], advantages=[float("nan")] * 8)
        with pytest.raises(NonFiniteTrainingError, match=r"3 optimizer steps in a row.*Checkpoint of the last good step: .*checkpoint-1"):
            await feed(learner, [3], advantages=[float("nan")] * 8)
    finally:
        await learner.close()
    saved = checkpoints.load(out / "checkpoint-1")
    assert saved.state["nan_skipped"] == 3
    weights = load_file(str(saved.path / "model.safetensors"))
    assert all(torch.equal(weights[k], good[k]) for k in good)


async def test_a_killed_child_stops_the_learner_with_its_exit_status(tiny_qwen2, tmp_path):
    learner = new_learner(tiny_qwen2, tmp_path / "out", "grpo.beta=0", CHILD, num_batches=10)
    try:
        await feed(learner, [0])
        os.kill(learner.trainer.pid, signal.SIGKILL)
        with pytest.raises(FatalStageError, match=r"trainer process \(pid \d+\) exited with code -9 during 'train'"):
            await feed(learner, [1])
    finally:
        await learner.close()  # the dead child is reaped, nothing waits for it


def test_own_process_is_refused_where_the_model_must_stay_in_the_worker(tiny_qwen2):
    with pytest.raises(ConfigError, match=r"learner.own_process = true with rollout.weight_transport = \"broadcast\""):
        load_config("configs/demo.toml", [CHILD, "rollout.weight_transport=broadcast"])
    with pytest.raises(ConfigError, match=r"learner.own_process = true with grpo.world_size=2"):
        load_config("configs/demo.toml", [CHILD, "grpo.world_size=2"])
