"""learner.device and the GPU weight publish (trainer/ipc.py).

The CPU half runs everywhere: device resolution and its errors, the config check, the IPC record on the
wire, the publisher's and reader's refusals. The CUDA half (skipped without a GPU; run by ``bench/gpu.sh`` on
the GPU machine) trains the same batch on CPU and GPU and compares, and maps the learner's weights in a
second process through CUDA IPC."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from test_learner_loop import make_groups, make_learner, model_dir  # noqa: F401  (model_dir: a fixture)

from pipeline.config import ConfigError, load_config
from pipeline.errors import SetupError
from pipeline.records import IpcTensor, WeightsIpcHandle, decode, encode
from trainer.ipc import CudaIpcPublisher, CudaIpcReader
from trainer.model import learner_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.sh runs it on one)")


# ----------------------------------------------------------------------------- everywhere


def test_device_auto_is_the_gpu_when_there_is_one_and_the_learner_is_one_process():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert learner_device("auto").type == expected
    assert learner_device("auto", distributed=True).type == "cpu"
    assert learner_device("cpu").type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_a_cuda_device_without_a_gpu_is_a_setup_error_that_says_what_to_set():
    with pytest.raises(SetupError, match=r"learner.device='cuda'.*no CUDA GPU.*\"cpu\" or \"auto\""):
        learner_device("cuda")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CUDA", "mps"])
def test_a_bad_device_names_the_field_and_the_valid_values(device):
    with pytest.raises(ConfigError, match=r"learner.device=.*must be \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""):
        load_config("configs/demo.toml", [f"learner.device={device}"])


def test_the_distributed_learner_refuses_a_cuda_device():
    with pytest.raises(ConfigError, match=r"learner.device='cuda' with grpo.world_size=2.*gloo"):
        load_config("configs/demo.toml", ["learner.device=cuda", "grpo.world_size=2"])


def test_the_ipc_handle_travels_as_a_record():
    handle = WeightsIpcHandle(device=0, handle=b"\x01" * 64, size_bytes=4096, offset_bytes=0, ref_counter_handle=b"rc",
                              ref_counter_offset=8, event_handle=b"\x02" * 64, event_sync_required=True,
                              tensors=[IpcTensor(name="w", dtype="bfloat16", shape=[4, 8], offset=256)])
    assert decode(encode(handle)) == handle


def test_the_publisher_refuses_a_model_off_the_gpu():
    with pytest.raises(ValueError, match="one CUDA device; its parameters are on \\['cpu'\\]"):
        CudaIpcPublisher(torch.nn.Linear(4, 4))


def test_the_reader_refuses_an_unknown_dtype_before_mapping_anything():
    handle = WeightsIpcHandle(device=0, handle=b"h", size_bytes=1024, offset_bytes=0, ref_counter_handle=b"r",
                              ref_counter_offset=0, tensors=[IpcTensor(name="w", dtype="complex64", shape=[2], offset=256)])
    with pytest.raises(ValueError, match=r"unsupported dtype\(s\) \['complex64'\]"):
        CudaIpcReader(handle)


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


def _reader(conn) -> None:
    """Another process on the GPU: map the learner's buffer, load each version into its own tensors and answer
    with their bits; answers "timeout" when the learner holds the buffer mid-write."""
    handle = decode(conn.recv_bytes())
    reader = CudaIpcReader(handle)
    params = {t.name: torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device="cuda") for t in handle.tensors}
    while (op := conn.recv_bytes()) != b"stop":
        try:
            version = reader.load_into(params, timeout=0.5 if op == b"expect-timeout" else 10.0)
        except TimeoutError:
            conn.send_bytes(b"timeout")
            continue
        conn.send_bytes(version.to_bytes(8, "little"))
        for name in sorted(params):
            conn.send_bytes(params[name].cpu().view(torch.uint8).numpy().tobytes())


@cuda
def test_weights_published_over_cuda_ipc_reach_another_process_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 8, bias=False)).cuda().to(torch.bfloat16)
    publisher = CudaIpcPublisher(model)
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    reader = context.Process(target=_reader, args=(child,), daemon=True)
    reader.start()
    try:
        conn.send_bytes(encode(publisher.handle()))
        for version in (0, 1, 5):
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
            publisher.publish(version)
            conn.send_bytes(b"load")
            assert conn.poll(120), "the reader did not answer"
            assert int.from_bytes(conn.recv_bytes(), "little") == version
            named = dict(model.named_parameters())
            for name in sorted(named):
                assert conn.recv_bytes() == named[name].detach().cpu().view(torch.uint8).numpy().tobytes(), name
        publisher.sequence.fill_(13)  # odd: the learner is writing version 6; a reader must not take it
        torch.cuda.synchronize()
        conn.send_bytes(b"expect-timeout")
        assert conn.poll(120) and conn.recv_bytes() == b"timeout"
        conn.send_bytes(b"stop")
        reader.join(60)
        assert reader.exitcode == 0
    finally:
        if reader.is_alive():
            reader.kill()
