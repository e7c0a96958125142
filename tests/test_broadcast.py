"""Weights by broadcast (rollout.weight_transport = "broadcast", #29) on one host: the wire format is exact,
a real vLLM engine loads a broadcast version exactly as it loads the same weights from a file, and the
control plane (weights/membership.py) forms groups, survives a member killed mid-round, serves a late
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
from fake_context import FakeContext

from pipeline.records import EpochMember, WeightsEpoch
from weights import transfer
from weights.sender import BroadcastSender, state_layout
from weights.transfer import Group, Layout

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
    staging = transfer.receive(group, layout, chunk, epoch=1, version=3)
    # Plain bytes: a tensor put on a queue is shared through this process's fd server, gone once it exits
    # (the parent, reading late on a loaded machine, then failed with FileNotFoundError).
    out.put((rank, staging.numpy().tobytes()))


def test_layout_aligns_every_parameter_and_bounds_chunks():
    layout = Layout.of(["a", "b", "c", "d", "e"], ["float32", "bfloat16", "int64", "uint8", "float32"],
                       [[3], [5, 1], [2, 2], [250], [1]])
    assert layout.offsets == (0, 64, 128, 192, 448) and layout.sizes == (12, 10, 32, 250, 4) and layout.total == 512
    # small ones packed (never over 100 bytes), a large one straight from its memory in 100-byte slices
    assert layout.chunks(100) == [(0, 74, None), (128, 160, None), (192, 292, 3), (292, 392, 3), (392, 442, 3),
                                  (448, 452, None)]
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
        got = {rank: dict(transfer.unpack(torch.frombuffer(bytearray(data), dtype=torch.uint8), layout))
               for rank, data in (out.get(timeout=60) for _ in procs)}
    finally:
        sender.close()
        for p in procs:
            p.join(timeout=30)
    for received in got.values():
        assert received.keys() == state.keys()
        for name, tensor in state.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_listen_refuses_the_wildcard_address():
    with pytest.raises(transfer.BroadcastError, match="weight_sync_address"):
        transfer.listen("0.0.0.0")


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

        # A restarted learner's older version replaces these weights all the same (load=True), and its label.
        older = perturbed_state(tiny_model_dir, seed=12)
        state_of = {"now": older}
        sender.weights = lambda: state_of["now"]
        await asyncio.gather(sender.send(1, 3), vllm_engine.receive_broadcast(1, 3, 20, load=True))
        assert await vllm_engine.commit_broadcast(3, "pause") > 0
        assert vllm_engine.version == 3 and await _engine_logprobs(vllm_engine) != by_broadcast

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
# Training runs on weight_transport = "broadcast"


def broadcast_config(tmp_path, *extra):
    import json
    import uuid

    from config import load_config

    return load_config("configs/demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", "rollout.max_model_len=256", "grpo.max_staleness=0",
        "rollout.weight_transport=broadcast", "rollout.weight_sync_timeout_s=20", "rollout.weight_sync_chunk_mb=0.25",
        f"run.name=bc-{uuid.uuid4().hex[:6]}", *extra,
    ])


@pytest.mark.e2e
@pytest.mark.parametrize("weight_load", ["pause", "in_flight"])
async def test_a_training_run_on_broadcast(tmp_path, vllm_engine, tiny_model_dir, weight_load):
    """Every version reaches the engine by broadcast (no snapshot written): at max_staleness 0 every sample
    comes from the learner's weights, and the engine's log-probs of the sampled tokens equal the learner's.
    Under either gate: between turns, or between two engine steps while requests run."""
    import json

    from rollstream import train

    await vllm_engine.reset_weights(tiny_model_dir)
    cfg = broadcast_config(tmp_path, "run.max_steps=12", f"rollout.weight_load={weight_load}")
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


# ---------------------------------------------------------------------------------------------------
# The control plane over a real Redis, members as processes running the engine's receive code (no vLLM:
# weights.transfer.PlainReceiver), each one a real Worker with its heartbeat lease.

TIMEOUT_S = 5.0  # rollout.weight_sync_timeout_s of these groups
CHUNK = 1 << 20


def digest(state: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def version_state(version: int) -> dict[str, torch.Tensor]:
    """The learner's weights at ``version``: 16 MiB in 16 chunks (a round lasts a few hundred ms here)."""
    g = torch.Generator().manual_seed(version)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(4)}


