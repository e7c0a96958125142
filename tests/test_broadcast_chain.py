"""The learner's network card carries each byte of a version once, however many engines receive it (#29):
the sender (learner rank 0) on host "a", four receivers on host "b" (tests/netns.py), one round of a known
byte count through weights/transfer.py's ``send`` / ``receive``; the bytes on a's end of the link are
read from its veth's counter. A one-to-all or tree broadcast puts several copies on that link: the same bytes
as gloo's own broadcast (a binomial tree: its root sends to ranks 1, 2 and 4 of five) are measured in the same
group, and must show it, so the measurement itself can fail."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import signal
import time

import pytest
import torch
from netns import TwoHosts, two_namespaces_fixture  # noqa: F401  (the two_namespaces fixture)

from weights import transfer
from weights.transfer import PIPELINE_CHUNK, BroadcastError, Group, Layout, round_chunks

RECEIVERS = 4
WORLD = RECEIVERS + 1
CHUNK = 64 << 20  # rollout.weight_sync_chunk_mb's default: the chain cuts its own, smaller chunks
TIMEOUT_S = 30.0
WAIT_S = 120.0  # for a process's next answer (five processes start torch on two cores)


def payload() -> dict[str, torch.Tensor]:
    """32 MiB of large parameters (sent straight from their memory) and small ones of three dtypes (packed)."""
    g = torch.Generator().manual_seed(7)
    state = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(8)}
    state["norm.weight"] = torch.randn(1000, generator=g)
    state["half"] = torch.randn(37, 11, generator=g).to(torch.bfloat16)
    state["steps"] = torch.arange(13)
    return state


def stream(state: dict[str, torch.Tensor], layout: Layout) -> torch.Tensor:
    """The version as one byte stream in the layout's order (padding zeroed): what the raw broadcast sends."""
    out = torch.zeros(layout.total, dtype=torch.uint8)
    for name, offset, size in zip(layout.names, layout.offsets, layout.sizes, strict=True):
        out[offset : offset + size] = state[name].contiguous().view(-1).view(torch.uint8)
    return out


def params_digest(named) -> str:
    h = hashlib.sha256()
    for name, tensor in named:
        h.update(name.encode())
        h.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _sender(address: str, conn) -> None:
    """Learner rank 0 on host a: forms the group, then one chain round and one raw gloo broadcast, each
    when told (the test reads the link's counter around each)."""
    state = payload()
    layout = Layout.of_tensors(state.items())
    sock = transfer.listen(address)
    conn.send(sock.getsockname()[1])
    group = Group(address=address, port=sock.getsockname()[1], rank=0, world_size=WORLD, backend="gloo",
                  timeout_s=TIMEOUT_S, local_address=address, key="epoch-1", listen_socket=sock)
    conn.send("formed")
    assert conn.recv() == "chain"
    sent = transfer.send(group, (state[n] for n in layout.names), layout, CHUNK, epoch=1, version=1)
    conn.send(sent)
    assert conn.recv() == "raw"
    raw = stream(state, layout)
    works = [group.broadcast(raw[start : start + CHUNK]) for start in range(0, layout.total, CHUNK)]
    for work in works:
        group.wait(work)
    conn.send(layout.total)
    conn.recv()  # until the test is done reading: the group stays up
    group.close()


def _receiver(address: str, port: int, rank: int, local_address: str, out) -> None:
    """A member on host b: the chain round (its parameters' digest), then the raw broadcast (the stream's)."""
    layout = Layout.of_tensors(payload().items())
    group = Group(address=address, port=port, rank=rank, world_size=WORLD, backend="gloo", timeout_s=TIMEOUT_S,
                  local_address=local_address, key="epoch-1")
    staging = transfer.receive(group, layout, CHUNK, epoch=1, version=1)
    out.put(("chain", rank, params_digest(transfer.unpack(staging, layout))))
    raw = torch.empty(layout.total, dtype=torch.uint8)
    works = [group.broadcast(raw[start : start + CHUNK]) for start in range(0, layout.total, CHUNK)]
    for work in works:
        group.wait(work)
    out.put(("raw", rank, hashlib.sha256(raw.numpy().tobytes()).hexdigest()))
    group.close()


def reap(procs) -> None:
    """Join each child process (30 s), SIGKILLing one that is still alive."""
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)


def _answer(conn):
    assert conn.poll(WAIT_S), f"no answer from the sender within {WAIT_S:.0f} s"
    return conn.recv()


