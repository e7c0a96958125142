"""learner.device on one process and as a distributed learner group (trainer/distributed.py).

The CPU half runs everywhere: device resolution and its errors, the config checks, which device each rank of
a distributed learner takes and when it refuses to start. The CUDA half (skipped without a GPU; run by
``bench/gpu.sh`` on the GPU machine) trains the same batch on CPU and GPU and compares."""

from __future__ import annotations

import pytest
import torch
from test_learner_loop import make_groups, make_learner, model_dir  # noqa: F401  (model_dir: a fixture)

from config import ConfigError, load_config
from pipeline.errors import SetupError
from pipeline.records import LearnerCommand
from trainer.distributed import LearnerGroup, group_device
from trainer.model import learner_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh runs it on one)")


# ----------------------------------------------------------------------------- everywhere


def test_device_auto_is_the_gpu_when_there_is_one_and_the_learner_is_one_process():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert learner_device("auto").type == expected
    assert learner_device("cpu").type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_a_cuda_device_without_a_gpu_is_a_setup_error_that_says_what_to_set():
    with pytest.raises(SetupError, match=r"learner.device='cuda'.*no CUDA GPU.*\"cpu\" or \"auto\""):
        learner_device("cuda")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CUDA", "mps"])
def test_a_bad_device_names_the_field_and_the_valid_values(device):
    with pytest.raises(ConfigError, match=r"learner.device=.*must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""):
        load_config("configs/demo.toml", [f"learner.device={device}"])


def test_a_distributed_learner_may_train_on_cuda_but_not_on_one_named_gpu():
    cfg = load_config("configs/demo.toml", ["learner.device=cuda", "grpo.world_size=2"])
    assert cfg.learner.device == "cuda"  # each rank on the GPU of its local rank
    with pytest.raises(ConfigError, match=r"learner.device='cuda:1' with grpo.world_size=2.*learner.device = \"cuda\""):
        load_config("configs/demo.toml", ["learner.device=cuda:1", "grpo.world_size=2"])


@pytest.mark.parametrize(
    ("spec", "local_rank", "local_world_size", "gpus", "expected"),
    [
        ("cpu", 1, 2, 8, "cpu"),
        ("auto", 1, 2, 0, "cpu"),  # no GPU: the gloo learner
        ("auto", 1, 2, 1, "cpu"),  # fewer GPUs than local ranks: "auto" does not share one
        ("auto", 1, 2, 2, "cuda:1"),
        ("cuda", 0, 4, 8, "cuda:0"),
        ("cuda", 3, 4, 4, "cuda:3"),
    ],
)
def test_each_rank_of_a_learner_group_takes_the_gpu_of_its_local_rank(spec, local_rank, local_world_size, gpus, expected):
    assert group_device(spec, local_rank, local_world_size, gpus) == expected


def test_a_cuda_learner_group_refuses_fewer_gpus_than_local_ranks_with_the_numbers(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SetupError, match=r"4 learner processes on this host.*sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\)"
                       r".*--nproc_per_node 2"):
        group_device("cuda", 3, 4, 2)
    with pytest.raises(SetupError, match=r"sees 0 GPU\(s\).*set learner.device = \"cpu\""):
        group_device("cuda", 0, 2, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_a_cuda_learner_group_on_a_machine_without_gpus_fails_before_any_rendezvous(monkeypatch):
    """Under torchrun (its environment) with learner.device = "cuda": a SetupError at once, not a hang in
    init_process_group waiting for ranks that will fail the same way."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(SetupError, match=r"learner.device='cuda' with 2 learner processes.*sees 0 GPU"):
        LearnerGroup("cuda")
    assert not torch.distributed.is_initialized()


# ----------------------------------------------------------------------------- on a GPU


@cuda
def test_a_gpu_learner_trains_the_batch_as_the_cpu_learner_does(model_dir, tmp_path):  # noqa: F811
    rows, weights = {}, {}
    for device in ("cpu", "cuda"):
        learner = make_learner(model_dir, tmp_path / device, f"learner.device={device}", "grpo.num_iterations=2")
        assert {p.device.type for p in learner.model.parameters()} == {device}
        rows[device] = learner.train_generation_batch(make_groups(seed=3), 0)
        weights[device] = [p.detach().cpu() for p in learner.model.parameters()]
    assert len(rows["cpu"]) == len(rows["cuda"]) > 0
    for cpu_row, gpu_row in zip(rows["cpu"], rows["cuda"], strict=True):
        assert gpu_row["loss"] == pytest.approx(cpu_row["loss"], rel=1e-3, abs=1e-5)
        assert gpu_row["grad_norm"] == pytest.approx(cpu_row["grad_norm"], rel=1e-3)
    moved = max(float((a - b).abs().max()) for a, b in zip(weights["cpu"], weights["cuda"], strict=True))
    assert moved < 1e-4  # lr 1e-2 moves weights by ~1e-2 a step: the two learners took the same steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_a_learner_group_of_one_runs_every_collective_on_its_device(device, model_dir, monkeypatch):  # noqa: F811
    """The group's operations as the trainer uses them, in one process (world size 1): on the CPU over gloo,
    and on a GPU over NCCL with gloo beside it for the host tensors (``bench/gpu.sh`` runs that half)."""
    import socket

    from trainer.model import load_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    group = LearnerGroup(device)
    try:
        assert group.device.type == device and group.leader
        model = load_model(model_dir, torch.float32).to(group.device)
        whole = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        group.shard(model)
        ids = torch.randint(3, 50, (2, 7), device=group.device)
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        assert group.clip_grad_norm(model.parameters(), 1.0) > 0
        assert group.reduce_stats({"loss": 2.0, "kl": 0.5}, tokens=4.0) == {"loss": 2.0, "kl": 0.5}
        assert group.sum(3.0) == 3.0
        rows = torch.arange(4.0, device=group.device)
        assert torch.equal(group.gather_rows(rows, 2), rows)
        group.send(LearnerCommand(action="stop", version=0))
        state = group.full_model_state(model)
        assert state.keys() == whole.keys()
        assert all(torch.equal(state[k].cpu(), whole[k]) for k in whole)  # gathered whole, on the host
    finally:
        group.close()
    assert not torch.distributed.is_initialized()