def _member_process(url: str, run: str, worker: str, out_file: str, die_at, stall_at) -> None:
    asyncio.run(_member_main(url, run, worker, out_file, die_at, stall_at))


async def _member_main(url, run, worker_id, out_file, die_at, stall_at) -> None:
    import json

    from pipeline.transport import connect
    from pipeline.worker import Worker
    from weights.membership import MemberStage

    receiver = transfer.PlainReceiver()

    def on_chunk(index: int) -> None:  # a real SIGKILL / SIGSTOP of this process, mid-round
        if die_at and (receiver.receiving, index) == tuple(die_at):
            os.kill(os.getpid(), signal.SIGKILL)
        if stall_at and (receiver.receiving, index) == tuple(stall_at):
            os.kill(os.getpid(), signal.SIGSTOP)

    receiver.on_chunk = on_chunk
    commit = receiver.commit_broadcast

    async def commit_and_record(version: int, mode: str) -> float:
        seconds = await commit(version, mode)
        if seconds:
            with open(out_file, "a") as f:  # noqa: ASYNC230 - one short line, in a test member
                f.write(json.dumps({"version": version, "digest": digest(receiver.state)}) + "\n")
        return seconds

    receiver.commit_broadcast = commit_and_record
    transport = await connect("redis", run=run, url=url)
    worker = Worker(MemberStage(receiver), transport, run=run, worker_id=worker_id, block_ms=100, lease_ttl_ms=3000)
    try:
        await worker.serve()
    finally:
        await transport.close()


