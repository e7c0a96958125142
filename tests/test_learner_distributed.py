"""The learner as 2 processes under torchrun (FSDP2 over gloo) takes the steps 1 process takes.

Both runs are the real `rollstream worker learner` (1 process, per_device_train_batch_size = 4) and
`torchrun --nproc_per_node 2 -m rollstream.cli worker learner` (grpo.world_size = 2, per_device 2: the same
global mini-batch of 4), each on its own Redis run whose `train` edge holds the same TrainGroups. Each
trains 2 generation batches (4 optimizer steps, old and reference log-prob passes, a moving reference, a
checkpoint halfway and at the end) and finishes. Then 2 processes resume from the 1-process run's halfway
checkpoint and end where it ended (checkpoints hold whole weights and name-keyed optimizer state, for any
world size). Losses, gradient norms, weights and Adam moments must agree to 1e-5, and every TrainGroup
must be acked. (The learning rate is the demo's 1e-4: Adam divides each gradient by its own magnitude, so
at 1e-2 the float rounding of near-zero gradient components, which differs with the order of the sums,
already moves weights by 4e-5 after two steps.)
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from config import load_config
from pipeline.errors import SetupError
from pipeline.records import (
    LearnerCommand,
    ScoredTrajectory,
    TrainGroup,
    Trajectory,
    encode,
    pack_f32,
    pack_i32,
)
from pipeline.transport import connect
from stages import TRAIN
from trainer.distributed import check_world_size

ROOT = Path(__file__).resolve().parent.parent
GROUPS_PER_BATCH, GROUP_SIZE, BATCHES = 2, 4, 2


def train_groups(vocab: int) -> list[TrainGroup]:
    """BATCHES generation batches of 2 groups of 4, sampled at the policy version of their batch."""
    rng = np.random.default_rng(7)
    groups = []
    for b in range(BATCHES):
        for g in range(GROUPS_PER_BATCH):
            prompt_id = f"b{b}g{g}"
            prompt = rng.integers(3, vocab, size=int(rng.integers(4, 9)))
            records = []
            for i in range(GROUP_SIZE):
                completion = rng.integers(3, vocab, size=int(rng.integers(2, 12)))
                t = Trajectory(
                    prompt_id=prompt_id,
                    attempt=0,
                    request_id=f"{prompt_id}/0/{i}",
                    generation_batch=b,
                    prompt_ids=pack_i32(prompt),
                    completion_ids=pack_i32(completion),
                    logprobs=pack_f32(rng.uniform(-4, -0.5, len(completion))),
                    policy_version=b,
                    max_policy_version=b,
                )
                records.append(
                    ScoredTrajectory(trajectory=t, rewards={"accuracy": float(i % 2)}, reward=float(i % 2))
                )
            advantages = rng.standard_normal(GROUP_SIZE).round(3).tolist()
            groups.append(
                TrainGroup(
                    prompt_id=prompt_id, attempt=0, generation_batch=b, records=records, advantages=advantages
                )
            )
    return groups


async def fill_train_edge(redis_url: str, run: str, groups: list[TrainGroup]) -> None:
    transport = await connect("redis", run=run, url=redis_url)
    try:
        await transport.produce(TRAIN, [encode(g) for g in groups])
    finally:
        await transport.close()


async def edge_state(redis_url: str, run: str):
    transport = await connect("redis", run=run, url=redis_url)
    try:
        return await transport.stats(TRAIN, "learner")
    finally:
        await transport.delete_run()
        await transport.close()


def run_learner(
    processes: int, run: str, out: Path, redis_url: str, settings: list[str], *extra: str
) -> None:
    if processes == 1:
        launcher = [sys.executable, "-m", "rollstream.cli"]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(processes),
            "-m",
            "rollstream.cli",
        ]
    command = [*launcher, "worker", "learner", "-c", "configs/demo-redis.toml", "--metrics-port", "0", *extra]
    per_device = 4 // processes
    for setting in [
        *settings,
        f"run.name={run}",
        f"run.output_dir={json.dumps(str(out))}",
        f"transport.url={redis_url}",
        f"grpo.world_size={processes}",
        f"grpo.per_device_train_batch_size={per_device}",
    ]:
        command += ["--set", setting]
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        done = subprocess.run(
            command,
            check=False,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=420,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert done.returncode == 0, f"{processes}-process learner failed:\n{log.read_text()[-4000:]}"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.parametrize("loss_type,kl_in_reward", [("grpo", True), ("dapo", False)])
async def test_two_fsdp2_processes_train_like_one(
    tmp_path, redis_url, tiny_model_dir, loss_type, kl_in_reward
):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    groups = train_groups(vocab)
    settings = [
        f"grpo.loss_type={loss_type}",
        f"grpo.kl_in_reward={str(kl_in_reward).lower()}",  # the KL moves into the rewards of every rank's rows
        "grpo.num_generations=4",
        "grpo.generation_batch_size=8",
        "grpo.gradient_accumulation_steps=1",  # 2 steps per generation batch: old log-probs are computed
        "grpo.beta=0.04",
        "grpo.max_completion_length=16",
        "run.max_steps=4",
        "learner.save_steps=2",
        "learner.learning_rate=1e-4",
        "learner.sync_ref_model=true",
        "learner.ref_model_sync_steps=2",
        "learner.weight_decay=0.1",
    ]
    outs = {}
    for processes in (1, 2):
        run = f"dist{processes}-{uuid.uuid4().hex[:8]}"
        outs[processes] = tmp_path / f"p{processes}"
        await fill_train_edge(redis_url, run, groups)
        await asyncio.to_thread(run_learner, processes, run, outs[processes], redis_url, settings)
        stats = await edge_state(redis_url, run)
        assert stats.pending == stats.lag == 0, f"{processes} process(es) left TrainGroups unacked: {stats}"
    # 2 processes resume from the 1-process run's checkpoint after generation batch 0 and train batch 1.
    run, outs["resumed"] = f"dist-resume-{uuid.uuid4().hex[:8]}", tmp_path / "resumed"
    outs["resumed"].mkdir()
    shutil.copytree(outs[1] / "checkpoint-2", outs["resumed"] / "checkpoint-2")
    await fill_train_edge(redis_url, run, [g for g in groups if g.generation_batch == 1])
    await asyncio.to_thread(run_learner, 2, run, outs["resumed"], redis_url, settings, "--resume", "latest")
    assert (await edge_state(redis_url, run)).pending == 0

    one, two = rows(outs[1] / "metrics.jsonl"), rows(outs[2] / "metrics.jsonl")
    resumed = rows(outs["resumed"] / "metrics.jsonl")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2, 3, 4]
    assert [r["step"] for r in resumed] == [3, 4]
    # to 1e-5: each process pads its own rows, so matmul shapes and float rounding differ slightly
    for a, b in [*zip(one, two), *zip(one[2:], resumed)]:
        for key in ("loss", "grad_norm", "kl", "reward", "clip_ratio/region_mean", "learning_rate"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (a["step"], key)
        assert a["loss"] != 0.0
    compared = [
        (2, "final/model.safetensors"),
        (2, "checkpoint-2/model.safetensors"),
        (2, "checkpoint-4/ref_model.safetensors"),
        ("resumed", "final/model.safetensors"),
    ]
    for other, name in compared:
        first, second = load_file(str(outs[1] / name)), load_file(str(outs[other] / name))
        assert first.keys() == second.keys(), name
        for key in first:
            torch.testing.assert_close(second[key], first[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    final = load_file(str(outs[2] / "final/model.safetensors"))
    assert any(not torch.equal(initial[k], final[k]) for k in initial)  # it trained
    moments = [
        torch.load(outs[p] / "checkpoint-4" / "optimizer.pt", weights_only=True)["state"]
        for p in (1, 2, "resumed")
    ]
    for other in moments[1:]:
        assert other.keys() == moments[0].keys()
        for name in moments[0]:
            torch.testing.assert_close(other[name]["exp_avg"], moments[0][name]["exp_avg"], rtol=0, atol=1e-5)
            # exp_avg_sq ~ (1 - adam_beta2) g^2: at ms-swift's beta2 0.95, 50x its size at 0.999 (atol alike)
            torch.testing.assert_close(
                other[name]["exp_avg_sq"], moments[0][name]["exp_avg_sq"], rtol=1e-4, atol=5e-11
            )


def test_world_size_must_be_the_number_of_learner_processes(monkeypatch):
    two = load_config("configs/demo.toml", ["grpo.world_size=2", "grpo.per_device_train_batch_size=4"])
    with pytest.raises(
        SetupError,
        match=r"grpo.world_size = 2 but the learner runs as 1 process.*torchrun --nproc_per_node 2",
    ):
        check_world_size(two)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        SetupError, match=r"grpo.world_size = 2 but the learner runs as 4 process.*set grpo.world_size = 4"
    ):
        check_world_size(two)
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_world_size(two)
    lora = load_config(
        "configs/demo.toml",
        ["grpo.world_size=2", "grpo.per_device_train_batch_size=4", "learner.train_type=lora"],
    )
    with pytest.raises(SetupError, match="learner.train_type: not supported with grpo.world_size > 1"):
        check_world_size(lora)


def test_a_learner_command_travels_as_msgpack_and_comes_back_whole():
    from pipeline.records import decode, encode

    groups = train_groups(vocab=50)[:2]
    command = LearnerCommand(action="train", version=3, groups=groups)
    assert decode(encode(command)) == command


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU does")
def test_a_cuda_learner_group_without_gpus_exits_at_once_instead_of_hanging(tmp_path, redis_url):
    """torchrun, 2 learner processes, learner.device = "cuda" on a machine with no GPU: every rank refuses
    before the rendezvous (trainer.distributed.group_device), so torchrun ends with an error in seconds."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "rollstream.cli", "worker", "learner", "-c", "configs/demo-redis.toml", "--metrics-port", "0",
    ]
    for setting in [
        f"run.name=cuda-refused-{uuid.uuid4().hex[:8]}",
        f"run.output_dir={json.dumps(str(tmp_path / 'out'))}",
        f"transport.url={redis_url}",
        "grpo.world_size=2",
        "grpo.per_device_train_batch_size=2",
        "learner.device=cuda",
    ]:
        command += ["--set", setting]
    done = subprocess.run(
        command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0, done.stdout[-3000:] + done.stderr[-3000:]
