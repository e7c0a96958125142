"""Weights by broadcast (rollout.weight_sync_mode = "broadcast", #29) on one host: the wire format is exact,
a real vLLM engine loads a broadcast version exactly as it loads the same weights from a file, and the
control plane (pipeline/membership.py) forms groups, survives a member killed mid-round, serves a late
joiner, and runs whole training runs."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from engines import weight_transfer
from engines.weight_transfer import Group, Layout
from pipeline.records import EpochMember, WeightsEpoch
from trainer.broadcast import BroadcastSender, state_layout

PROMPT = [1, 5, 9, 13, 2, 7]


def perturbed_state(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The tiny model's weights plus noise: a version no engine holds yet."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def form_record(sender: BroadcastSender, port: int, epoch: int, members: int, timeout_s: float = 20.0) -> WeightsEpoch:
    names, dtypes, shapes = sender.meta()
    return WeightsEpoch(
        epoch=epoch, phase="form", address="127.0.0.1", port=port, backend="gloo", world_size=members + 1,
        members=[EpochMember(worker=f"w{i}", nonce=i, rank_offset=i + 1) for i in range(members)],
        timeout_s=timeout_s, chunk_bytes=sender.chunk_bytes, names=names, dtypes=dtypes, shapes=shapes,
    )


# ---------------------------------------------------------------------------------------------------
# The wire format, between plain processes running the engine's receive code


def _receiver(port: int, rank: int, world: int, names, dtypes, shapes, chunk: int, out: multiprocessing.Queue) -> None:
    layout = Layout.of(names, dtypes, shapes)
    group = Group(address="127.0.0.1", port=port, rank=rank, world_size=world, backend="gloo", timeout_s=20,
                  local_address="127.0.0.1", key="epoch-1")
    staging = weight_transfer.receive(group, layout, chunk, epoch=1, version=3)
    out.put((rank, {n: t.clone() for n, t in weight_transfer.unpack(staging, layout)}))


def test_layout_aligns_every_parameter_and_bounds_chunks():
    layout = Layout.of(["a", "b", "c"], ["float32", "bfloat16", "int64"], [[3], [5, 1], [2, 2]])
    assert layout.offsets == (0, 64, 128) and layout.sizes == (12, 10, 32) and layout.total == 192
    assert layout.chunks(100) == [(0, 100), (100, 192)]
    with pytest.raises(ValueError, match="not a torch dtype"):
        Layout.of(["a"], ["tensor"], [[1]])


def test_two_receivers_get_every_byte(tmp_path):
    """Mixed dtypes, parameters straddling chunk boundaries, two receivers: bit-exact."""
    g = torch.Generator().manual_seed(0)
    state = {f"layer.{i}.weight": torch.randn(37 + 101 * i, 3, generator=g) for i in range(6)}
    state["half"] = torch.randn(7, 9, generator=g).to(torch.bfloat16)
    state["steps"] = torch.arange(11)
    layout = state_layout(state)
    sender = BroadcastSender(lambda: state, layout, chunk_bytes=1000, timeout_s=20)
    port = sender.listen("127.0.0.1")
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    names, dtypes, shapes = sender.meta()
    procs = [ctx.Process(target=_receiver, args=(port, r, 3, names, dtypes, shapes, 1000, out)) for r in (1, 2)]
    for p in procs:
        p.start()

    async def run() -> int:
        await sender.form(1, 3)
        return await sender.send(1, 3)

    try:
        assert asyncio.run(run()) == layout.total
        got = dict(out.get(timeout=60) for _ in procs)
    finally:
        sender.close()
        for p in procs:
            p.join(timeout=30)
    for received in got.values():
        assert received.keys() == state.keys()
        for name, tensor in state.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_listen_refuses_the_wildcard_address():
    with pytest.raises(weight_transfer.BroadcastError, match="weight_sync_address"):
        weight_transfer.listen("0.0.0.0")


# ---------------------------------------------------------------------------------------------------
# A real vLLM engine


async def _engine_logprobs(engine, seed: int = 3) -> tuple[list[int], list[float]]:
    sample = await engine.generate(PROMPT, request_id=f"bc-{time.monotonic_ns()}", seed=seed, max_tokens=12,
                                   temperature=1.0)
    return sample.completion_ids, sample.logprobs


@pytest.mark.e2e
async def test_engine_loads_a_broadcast_exactly_as_the_same_file(vllm_engine, tiny_model_dir, tmp_path):
    """The engine's log-probs after a broadcast equal, bit for bit, its log-probs after loading the same
    weights from a safetensors file, and match the learner's own (transformers) to float precision."""
    from safetensors.torch import save_file

    state = perturbed_state(tiny_model_dir, seed=11)
    sender = BroadcastSender(lambda: state, state_layout(state), chunk_bytes=64 * 1024, timeout_s=20)
    await vllm_engine.reset_weights(tiny_model_dir)
    try:
        port = sender.listen("127.0.0.1")
        epoch = form_record(sender, port, epoch=1, members=1)
        await asyncio.gather(sender.form(1, 2), vllm_engine.join_broadcast(epoch, epoch.members[0], "127.0.0.1"))
        sent, _ = await asyncio.gather(sender.send(1, 5), vllm_engine.receive_broadcast(1, 5, 20))
        assert sent == state_layout(state).total
        assert vllm_engine.version == 0  # received, not loaded: nothing changed yet
        assert await vllm_engine.commit_broadcast(5, "pause") > 0
        assert vllm_engine.version == 5
        by_broadcast = await _engine_logprobs(vllm_engine)

        save_file(state, str(tmp_path / "model.safetensors"))
        await vllm_engine.reset_weights(tiny_model_dir)
        base = await _engine_logprobs(vllm_engine)
        await vllm_engine.load_weights(tmp_path, 5)
        by_file = await _engine_logprobs(vllm_engine)
    finally:
        sender.close()
        await vllm_engine.reset_weights(tiny_model_dir)
    assert by_broadcast == by_file
    assert by_broadcast != base

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32)
    model.load_state_dict(state)
    ids, logprobs = by_broadcast
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    learner = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(learner, torch.tensor(logprobs), atol=1e-4), (learner, logprobs)


# ---------------------------------------------------------------------------------------------------
# Training runs on weight_sync_mode = "broadcast"


def broadcast_config(tmp_path, *extra):
    import json
    import uuid

    from pipeline.config import load_config

    return load_config("configs/demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", "rollout.max_model_len=256", "grpo.max_staleness=0",
        "rollout.weight_sync_mode=broadcast", "rollout.weight_sync_timeout_s=20", "rollout.weight_sync_chunk_mb=0.25",
        f"run.name=bc-{uuid.uuid4().hex[:6]}", *extra,
    ])


@pytest.mark.e2e
async def test_a_training_run_on_broadcast(tmp_path, vllm_engine, tiny_model_dir):
    """Every version reaches the engine by broadcast (no snapshot written): at max_staleness 0 every sample
    comes from the learner's weights, and the engine's log-probs of the sampled tokens equal the learner's."""
    import json

    from rollstream import train

    await vllm_engine.reset_weights(tiny_model_dir)
    cfg = broadcast_config(tmp_path, "run.max_steps=12")
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert rows[-1]["policy_version"] == 3
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4
    assert not (result.output_dir / "weights").exists()  # no snapshot: the weights went over the group
    assert (result.output_dir / "final" / "model.safetensors").exists()
    assert vllm_engine.version == 3
    await vllm_engine.reset_weights(tiny_model_dir)