class Group3:
    """A learner (a Coordinator in this process, its own Worker) and member processes on one Redis run."""

    def __init__(self, redis_url: str, tmp_path: Path) -> None:
        import uuid

        self.url, self.tmp = redis_url, tmp_path
        self.run = f"bc-{uuid.uuid4().hex[:8]}"
        self.current = 0
        self.states = {v: version_state(v) for v in range(5)}
        self.procs: dict[str, multiprocessing.Process] = {}
        self.learner = None

    async def start_learner(self, first_epoch: int = 1) -> None:
        from pipeline.transport import connect
        from pipeline.worker import Worker
        from weights.membership import MEMBER_LEASE, Coordinator, CoordinatorStage

        sender = BroadcastSender(lambda: self.states[self.current], state_layout(self.states[0]), chunk_bytes=CHUNK,
                                 timeout_s=TIMEOUT_S)
        self.stage = CoordinatorStage(lambda ctx: Coordinator(
            sender, lambda: ctx.leases(MEMBER_LEASE), address="127.0.0.1", timeout_s=TIMEOUT_S,
            first_epoch=first_epoch, run=self.run))
        self.transport = await connect("redis", run=self.run, url=self.url)
        self.learner = Worker(self.stage, self.transport, run=self.run, block_ms=100)
        self.task = asyncio.create_task(self.learner.serve())
        await self.stage.started.wait()

    async def stop_learner(self) -> None:
        self.learner.request_stop("test over")
        await self.task
        await self.transport.close()

    def start_member(self, name: str, die_at=None, stall_at=None) -> None:
        ctx = multiprocessing.get_context("spawn")
        proc = ctx.Process(target=_member_process,
                           args=(self.url, self.run, name, str(self.tmp / f"{name}.jsonl"), die_at, stall_at))
        proc.start()
        self.procs[name] = proc

    async def members_live(self, *names: str) -> None:
        from polling import wait_until

        async def live() -> bool:
            return {m.worker for m in await self.stage.coordinator.live_members()} == set(names)

        await wait_until(live, f"members {names} registered and alive", timeout_s=90, interval_s=0.1)

    async def publish(self, version: int):
        self.current = version
        return await self.stage.coordinator.publish(version)

    def commits(self, name: str) -> list[tuple[int, str]]:
        import json

        path = self.tmp / f"{name}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [(r["version"], r["digest"]) for r in rows]

    def expected(self, *versions: int) -> list[tuple[int, str]]:
        return [(v, digest(self.states[v])) for v in versions]

    async def close(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
        if self.learner is not None and not self.task.done():
            await self.stop_learner()
        from pipeline.transport import connect

        transport = await connect("redis", run=self.run, url=self.url)
        await transport.delete_run()
        await transport.close()


@pytest.fixture
async def group3(redis_url, tmp_path):
    group = Group3(redis_url, tmp_path)
    yield group
    await group.close()


async def test_a_member_killed_mid_round_costs_one_resend(group3):
    """b is SIGKILLed in the middle of version 2's round: the round fails within the group's timeout, the
    learner rebuilds without b and sends version 2 again, in full; a and c hold exactly version 2, and
    never held anything but whole versions (every commit's digest is the learner's)."""
    await group3.start_learner()
    for name, die_at in (("a", None), ("b", (2, 3)), ("c", None)):
        group3.start_member(name, die_at=die_at)
    await group3.members_live("a", "b", "c")
    first = await group3.publish(1)
    # The set-up round: on a loaded 2-core CI machine its first attempt failed once (of four clean-clone runs)
    # and was resent (the group recovers, as designed); what this test measures is version 2's round.
    assert first.delivered and first.members == 3
    failed_before = group3.stage.coordinator.rounds_failed
    started = time.monotonic()
    second = await group3.publish(2)
    elapsed = time.monotonic() - started
    assert second.delivered and second.attempts == 2 and second.members == 2, second
    assert elapsed < 10, second  # a failed round, a rebuild, a full resend: under the 10 s
    assert group3.stage.coordinator.rounds_failed == failed_before + 1
    for survivor in ("a", "c"):
        assert group3.commits(survivor) == group3.expected(1, 2)
    assert group3.commits("b") == group3.expected(1)
    group3.procs["b"].join(timeout=10)
    assert group3.procs["b"].exitcode == -signal.SIGKILL


async def test_a_stalled_member_is_left_out_after_the_timeout(group3):
    """c stops (SIGSTOP) in the middle of version 2's round: the learner's round fails once a chunk waits
    past the group's timeout, and the others get version 2 in the next epoch."""
    await group3.start_learner()
    for name, stall_at in (("a", None), ("c", (2, 5))):
        group3.start_member(name, stall_at=stall_at)
    await group3.members_live("a", "c")
    assert (await group3.publish(1)).delivered
    epoch = group3.stage.coordinator.epoch
    started = time.monotonic()
    second = await group3.publish(2)
    elapsed = time.monotonic() - started
    assert second.delivered and second.attempts == 2 and second.members == 1, second
    assert TIMEOUT_S * 0.8 < elapsed < 5 * TIMEOUT_S, elapsed
    assert group3.stage.coordinator.epoch == epoch + 1
    assert group3.commits("a") == group3.expected(1, 2)
    assert group3.commits("c") == group3.expected(1)


async def test_a_late_joiner_and_a_restarted_learner(group3):
    """d joins after version 1: it is sent version 1 (a receives it again and drops it), then both take
    version 2. The learner restarts from an older checkpoint: its new epoch sends the restored version 1,
    which both load although they hold version 2, then its own version 2 (other weights than its
    predecessor's) reaches both."""
    await group3.start_learner()
    group3.start_member("a")
    await group3.members_live("a")
    assert (await group3.publish(1)).delivered
    assert not await group3.stage.coordinator.pending_joiners()
    group3.start_member("d")
    await group3.members_live("a", "d")
    assert await group3.stage.coordinator.pending_joiners()  # what the learner's on_idle looks at
    joined = await group3.publish(1)
    assert joined.delivered and joined.members == 2
    assert (await group3.publish(2)).delivered
    old_epoch = group3.stage.coordinator.epoch
    await group3.stop_learner()

    from pipeline.transport import connect
    from pipeline.transport.base import newest_record
    from weights.membership import SYNC_EDGE

    transport = await connect("redis", run=group3.run, url=group3.url)
    newest = await newest_record(transport, SYNC_EDGE)
    await transport.close()
    first_run = group3.expected(1, 2)
    group3.states[2] = version_state(102)  # the resumed learner trains version 2 again, differently
    await group3.start_learner(first_epoch=newest.epoch + 1)
    await group3.members_live("a", "d")
    restored = await group3.publish(1)
    assert restored.delivered and restored.epoch > old_epoch
    assert (await group3.publish(2)).delivered
    assert group3.commits("a") == first_run + group3.expected(1, 2)
    assert group3.commits("d") == first_run + group3.expected(1, 2)


async def test_an_unreachable_learner_is_reported_not_waited_for(tmp_path):
    """A member told to join at an address it cannot reach answers "unreachable <addr>" at once and keeps
    the error for its worker to fail with (never a hang in a rendezvous)."""
    import socket

    from pipeline.records import WeightsAck
    from weights.membership import Member

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        member = Member("w", transfer.PlainReceiver(), mode="pause")
        me = EpochMember(worker="w", nonce=member.nonce)
        record = WeightsEpoch(epoch=1, phase="open", address="127.0.0.1", port=port, backend="gloo", members=[me])
        started = time.monotonic()
        await member.on_record(record)
    assert time.monotonic() - started < 6
    ack = member.outbox.get_nowait()
    assert isinstance(ack, WeightsAck) and not ack.ok and ack.step == "reach"
    assert ack.error.startswith(f"unreachable 127.0.0.1:{port}")
    assert "rollout.weight_sync_address" in member.error


async def test_top_shows_the_weights_group():
    """`rollstream top` reads the group's newest epoch from its edge and the live members from their leases."""
    import io
    import uuid

    from rich.console import Console

    from pipeline.records import WeightsAck, encode
    from pipeline.transport import connect
    from rollstream import top
    from weights.membership import MEMBER_LEASE, SYNC_EDGE

    transport = await connect("memory", run=f"bc-top-{uuid.uuid4().hex[:6]}")
    assert (await top.snapshot(transport))["group"] is None  # a run without a group shows none
    await transport.produce(SYNC_EDGE, [encode(WeightsAck(epoch=4, worker="rollout-a", nonce=1, step="load"))])
    await transport.lease(MEMBER_LEASE, "rollout-a", 1, 10_000)
    snap = await top.snapshot(transport)
    assert snap["group"] == {"epoch": 4, "members": ["rollout-a"]}
    out = io.StringIO()
    Console(file=out, width=200).print(top.render(snap))
    assert "weights group: epoch 4, 1 live members (rollout-a)" in out.getvalue()


# ---------------------------------------------------------------------------------------------------
# The Procfile's workers as processes (what tests/test_two_hosts.py runs across two network namespaces)


@pytest.mark.e2e
@pytest.mark.slow
async def test_procfile_workers_on_broadcast_with_two_engines(tmp_path, redis_url):
    """The stage workers as `rollstream worker` processes, two rollout workers (two engines, one group), each
    rollout worker with an output_dir of its own: the run ends, every version went to both engines by
    broadcast (at max_staleness 0 their log-probs are the learner's), and the ledger check is clean."""
    import json
    import sys
    import uuid

    from procs import kill_spawned, spawn_logged

    from pipeline import ledger
    from pipeline.records import WeightsEpoch, WeightsMember, decode
    from pipeline.transport import connect
    from weights.membership import SYNC_EDGE

    run = f"bc-procs-{uuid.uuid4().hex[:6]}"
    common = [
        f"run.name={run}", f"transport.url={redis_url}", "run.max_steps=8", "run.metrics_port=0", "run.ledger=true",
        "grpo.generation_batch_size=32", "grpo.per_device_train_batch_size=8", "grpo.max_staleness=0",
        "rollout.max_model_len=256", "rollout.weight_transport=broadcast", "rollout.weight_sync_timeout_s=30",
        "transport.min_idle_ms=5000",
    ]
    processes = {}

    async def spawn(stage: str, name: str) -> None:
        out = tmp_path / ("learner-host" if stage != "rollout" else f"{name}-host")
        argv = [sys.executable, "-m", "rollstream.cli", "worker", stage, "-c", "configs/demo-redis.toml",
                "--worker-id", name]
        for setting in [*common, f"run.output_dir={json.dumps(str(out))}"]:
            argv += ["--set", setting]
        processes[name] = await spawn_logged(argv, tmp_path / f"{name}.log")

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))

    transport = await connect("redis", run=run, url=redis_url)
    try:
        # The rollout workers first, the run once both registered: a run of two versions forms its group
        # at the first one, and an engine that started later than that would miss the group the test checks
        # (a late joiner is served at the next round, and this run may have none).
        for name in ("rollout-0", "rollout-1"):
            await spawn("rollout", name)
        registered, after, deadline = set(), "0", time.monotonic() + 600
        while registered != {"rollout-0", "rollout-1"}:
            failed = {n: p.returncode for n, p in processes.items() if p.returncode is not None}
            assert not failed, f"workers ended before they registered {failed}:\n{tails()}"
            assert time.monotonic() < deadline, f"the rollout workers did not register within 600 s:\n{tails()}"
            for delivery in await transport.read(SYNC_EDGE, after, 100, 1000):  # blocks up to 1 s for records
                after = delivery.id
                record = decode(delivery.payload)
                if isinstance(record, WeightsMember):
                    registered.add(record.worker)
        for stage in ("feeder", "reward", "advantage", "learner"):
            await spawn(stage, stage)
        deadline = time.monotonic() + 900
        while any(p.returncode is None for p in processes.values()):
            failed = {n: p.returncode for n, p in processes.items() if p.returncode not in (None, 0)}
            assert not failed, f"workers failed {failed}:\n{tails()}"
            assert time.monotonic() < deadline, f"the run did not end within 900 s:\n{tails()}"
            await asyncio.sleep(0.2)  # polling the processes, with a deadline
        assert {n: p.returncode for n, p in processes.items()} == dict.fromkeys(processes, 0), tails()
        learner_dir = tmp_path / "learner-host"
        rows = [json.loads(line) for line in (learner_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 9))
        assert max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4
        assert not (learner_dir / "weights").exists()  # nothing went through files
        epochs, after = [], "0"
        while batch := await transport.read(SYNC_EDGE, after, 500, 0):
            epochs += [r for r in map(decode, (d.payload for d in batch)) if isinstance(r, WeightsEpoch)]
            after = batch[-1].id
        formed = [e for e in epochs if e.phase == "form"]
        assert formed and {m.worker for m in formed[-1].members} == {"rollout-0", "rollout-1"}
        assert formed[-1].world_size == 3 and sorted(m.rank_offset for m in formed[-1].members) == [1, 2]
        audit = ledger.check(*await ledger.read_transport(transport))
        assert audit.ok, audit.violations
    finally:
        await kill_spawned(processes.values())
        await transport.delete_run()
        await transport.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.weight_transport=broadcast", "rollout.weight_sync_address=0.0.0.0"], "is a wildcard"),
        (["rollout.weight_transport=broadcast", "learner.train_type=lora"], "a broadcast sends full weights"),
        (["rollout.weight_transport=nccl"], "is now \"broadcast\""),
    ],
)
def test_what_broadcast_cannot_do_is_refused_at_load(overrides, message):
    from config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config("configs/demo.toml", overrides)


