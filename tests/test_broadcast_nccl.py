"""Weights by broadcast on GPUs (#40): which collective an epoch uses, and the bound on a round whose member
died under NCCL. NCCL gives no signal on a dead peer (its broadcast waits on), so the control plane's lease
is what ends such a round: the learner aborts the group (ncclCommAbort) as soon as the lease check sees the
member gone. No GPU here: the sender is a fake of BroadcastSender's protocol whose send, like NCCL's, never
fails by itself and ends only when the group is aborted; the Coordinator is the real one."""

from __future__ import annotations

import asyncio
import threading
import time

from pipeline.records import EpochMember
from weights.membership import LEASE_CHECK_S, SETTLE_S, Coordinator, RoundResult, group_backend
from weights.sender import BroadcastSender, state_layout


def test_an_epoch_is_nccl_only_when_the_learner_and_every_member_are_on_cuda():
    import torch

    layout = state_layout({"w": torch.zeros(2)})
    cuda = BroadcastSender(dict, layout, chunk_bytes=1, timeout_s=1, cuda=True)
    cpu = BroadcastSender(dict, layout, chunk_bytes=1, timeout_s=1)
    try:
        assert group_backend(cuda.backends, [["nccl", "gloo"], ["nccl", "gloo"]]) == "nccl"
        assert group_backend(cuda.backends, [["nccl", "gloo"], ["gloo"]]) == "gloo"  # one member on CPU
        assert group_backend(cpu.backends, [["nccl", "gloo"]]) == "gloo"  # the learner on CPU
        assert group_backend(cuda.backends, []) == "nccl"
    finally:
        cuda.close()
        cpu.close()


class HangingSender:
    """BroadcastSender's protocol; ``send`` blocks (in a thread, as the real one) until ``abort_group``."""

    total_bytes = 1024

    def __init__(self) -> None:
        self.backends = ["nccl", "gloo"]
        self.aborted = threading.Event()
        self.aborted_at: float | None = None

    async def send(self, epoch: int, version: int) -> int:
        if not await asyncio.to_thread(self.aborted.wait, 600):
            return self.total_bytes
        raise RuntimeError("NCCL communicator was aborted")

    def abort_group(self) -> None:
        self.aborted_at = time.monotonic()
        self.aborted.set()

    def close_group(self) -> None:
        self.aborted.set()


async def _round_with_a_dead_member(backend: str, deadline_s: float):
    sender = HangingSender()
    leases = {"w1": 1, "w2": 2}

    async def alive() -> dict[str, int]:
        return dict(leases)

    coordinator = Coordinator(sender, alive, address="127.0.0.1", timeout_s=30.0)
    coordinator.epoch, coordinator.backend = 1, backend
    coordinator.group = (EpochMember(worker="w1", nonce=1, rank_offset=1), EpochMember(worker="w2", nonce=2, rank_offset=2))
    result = RoundResult(version=1)
    started = time.monotonic()
    rounding = asyncio.ensure_future(coordinator._round(1, result))
    await asyncio.sleep(0)  # the round has started (its WeightsRound is out); w2 dies now: its lease goes
    del leases["w2"]
    done, _ = await asyncio.wait({rounding}, timeout=deadline_s)
    return sender, coordinator, rounding, bool(done), time.monotonic() - started


async def test_a_dead_member_under_nccl_ends_the_round_within_the_lease_check():
    """w2's lease goes mid-round: the learner aborts the group within LEASE_CHECK_S (not at the round's bound,
    4 x weight_sync_timeout_s = 120 s here), the round fails with the reason, and the silent members are left
    out after SETTLE_S (the survivors of an aborted NCCL group cannot answer either: both rebuild)."""
    sender, coordinator, rounding, done, took = await _round_with_a_dead_member("nccl", LEASE_CHECK_S + SETTLE_S + 10)
    if not done:
        sender.close_group()
        await rounding
    assert done, "the round did not end: a dead member under NCCL hung it"
    reason = rounding.result()
    assert reason is not None and "send failed" in reason and "aborted" in reason, reason
    assert sender.aborted_at is not None
    assert took <= LEASE_CHECK_S + SETTLE_S + 5, took
    assert {w for w, _ in coordinator.left_out} == {"w1", "w2"}


async def test_on_gloo_a_lapsed_lease_does_not_cut_the_round():
    """gloo's chain fails a round with a dead member by itself, at once: a lease that lapsed (a slow but live
    member, its heartbeat late) aborts nothing there."""
    sender, _, rounding, done, _ = await _round_with_a_dead_member("gloo", LEASE_CHECK_S * 2 + 1)
    assert not done and sender.aborted_at is None
    sender.close_group()  # the chain's own failure, as gloo raises it
    assert "send failed" in await rounding