def test_the_learners_link_carries_each_byte_once(two_namespaces: TwoHosts):
    hosts = two_namespaces
    state = payload()
    layout = Layout.of_tensors(state.items())
    ctx = multiprocessing.get_context("spawn")
    # Made here, before any process starts inside a namespace: multiprocessing's helper process (started
    # with the first queue) stays in this one.
    results = ctx.Queue()
    test_end, sender_end = ctx.Pipe()
    with hosts.inside("a"):
        sender = ctx.Process(target=_sender, args=(hosts.address["a"], sender_end))
        sender.start()
    procs = [sender]
    try:
        port = _answer(test_end)
        with hosts.inside("b"):
            for rank in range(1, WORLD):
                procs.append(ctx.Process(target=_receiver,
                                         args=(hosts.address["a"], port, rank, hosts.address["b"], results)))
                procs[-1].start()
        assert _answer(test_end) == "formed"

        before = hosts.tx_bytes("a")
        test_end.send("chain")
        assert _answer(test_end) == layout.total
        chain_tx = hosts.tx_bytes("a") - before
        chain = [results.get(timeout=WAIT_S) for _ in range(RECEIVERS)]

        before = hosts.tx_bytes("a")
        test_end.send("raw")
        assert _answer(test_end) == layout.total
        raw_tx = hosts.tx_bytes("a") - before
        raw = [results.get(timeout=WAIT_S) for _ in range(RECEIVERS)]
        test_end.send("done")
    finally:
        reap(procs)

    # Every receiver holds exactly the sender's bytes, both ways.
    assert sorted(rank for kind, rank, _ in chain if kind == "chain") == list(range(1, WORLD))
    assert {digest for _, _, digest in chain} == {params_digest((n, state[n]) for n in layout.names)}
    assert {digest for _, _, digest in raw} == {hashlib.sha256(stream(state, layout).numpy().tobytes()).hexdigest()}
    # One copy on the learner's link (plus TCP/IP headers, ~4 % at a 1500-byte MTU), against gloo's tree.
    assert chain_tx < 1.2 * layout.total, (chain_tx, layout.total)
    assert raw_tx >= 2 * layout.total, (raw_tx, layout.total)


def test_a_chain_cuts_small_chunks_and_nccl_keeps_the_cap():
    layout = Layout.of_tensors(payload().items())
    chain, nccl = round_chunks(layout, CHUNK, "gloo"), round_chunks(layout, CHUNK, "nccl")
    assert max(end - start for start, end, _ in chain) == PIPELINE_CHUNK
    assert max(end - start for start, end, _ in nccl) == 4 << 20  # a large parameter goes alone, whole
    assert round_chunks(layout, 1 << 20, "gloo") == layout.chunks(1 << 20)  # the cap stays the cap
    assert chain == layout.chunks(PIPELINE_CHUNK) and nccl == layout.chunks(CHUNK)


FAULT_TIMEOUT_S = 60.0  # the group's timeout; a break must travel the chain in a fraction of it
FAILS_WITHIN_S = 10.0


def _fault_receiver(address: str, port: int, rank: int, world: int, local_address: str, die_at: int | None,
                    out) -> None:
    layout = Layout.of_tensors(payload().items())
    group = Group(address=address, port=port, rank=rank, world_size=world, backend="gloo",
                  timeout_s=FAULT_TIMEOUT_S, local_address=local_address, key="epoch-1")

    def on_chunk(index: int) -> None:
        if index == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    started = time.monotonic()
    try:
        transfer.receive(group, layout, CHUNK, epoch=1, version=1, on_chunk=on_chunk)
    except BroadcastError as exc:
        out.put((rank, "failed", time.monotonic() - started, str(exc)))
    else:
        out.put((rank, "received", time.monotonic() - started, ""))
    group.close()


@pytest.mark.parametrize("network, victim", [("loopback", 3), ("veth", 1)])
def test_a_member_killed_mid_round_fails_the_whole_chain_at_once(request, network: str, victim: int):
    """A member of three is SIGKILLed a few chunks into a round: the break travels up the chain to the learner
    (its send raises) and down it, and every survivor's receive fails, all within a sixth of the group's
    timeout (no one waits it out). On loopback the last member dies; over a link shaped to 1 Gbit/s (the
    learner on host a, the members on host b) the learner's own neighbour, while the learner's chunks to it
    are still on the wire (gloo does not fail an operation already on the wire when its connection breaks:
    the chain never waits on one)."""
    state = payload()
    layout = Layout.of_tensors(state.items())
    world = 4
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    if network == "veth":
        hosts: TwoHosts = request.getfixturevalue("two_namespaces")
        hosts.limit_rate("a", "1gbit")
        def learner_side() -> contextlib.AbstractContextManager:
            return hosts.inside("a")

        def member_side() -> contextlib.AbstractContextManager:
            return hosts.inside("b")

        address, local = hosts.address["a"], hosts.address["b"]
    else:
        learner_side = member_side = contextlib.nullcontext
        address = local = "127.0.0.1"
    with learner_side():
        sock = transfer.listen(address)
    port = sock.getsockname()[1]
    procs = [ctx.Process(target=_fault_receiver,
                         args=(address, port, rank, world, local, 3 if rank == victim else None, out))
             for rank in range(1, world)]
    with member_side():
        for proc in procs:
            proc.start()
    try:
        with learner_side():
            group = Group(address=address, port=port, rank=0, world_size=world, backend="gloo",
                          timeout_s=FAULT_TIMEOUT_S, local_address=address, key="epoch-1", listen_socket=sock)
            started = time.monotonic()
            try:
                transfer.send(group, (state[n] for n in layout.names), layout, CHUNK, epoch=1, version=1)
            except BroadcastError as exc:
                sender = ("failed", time.monotonic() - started, str(exc))
            else:
                sender = ("sent", time.monotonic() - started, "")
            group.close()
        survivors = sorted(out.get(timeout=WAIT_S) for _ in range(world - 2))
    finally:
        reap(procs)
    assert procs[victim - 1].exitcode == -signal.SIGKILL
    assert sender[0] == "failed" and sender[1] < FAILS_WITHIN_S, sender
    assert [(rank, outcome) for rank, outcome, _, _ in survivors] == [
        (rank, "failed") for rank in range(1, world) if rank != victim], survivors
    assert all(seconds < FAILS_WITHIN_S for _, _, seconds, _ in survivors), survivors