# ---------------------------------------------------------------------------------------------------
# The file path: an announcement a worker cannot load is an error with the fix, never a skip


def _rollout_cfg(mode: str = "file"):
    from config import config_from_dict

    return config_from_dict({
        "grpo": {"max_completion_length": 16},
        "rollout": {"max_model_len": 256, "weight_transport": mode},
        "reward": {"reward_funcs": ["accuracy"]},
    })


@pytest.mark.e2e
async def test_a_snapshot_this_worker_cannot_see_is_an_error_with_the_fix(vllm_engine, tiny_model_dir, tmp_path):
    from pipeline.records import WeightsPublished
    from stages.rollout import Rollout, WeightsUnavailable

    await vllm_engine.reset_weights(tiny_model_dir)
    stage = Rollout(_rollout_cfg(), tiny_model_dir, engine=vllm_engine)
    await stage.start(FakeContext(run='bc', stage='rollout'))
    never = WeightsPublished(version=2, path=str(tmp_path / "elsewhere" / "weights" / "v000002"))
    with pytest.raises(WeightsUnavailable, match=r"not visible from this rollout worker.*broadcast") as caught:
        await stage.on_broadcast(never, FakeContext(run='bc', stage='rollout'))
    assert never.path in str(caught.value) and "run.output_dir" in str(caught.value)
    assert vllm_engine.version == 0
    # The learner sends by broadcast while this worker loads files: a config mismatch, said so.
    by_broadcast = WeightsPublished(version=2, path="broadcast://epoch/1", via="broadcast", epoch=1)
    with pytest.raises(WeightsUnavailable, match="same config"):
        await stage.on_broadcast(by_broadcast, FakeContext(run='bc', stage='rollout'))


