"""Advantage core (numbers) and the stage's grouping (any order, duplicates, exactly once)."""

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.records import GroupClosed, ScoredTrajectory, Trajectory, pack_f32, pack_i32
from stages.advantage import Advantage, compute_advantages


def test_group_scaling_matches_hand_computation():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0]
    prompts = ["a", "a", "a", "a", "b", "b"]
    requests = ["a0", "a1", "a2", "a3", "b0", "b1"]
    adv = compute_advantages(rewards, prompts, requests)
    std_a = np.std([1, 0, 0, 1], ddof=1)
    assert adv.dtype == np.float64
    assert np.allclose(adv[:4], (np.array([1, 0, 0, 1]) - 0.5) / (std_a + 1e-4))
    assert np.allclose(adv[4:], 0.0)  # equal rewards: zero advantage


def test_batch_and_none_scaling():
    rewards = [1.0, 0.0, 3.0, 1.0]
    prompts = ["a", "a", "b", "b"]
    requests = ["a0", "a1", "b0", "b1"]
    none = compute_advantages(rewards, prompts, requests, scale_rewards="none")
    assert none.tolist() == [0.5, -0.5, 1.0, -1.0]
    batch = compute_advantages(rewards, prompts, requests, scale_rewards="batch")
    assert np.allclose(batch, none / (np.std(rewards, ddof=1) + 1e-4))


def test_request_aware_broadcast_and_single_request():
    # Request a0 was split into 3 records; statistics count it once.
    rewards = [1.0, 1.0, 1.0, 0.0]
    prompts = ["a"] * 4
    requests = ["a0", "a0", "a0", "a1"]
    adv = compute_advantages(rewards, prompts, requests)
    expected = 0.5 / (np.std([1.0, 0.0], ddof=1) + 1e-4)
    assert np.allclose(adv, [expected, expected, expected, -expected])
    assert compute_advantages([3.0], ["x"], ["x0"]).tolist() == [0.0]


def test_inconsistent_request_rewards_raise_naming_the_request():
    with pytest.raises(ValueError, match="a0"):
        compute_advantages([1.0, 0.5], ["a", "a"], ["a0", "a0"])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-10, 10), min_size=2, max_size=16), st.sampled_from(["group", "none"]))
def test_advantages_sum_to_zero_per_group(rewards, scale):
    prompts = ["p" if i % 2 else "q" for i in range(len(rewards))]
    requests = [f"r{i}" for i in range(len(rewards))]
    adv = compute_advantages(rewards, prompts, requests, scale_rewards=scale)
    for p in ("p", "q"):
        idx = [i for i, x in enumerate(prompts) if x == p]
        assert abs(adv[idx].sum()) < 1e-6 * max(1.0, np.abs(adv).max())


# ---------------------------------------------------------------------------- the stage


class Ctx:
    run, stage, worker, stopping = "t", "advantage", "w", False

    def request_stop(self, reason):
        self.stopping = True


class Cfg:
    class grpo:
        scale_rewards = "group"
        prompt_batch_size = 2


def make_group(prompt, n, rewards):
    recs = []
    for i in range(n):
        t = Trajectory(
            prompt_id=prompt, attempt=0, request_id=f"{prompt}/0/{i}", generation_batch=0,
            prompt_ids=pack_i32([1]), completion_ids=pack_i32([2]), logprobs=pack_f32([-1.0]),
            policy_version=0, max_policy_version=0,
        )
        recs.append(ScoredTrajectory(trajectory=t, rewards={"accuracy": rewards[i]}, reward=rewards[i]))
    manifest = GroupClosed(prompt_id=prompt, attempt=0, generation_batch=0, record_ids=[r.record_id for r in recs])
    return recs, manifest


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(1, 3))
def test_any_order_and_duplicates_give_each_group_once(rng, duplicates):
    groups = {p: make_group(p, 4, [float(rng.random() > 0.5) for _ in range(4)]) for p in ("p1", "p2", "p3")}
    stream = []
    for recs, manifest in groups.values():
        stream += recs + [manifest]
    stream = stream * duplicates
    rng.shuffle(stream)
    stage = Advantage(Cfg())
    emitted, held, released = [], set(), set()

    async def drive():
        for record in stream:
            out = await stage.handle(record, Ctx())
            if out.hold:
                held.add(record.record_id)
            released.update(out.release)
            emitted.extend(r for _, r in out.outputs)

    asyncio.run(drive())
    assert sorted(g.prompt_id for g in emitted) == ["p1", "p2", "p3"]
    for g in emitted:
        recs, manifest = groups[g.prompt_id]
        assert [r.record_id for r in g.records] == manifest.record_ids  # whole, in manifest order
        assert abs(sum(g.advantages)) < 1e-6
    assert held <= released  # everything held is eventually acked with its group


def test_batch_scaling_waits_for_the_whole_generation_batch():
    cfg = Cfg()
    cfg.grpo = type("g", (), {"scale_rewards": "batch", "prompt_batch_size": 2})
    stage = Advantage(cfg)
    (r1, m1), (r2, m2) = make_group("a", 2, [1.0, 0.0]), make_group("b", 2, [3.0, 1.0])

    async def drive():
        outs = []
        for record in r1 + [m1] + r2 + [m2]:
            outs.append(await stage.handle(record, Ctx()))
        return outs

    outs = asyncio.run(drive())
    assert all(not o.outputs for o in outs[:-1])
    groups = [r for _, r in outs[-1].outputs]
    std = np.std([1.0, 0.0, 3.0, 1.0], ddof=1) + 1e-4
    assert np.allclose(groups[0].advantages + groups[1].advantages, np.array([0.5, -0.5, 1.0, -1.0]) / std)
