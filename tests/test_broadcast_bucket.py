"""Weights by broadcast, bounded (#40): a receiving engine holds at most one bucket
(rollout.weight_sync_bucket_mb) of extra memory on its device during a round, the whole version being staged in
host memory, whatever the model's size. Real gloo groups of real processes; the receive's device buffers are
counted by wrapping the one function that allocates them (``transfer.device_buffer``)."""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest
import torch

from weights import transfer
from weights.sender import BroadcastSender, state_layout
from weights.transfer import Group, Layout

BUCKET = 1 << 20  # 1 MiB buckets
CHUNK = 256 << 10  # 256 KiB chunks: four to a bucket


def _state() -> dict[str, torch.Tensor]:
    """~6.3 MiB in mixed dtypes: parameters larger than a chunk (cut in slices), small ones packed, one
    parameter larger than a bucket (its slices span two)."""
    g = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(300 + 97 * i, 512, generator=g) for i in range(6)}
    state["half"] = torch.randn(1500, 256, generator=g).to(torch.bfloat16)  # 750 KiB
    state["bigger"] = torch.randn(400, 1024, generator=g)  # 1.6 MiB: over a bucket
    state.update({f"norm.{i}": torch.randn(64, generator=g) for i in range(40)})
    state["steps"] = torch.arange(11)
    return state


def _receiver(port: int, rank: int, world: int, meta, out: multiprocessing.Queue, broadcast_path: bool) -> None:
    if broadcast_path:  # the path an NCCL group takes (collective broadcasts, no chain), here over gloo
        Group.chained = property(lambda self: False)
    allocated: list[int] = []
    real = transfer.device_buffer

    def counting(nbytes: int, device: torch.device) -> torch.Tensor:
        allocated.append(nbytes)
        return real(nbytes, device)

    transfer.device_buffer = counting
    layout = Layout.of(*meta)
    out.put(("ready", rank))  # torch imported: on a loaded machine that alone can outlast the group's timeout
    group = Group(address="127.0.0.1", port=port, rank=rank, world_size=world, backend="gloo", timeout_s=30,
                  local_address="127.0.0.1", key="epoch-1")
    staging = transfer.receive(group, layout, CHUNK, epoch=1, version=3, bucket_bytes=BUCKET)
    out.put((rank, allocated, staging.numel(), staging.numpy().tobytes()))


@pytest.mark.parametrize("broadcast_path", [False, True], ids=["chain", "broadcast"])
def test_a_receive_holds_one_bucket_on_the_device(monkeypatch, broadcast_path):
    """Two receivers (on the chain, rank 1 forwards to rank 2 from its host staging) get every byte of a
    version over 6 buckets; each allocated one device buffer of one bucket for the round, and staged the
    whole stream in host memory."""
    if broadcast_path:
        monkeypatch.setattr(Group, "chained", property(lambda self: False))
    state = _state()
    layout = state_layout(state)
    plan = transfer.round_chunks(layout, CHUNK, "gloo")
    assert layout.total > 6 * BUCKET and len(transfer.buckets(plan, BUCKET)) >= 7
    sender = BroadcastSender(lambda: state, layout, chunk_bytes=CHUNK, timeout_s=30)
    port = sender.listen("127.0.0.1")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(port, r, 3, sender.meta(), out, broadcast_path)) for r in (1, 2)]
    for p in procs:
        p.start()

    async def run() -> int:
        await sender.form(1, 3)
        return await sender.send(1, 3)

    try:
        assert sorted(out.get(timeout=120) for _ in procs) == [("ready", 1), ("ready", 2)]
        assert asyncio.run(run()) == layout.total
        got = [out.get(timeout=120) for _ in procs]
    finally:
        sender.close()
        for p in procs:
            p.join(timeout=30)
    for rank, allocated, staged, data in got:
        assert allocated == [BUCKET], (rank, allocated)  # the round's only device buffer: one bucket
        assert staged == layout.total
        received = dict(transfer.unpack(torch.frombuffer(bytearray(data), dtype=torch.uint8), layout))
        for name, tensor in state.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), (rank, name)


def test_buckets_cover_the_plan_and_never_cut_a_chunk():
    """Every chunk in exactly one bucket, in order; a bucket's bytes fit its span; a span never smaller than
    the largest chunk (one collective call) nor larger than the stream."""
    layout = state_layout(_state())
    for chunk, bucket in [(CHUNK, BUCKET), (4 << 20, BUCKET), (CHUNK, 1 << 30), (CHUNK, 1)]:
        plan = layout.chunks(chunk)
        span = transfer.bucket_span(plan, bucket)
        largest = max(end - start for start, end, _ in plan)
        assert largest <= span <= layout.total and (span == bucket or span in (largest, plan[-1][1]))
        cut = transfer.buckets(plan, span)
        assert [i for first, end in cut for i in range(first, end)] == list(range(len(plan)))
        assert all(plan[end - 1][1] - plan[first][0] <= span for first, end in cut)
    plan = layout.chunks(CHUNK)
    assert len(transfer.buckets(plan, transfer.bucket_span(plan, 1 << 30))) == 1


def test_the_bucket_setting_reaches_the_epoch_record():
    """rollout.weight_sync_bucket_mb (default 1 GiB, as peers' 0.5-1 GB buckets) is a WeightsEpoch field every
    member reads; an older learner's epoch (no field) leaves each member its default."""
    import msgspec

    from config import load_config
    from pipeline.records import WeightsEpoch, decode

    funcs = 'reward.reward_funcs=["accuracy"]'
    cfg = load_config(None, [funcs, "rollout.weight_transport=broadcast", "rollout.weight_sync_bucket_mb=256"])
    assert cfg.rollout.weight_sync_bucket_mb == 256.0
    assert int(load_config(None, [funcs]).rollout.weight_sync_bucket_mb * 2**20) == transfer.BUCKET_BYTES
    old = {"type": "weights_epoch", "epoch": 3, "phase": "form", "address": "10.0.0.1", "port": 4242,
           "backend": "gloo", "chunk_bytes": 1024}
    assert decode(msgspec.msgpack.encode(old)).bucket_bytes == 0
    assert WeightsEpoch(epoch=1, phase="form", address="", port=0, backend="gloo", bucket_bytes=5).bucket_bytes == 5


def test_the_gpu_script_parses_and_its_bucket_bench_runs_here(tmp_path):
    """bench/gpu.sh is valid bash and runs the bucket bench on CUDA; that bench runs here on CPU with the
    ``mid`` model (69 MiB): each round's receive allocates one device buffer, of at most a chain's chunk (4 MiB)
    for a 1 MiB bucket, of the whole version for 0 (the memory of a receive before #40)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run(["bash", "-n", str(root / "bench" / "gpu.sh")], check=True)
    assert "bench/weight_sync.py --models qwen2.5-0.5b --buckets" in (root / "bench" / "gpu.sh").read_text()
    out = tmp_path / "buckets.json"
    subprocess.run([sys.executable, str(root / "bench" / "weight_sync.py"), "--models", "mid", "--buckets", "1,0",
                    "--versions", "1", "--json-out", str(out)], check=True, timeout=600, capture_output=True)
    rows = json.loads(out.read_text())["results"]
    assert [r["bucket_mb"] for r in rows] == [1.0, "whole version"]
    small, whole = rows
    assert 2**20 <= small["device_buffers"][0] <= transfer.PIPELINE_CHUNK < small["bytes"] // 10
    assert whole["device_buffers"] == [whole["bytes"]]
    assert small["device_buffer_allocations"] == whole["device_buffer_allocations"] == 2  # one per round