def test_the_advertised_address():
    from weights.membership import advertised_address

    assert advertised_address("10.1.2.3", "redis", "redis://10.9.9.9:6379/0") == "10.1.2.3"
    assert advertised_address("", "memory", "") == "127.0.0.1"
    # Redis here: the local end of a connection to it (loopback here, the interface towards it elsewhere).
    assert advertised_address("", "redis", "redis://127.0.0.1:6379/0") == "127.0.0.1"
    with pytest.raises(OSError, match="rollout.weight_sync_address"):
        advertised_address("", "redis", "unix:///run/redis.sock")


@pytest.mark.e2e
@pytest.mark.slow
async def test_a_learner_worker_sigkilled_and_resumed_on_broadcast(tmp_path, redis_url):
    """The learner worker is SIGKILLed one batch past a checkpoint (its rollout worker holds a newer version
    than that checkpoint by then) and restarted with --resume: its new epoch sends the restored weights, the
    rollout loads them, and the samples of the batches after that come from the resumed learner's exact
    weights (max_staleness 0: the engine's log-probs are the learner's); the run ends cleanly."""
    import json
    import sys
    import uuid

    from procs import kill_spawned, spawn_logged

    from pipeline.transport import connect

    run = f"bc-resume-{uuid.uuid4().hex[:6]}"
    out = tmp_path / "learner-host"
    common = [
        f"run.name={run}", f"transport.url={redis_url}", "run.max_steps=64", "run.metrics_port=0",
        "grpo.generation_batch_size=32", "grpo.per_device_train_batch_size=8", "grpo.max_staleness=0",
        "learner.save_steps=8", "rollout.max_model_len=256", "rollout.weight_transport=broadcast",
        "rollout.weight_sync_timeout_s=30", "transport.min_idle_ms=3000", f"run.output_dir={json.dumps(str(out))}",
    ]

    async def start(stage: str, *extra: str):
        argv = [sys.executable, "-m", "rollstream.cli", "worker", stage, "-c", "configs/demo-redis.toml", *extra]
        for setting in common:
            argv += ["--set", setting]
        return await spawn_logged(argv, tmp_path / f"{stage}.log")

    processes = {stage: await start(stage) for stage in ("feeder", "rollout", "reward", "advantage", "learner")}
    transport = await connect("redis", run=run, url=redis_url)

    def tails() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))

    def steps() -> list[dict]:
        path = out / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    async def until(check, what: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not check():
            failed = {n: p.returncode for n, p in processes.items() if p.returncode not in (None, 0)}
            assert not failed, f"workers failed {failed} waiting for {what}:\n{tails()}"
            assert time.monotonic() < deadline, f"no {what} within {seconds} s:\n{tails()}"
            await asyncio.sleep(0.1)  # polling files and processes, with a deadline

    try:
        # Killed between two checkpoints (every 2 versions) right after a version went out: the rollout
        # worker holds a newer version than the one the resumed learner restores, and the resumed learner's
        # own next version will differ from the one the rollout holds under the same number.
        # (metrics.jsonl grows a generation batch, 4 rows, at a time: 12, 20, 28... are past a checkpoint)
        await until(lambda: len(steps()) >= 12 and len(steps()) % 8 == 4, "a batch past a checkpoint", 600)
        killed_at = len(steps())
        assert killed_at < 64 - 16, "the run went too far before the kill"
        os.killpg(processes["learner"].pid, signal.SIGKILL)
        await asyncio.wait_for(processes["learner"].wait(), timeout=60)
        processes["learner"] = await start("learner", "--resume", "latest")
        await until(lambda: all(p.returncode is not None for p in processes.values()), "the end of the run", 600)
        assert {n: p.returncode for n, p in processes.items()} == dict.fromkeys(processes, 0), tails()
        rows = steps()
        assert [r["step"] for r in rows][-1] == 64
        # Every batch sampled after the resumed learner's first rounds comes from its exact weights. (The
        # batch the dead learner's lost version had sampled already counts as fresh to the resumed one, whose
        # version has the same number: that is a resume's, not the broadcast's.)
        key = "sampling/sampling_logp_difference/max"
        later = [r[key] for r in rows if r["step"] > killed_at + 8 and key in r]
        assert len(later) >= 8 and max(later) < 1e-4
    finally:
        await kill_spawned(processes.values())
        await transport.delete_run()
        await transport.close()
