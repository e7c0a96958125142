"""A `rollstream train` process SIGKILLed after its first checkpoint, then resumed from `latest`: the run
finishes with policy versions and metrics.jsonl steps continuing and no generation batch trained twice.

The killed run is a real subprocess (its own vLLM engine); the resume runs in this process on the
session's shared engine through the same ``run_pipeline(resume=...)`` that ``--resume`` calls.
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

from config import load_config
from rollstream import train as graph
from trainer import checkpoint as checkpoints

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
STEPS = 32  # 8 generation batches of 64 samples, 4 optimizer steps each
SETTINGS = [f"run.max_steps={STEPS}", "learner.save_steps=8", "learner.save_total_limit=2",
            "grpo.max_staleness=0", "rollout.max_model_len=256"]


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_sigkilled_train_resumes_from_latest_checkpoint(tmp_path, vllm_engine):
    out = tmp_path / "run"
    settings = [f"run.name=resume-{uuid.uuid4().hex[:6]}", f"run.output_dir={json.dumps(str(out))}", *SETTINGS]
    command = [sys.executable, "-m", "rollstream.cli", "train", "-c", "configs/demo.toml"]
    for setting in settings:
        command += ["--set", setting]
    log_path = tmp_path / "killed-run.log"
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT)  # a file, not a pipe: nothing blocks on a full pipe
    try:  # its own session, so the kill takes the whole process group (engine helpers included)
        process = await asyncio.create_subprocess_exec(
            *command, cwd=ROOT, stdout=log_fd, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        os.close(log_fd)
    try:
        deadline = time.monotonic() + 400
        while not checkpoints.listed(out) and process.returncode is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling a directory another process writes, with a deadline
        if process.returncode is not None:
            pytest.fail(f"train exited ({process.returncode}) before its first checkpoint:\n"
                        f"{log_path.read_text()[-3000:]}")
        assert checkpoints.listed(out), "no checkpoint within the deadline"
        os.killpg(process.pid, signal.SIGKILL)
        await asyncio.wait_for(process.wait(), timeout=60)
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), timeout=60)
    killed_at = checkpoints.latest(out)
    assert killed_at is not None and killed_at.step < STEPS
    assert not (out / "final").exists()

    cfg = load_config("configs/demo.toml", settings)
    result = await graph.run_pipeline(cfg, engine=vllm_engine, resume="latest")
    assert result.exit_code == 0 and result.output_dir == out

    metrics = rows(out / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))  # no step lost, none twice
    # versions continue from the checkpoint: the row of step s belongs to generation batch (s - 1) // 4
    assert [r["policy_version"] for r in metrics] == [(s - 1) // 4 + 1 for s in range(1, STEPS + 1)]
    completions = rows(out / "completions.jsonl")
    per_batch = Counter(c["generation_batch"] for c in completions)
    assert per_batch == {b: 64 for b in range(STEPS // 4)}  # every batch trained exactly once
    prompts = {(c["generation_batch"], c["prompt_id"]) for c in completions}
    assert len(prompts) == 8 * STEPS // 4 and len({p for _, p in prompts}) == len(prompts)  # no prompt repeated
    final = checkpoints.latest(out)
    assert final.step == STEPS and final.state["policy_version"] == STEPS // 4
    assert len(checkpoints.listed(out)) == 2  # save_total_limit
    assert (out / "final" / "model.safetensors").exists()
