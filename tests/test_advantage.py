"""Advantage core (numbers) and the stage's groups (whole ScoredGroup entries, any order, duplicates, once)."""

import asyncio
import math

import msgspec
import numpy as np
import pytest
from fake_context import FakeContext
from hypothesis import given, settings
from hypothesis import strategies as st

from config import config_from_dict, format_config, load_config, replace
from grpo.advantages import compute_advantages, has_zero_std, kl_penalized_rewards
from pipeline import metrics
from pipeline.records import (
    DeadLetter,
    Feedback,
    GroupClosed,
    PromptTask,
    ScoredGroup,
    ScoredTrajectory,
    TrainGroup,
    Trajectory,
    TrajectoryGroup,
    WeightsPublished,
    decode,
    encode,
    pack_f32,
    pack_i32,
)
from stages.advantage import Advantage, dead_letter_drop


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


def Cfg(prompt_batch_size=2, **grpo):
    """A real config: groups of 4, ``prompt_batch_size`` of them per generation batch."""
    sizes = {"num_generations": 4, "generation_batch_size": 4 * prompt_batch_size,
             "per_device_train_batch_size": 4 * prompt_batch_size}
    return config_from_dict({"reward": {"reward_funcs": ["accuracy"]}, "grpo": {**sizes, **grpo}})


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
    # each group's records shuffled inside its entry; the entries redelivered and shuffled
    stream = [ScoredGroup(manifest=m, records=rng.sample(recs, len(recs))) for recs, m in groups.values()]
    stream = stream * duplicates
    rng.shuffle(stream)
    stage = Advantage(Cfg())
    emitted, held, released = [], set(), set()

    async def drive():
        for record in stream:
            out = await stage.handle(record, FakeContext(stage='advantage', worker='w'))
            if out.hold:
                held.add(record.record_id)
            released.update(out.release)
            emitted.extend(r for _, r in out.outputs)

    asyncio.run(drive())
    assert sorted(g.prompt_id for g in emitted) == ["p1", "p2", "p3"]
    for g in emitted:
        _recs, manifest = groups[g.prompt_id]
        assert [r.record_id for r in g.records] == manifest.record_ids  # whole, in manifest order
        assert abs(sum(g.advantages)) < 1e-6
    assert held <= released  # everything held is eventually acked with its group


def test_batch_scaling_waits_for_the_whole_generation_batch():
    stage = Advantage(Cfg(scale_rewards="batch"))
    (r1, m1), (r2, m2) = make_group("a", 2, [1.0, 0.0]), make_group("b", 2, [3.0, 1.0])

    async def drive():
        outs = []
        for recs, manifest in ((r1, m1), (r2, m2)):
            outs.append(await stage.handle(ScoredGroup(manifest=manifest, records=recs), FakeContext(stage='advantage', worker='w')))
        return outs

    outs = asyncio.run(drive())
    assert not outs[0].outputs and outs[0].hold
    assert sorted(outs[1].release) == ["a/0/scored", "b/0/scored"]  # the held entry acked with the batch
    groups = [r for _, r in outs[-1].outputs]
    std = np.std([1.0, 0.0, 3.0, 1.0], ddof=1) + 1e-4
    assert np.allclose(groups[0].advantages + groups[1].advantages, np.array([0.5, -0.5, 1.0, -1.0]) / std)


def test_a_whole_scored_group_is_one_input_trained_at_once_and_once():
    """The reward stage's ScoredGroup: trained on arrival, acked as one input; a redelivery emits nothing."""
    stage = Advantage(Cfg())
    recs, manifest = make_group("w", 4, [1.0, 0.0, 0.0, 1.0])
    whole = ScoredGroup(manifest=manifest, records=list(reversed(recs)))

    async def drive():
        return [await stage.handle(whole, FakeContext(stage='advantage', worker='w')) for _ in range(2)]

    first, again = asyncio.run(drive())
    [(_, group)] = first.outputs
    assert not first.hold and first.release == [whole.record_id]
    assert [r.record_id for r in group.records] == manifest.record_ids  # the manifest's order
    assert np.allclose(group.advantages, np.array([0.5, -0.5, -0.5, 0.5]) / (np.std([1, 0, 0, 1], ddof=1) + 1e-4))
    assert not again.outputs and not again.hold


async def test_batch_scaling_refuses_a_second_advantage_worker_and_the_first_goes_on():
    """scale_rewards = "batch" needs a whole generation batch in one worker: of two live advantage workers
    the later stops with the reason (FatalStageError), the earlier one trains every group."""
    from pipeline.edges import SCORED, TRAIN
    from pipeline.stage import FatalStageError
    from pipeline.transport.memory import MemoryTransport
    from pipeline.worker import Worker
    from stages.advantage import BATCH_WIDE_LEASE

    transport = MemoryTransport()
    cfg = Cfg(scale_rewards="batch")
    # min_idle_ms: the first takes over what the stopped second left pending soon after it stops
    first = Worker(Advantage(cfg), transport, run="t", worker_id="advantage-a", block_ms=20, min_idle_ms=300)
    second_stage = Advantage(cfg)
    second_stage._started_ms += 1  # started after the first, whatever the clock's resolution
    second = Worker(second_stage, transport, run="t", worker_id="advantage-b", block_ms=20, min_idle_ms=300)
    serving = asyncio.create_task(first.serve())
    deadline = asyncio.get_running_loop().time() + 30
    while "advantage-a" not in await transport.leases(BATCH_WIDE_LEASE):
        assert asyncio.get_running_loop().time() < deadline, "the first worker never took its lease"
        await asyncio.sleep(0.01)  # polling the first worker's heartbeat, with a deadline
    (r1, m1), (r2, m2) = make_group("a", 2, [1.0, 0.0]), make_group("b", 2, [3.0, 1.0])
    with pytest.raises(FatalStageError, match="scale_rewards = 'batch'.*advantage-a runs already"):
        await transport.produce(SCORED, [encode(ScoredGroup(manifest=m1, records=r1))])
        await asyncio.wait_for(second.serve(), timeout=60)
    await transport.produce(SCORED, [encode(ScoredGroup(manifest=m2, records=r2))])
    deadline = asyncio.get_running_loop().time() + 30
    while (await transport.stats(TRAIN)).length < 2:  # the first took both groups of the batch
        assert asyncio.get_running_loop().time() < deadline, "the first worker did not train the batch"
        await asyncio.sleep(0.01)
    first.request_stop("test over")
    assert await asyncio.wait_for(serving, timeout=30) == 0


# ---------------------------------------------------------------------------- advantage_estimator


def test_rloo_uses_the_mean_of_the_other_requests():
    rewards = [1.0, 0.0, 0.0, 1.0, 2.0, 0.0]
    prompts = ["a"] * 4 + ["b"] * 2
    requests = ["a0", "a1", "a2", "a3", "b0", "b1"]
    adv = compute_advantages(rewards, prompts, requests, scale_rewards="none", estimator="rloo")
    # a0: 1 - mean(0, 0, 1) = 2/3; a1: 0 - mean(1, 0, 1) = -2/3; b0: 2 - 0 = 2.
    assert np.allclose(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0, -2.0])
    group = compute_advantages(rewards, prompts, requests, scale_rewards="group", estimator="rloo")
    std_a, std_b = np.std([1, 0, 0, 1], ddof=1), np.std([2, 0], ddof=1)  # std of the rewards, as grpo
    assert np.allclose(group[:4], adv[:4] / (std_a + 1e-4)) and np.allclose(group[4:], adv[4:] / (std_b + 1e-4))


def test_rloo_is_request_aware_and_zero_for_a_lone_request():
    adv = compute_advantages([1.0, 1.0, 0.0], ["a"] * 3, ["a0", "a0", "a1"], scale_rewards="none", estimator="rloo")
    assert adv.tolist() == [1.0, 1.0, -1.0]  # K = 2 requests, not 3 records
    assert compute_advantages([5.0], ["x"], ["x0"], scale_rewards="none", estimator="rloo").tolist() == [0.0]


def test_reinforce_plus_plus_whitens_by_the_batch_std_of_the_advantages():
    rewards = [1.0, 0.0, 3.0, 1.0]
    prompts, requests = ["a", "a", "b", "b"], ["a0", "a1", "b0", "b1"]
    adv = compute_advantages(rewards, prompts, requests, scale_rewards="batch", estimator="reinforce_plus_plus")
    # centered: [0.5, -0.5, 1, -1]; their std (ddof=1) = sqrt(2.5 / 3), not the rewards' sqrt(4.75 / 3).
    assert np.allclose(adv, np.array([0.5, -0.5, 1.0, -1.0]) / (math.sqrt(2.5 / 3) + 1e-4))
    grpo = compute_advantages(rewards, prompts, requests, scale_rewards="batch")
    assert np.allclose(grpo, np.array([0.5, -0.5, 1.0, -1.0]) / (math.sqrt(4.75 / 3) + 1e-4))
    # Within one group the advantages' std is the rewards' std: "group" is grpo's.
    rpp_group = compute_advantages(rewards, prompts, requests, estimator="reinforce_plus_plus")
    assert np.allclose(rpp_group, compute_advantages(rewards, prompts, requests))


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="estimator"):
        compute_advantages([1.0, 0.0], ["a", "a"], ["a0", "a1"], estimator="ppo")


@pytest.mark.parametrize(
    "estimator,scale", [("grpo", "group"), ("rloo", "none"), ("reinforce_plus_plus", "batch")]
)
def test_config_defaults_scale_rewards_per_estimator_as_ms_swift(estimator, scale):
    cfg = load_config(None, ['reward.reward_funcs=["accuracy"]', f"grpo.advantage_estimator={estimator}"])
    assert cfg.grpo.scale_rewards == scale
    assert f"# scale_rewards = \"{scale}\"  (derived" in format_config(cfg)
    explicit = load_config(None, ['reward.reward_funcs=["accuracy"]', f"grpo.advantage_estimator={estimator}",
                                  "grpo.scale_rewards=group"])
    assert explicit.grpo.scale_rewards == "group"
    assert replace(cfg, "grpo", advantage_estimator="rloo").grpo.scale_rewards == "none"  # re-derived


def test_stage_uses_the_configured_estimator():
    stage = Advantage(Cfg(advantage_estimator="rloo", scale_rewards="none"))
    recs, manifest = make_group("p", 3, [1.0, 0.0, 0.0])
    [(_, group)] = run(stage, [ScoredGroup(manifest=manifest, records=recs)])[-1].outputs
    assert np.allclose(group.advantages, [1.0, -0.5, -0.5])  # 1 - 0, 0 - 1/2, 0 - 1/2


# ---------------------------------------------------------------------------- DAPO


def run(stage, records, ctx=None):
    ctx = ctx or FakeContext(stage='advantage', worker='w')

    async def drive():
        return [await stage.handle(r, ctx) for r in records]

    return asyncio.run(drive())


def make_attempt(prompt, attempt, batch, rewards, finish=None):
    recs = []
    for i, reward in enumerate(rewards):
        t = Trajectory(
            prompt_id=prompt, attempt=attempt, request_id=f"{prompt}/{attempt}/{i}", generation_batch=batch,
            prompt_ids=pack_i32([1]), completion_ids=pack_i32([2]), logprobs=pack_f32([-1.0]),
            finish_reason=(finish or ["stop"] * len(rewards))[i], policy_version=0, max_policy_version=0,
        )
        recs.append(ScoredTrajectory(trajectory=t, rewards={"accuracy": reward}, reward=reward))
    manifest = GroupClosed(prompt_id=prompt, attempt=attempt, generation_batch=batch,
                           record_ids=[r.record_id for r in recs])
    return ScoredGroup(manifest=manifest, records=recs)


def counter(metric, *labels):
    return metric.labels(*labels)._value.get()


def test_dynamic_sample_resamples_max_resample_times_rounds_then_trains():
    """ms-swift's rounds: every zero-std group of round r < max_resample_times is re-asked (round r + 1, its
    attempt), however many there are in the batch; a zero-std group of the last round trains as it is."""

    stage = Advantage(Cfg(dynamic_sample=True, max_resample_times=2, prompt_batch_size=3))
    outcomes = []
    for group in (
        # Round 0: two of batch 0's three groups are zero-std, both re-asked (one round, two groups).
        make_attempt("solved", 0, 0, [1.0, 1.0]),
        make_attempt("failed", 0, 0, [0.0, 0.0]),
        make_attempt("mixed", 0, 0, [1.0, 0.0]),
        # Round 1: both replacements zero-std again, both re-asked once more.
        make_attempt("solved2", 1, 0, [1.0, 1.0]),
        make_attempt("failed2", 1, 0, [0.0, 0.0]),
        # Round 2 = max_resample_times: a zero-std group trains as it is, a mixed one trains.
        make_attempt("solved3", 2, 0, [1.0, 1.0]),
        make_attempt("mixed3", 2, 0, [0.5, 0.0]),
        # Another batch's round 0 is re-asked too: rounds are per group, not a budget per batch.
        make_attempt("other", 0, 1, [0.0, 0.0]),
    ):
        [out] = run(stage, [group], FakeContext(run="dapo-test", stage="advantage", worker="w"))
        assert not out.hold and set(out.release) <= {group.record_id}  # acked now, drop or train
        [(edge, record)] = out.outputs
        outcomes.append((edge, record.prompt_id, record.attempt))
    assert outcomes == [
        ("feedback", "solved", 0),
        ("feedback", "failed", 0),
        ("train", "mixed", 0),
        ("feedback", "solved2", 1),
        ("feedback", "failed2", 1),
        ("train", "solved3", 2),  # round max_resample_times: kept as it is
        ("train", "mixed3", 2),
        ("feedback", "other", 0),
    ]
    assert counter(metrics.GROUPS_DROPPED, "dapo-test", "zero_std") == 5
    assert counter(metrics.RESAMPLES, "dapo-test") == 5
    # A fresh stage (a restart) decides the same from the group alone.
    restarted = Advantage(Cfg(dynamic_sample=True, max_resample_times=2, prompt_batch_size=3))
    assert run(restarted, [make_attempt("failed2", 1, 0, [0.0, 0.0])])[-1].outputs[0][0] == "feedback"
    assert run(restarted, [make_attempt("solved3", 2, 0, [1.0, 1.0])])[-1].outputs[0][0] == "train"


def test_max_resample_times_zero_never_resamples():
    stage = Advantage(Cfg(dynamic_sample=True, max_resample_times=0))
    [(edge, group)] = run(stage, [make_attempt("p", 0, 0, [1.0, 1.0])])[-1].outputs
    assert edge == "train" and group.advantages == [0.0, 0.0]


def test_dropped_feedback_names_the_reason_and_the_attempt():
    stage = Advantage(Cfg(dynamic_sample=True))
    [(_, feedback)] = run(stage, [make_attempt("p", 2, 7, [0.5, 0.5, 0.5])])[-1].outputs
    assert (feedback.outcome, feedback.reason, feedback.generation_batch, feedback.attempt) == ("dropped", "zero_std", 7, 2)
    # A redelivery of the dropped group is acked and emits nothing.
    assert [o.outputs for o in run(stage, [make_attempt("p", 2, 7, [0.5, 0.5, 0.5])])] == [[]]


def test_without_dynamic_sample_zero_std_groups_train():
    [(edge, group)] = run(Advantage(Cfg()), [make_attempt("p", 0, 0, [1.0, 1.0])])[-1].outputs
    assert edge == "train" and group.advantages == [0.0, 0.0]


def test_dynamic_sample_with_batch_scaling_waits_for_the_replacement():
    stage = Advantage(Cfg(dynamic_sample=True, scale_rewards="batch", prompt_batch_size=2))
    assert run(stage, [make_attempt("a", 0, 0, [1.0, 0.0])])[-1].hold
    assert run(stage, [make_attempt("b", 0, 0, [1.0, 1.0])])[-1].outputs[0][0] == "feedback"
    out = run(stage, [make_attempt("b", 1, 0, [3.0, 1.0])])[-1]
    assert [(g.prompt_id, g.attempt) for _, g in out.outputs] == [("a", 0), ("b", 1)]
    std = math.sqrt(4.75 / 3) + 1e-4  # rewards [1, 0, 3, 1]: the dropped attempt is not in the batch
    assert np.allclose(out.outputs[0][1].advantages + out.outputs[1][1].advantages, np.array([0.5, -0.5, 1, -1]) / std)


def test_has_zero_std_counts_requests():
    recs = make_attempt("p", 0, 0, [1.0, 1.0]).records
    assert has_zero_std(recs) and not has_zero_std(make_attempt("p", 0, 0, [1.0, 0.0]).records)


def test_overlong_filter_weights_truncated_completions_zero_but_keeps_their_reward():
    scored = make_attempt("p", 0, 0, [1.0, 0.0, 0.0, 1.0], finish=["stop", "length", "stop", "length"])
    [(_, group)] = run(Advantage(Cfg(overlong_filter=True)), [scored])[-1].outputs
    assert group.loss_weights == [1.0, 0.0, 1.0, 0.0]
    expected = (np.array([1, 0, 0, 1]) - 0.5) / (np.std([1, 0, 0, 1], ddof=1) + 1e-4)  # all four rewards count
    assert np.allclose(group.advantages, expected)
    [(_, plain)] = run(Advantage(Cfg()), [make_attempt("q", 0, 0, [1.0, 0.0], finish=["length", "stop"])])[-1].outputs
    assert plain.loss_weights == []  # off: every record weighs 1.0


def test_loss_weights_survive_the_wire_and_default_to_empty():
    records = make_attempt("p", 0, 0, [1.0, 0.0]).records
    group = TrainGroup(prompt_id="p", attempt=0, generation_batch=0, records=records, advantages=[1.0, -1.0],
                       loss_weights=[1.0, 0.0])
    assert decode(encode(group)).loss_weights == [1.0, 0.0]
    # A TrainGroup from a worker that predates the field still decodes.
    legacy = msgspec.msgpack.encode(
        {"type": "train_group", "prompt_id": "p", "attempt": 0, "generation_batch": 0, "records": [], "advantages": []}
    )
    assert decode(legacy).loss_weights == []


def test_a_failed_reward_drops_the_whole_group_and_asks_for_a_resample():
    group = make_attempt("p", 0, 3, [1.0, 0.0, 1.0])
    records = list(group.records)
    records[1] = msgspec.structs.replace(records[1], failed="timeout after 2 retries")
    out = run(Advantage(Cfg()), [msgspec.structs.replace(group, records=records)], FakeContext(run="reward-failure-test", stage="advantage", worker="w"))
    [(edge, feedback)] = out[-1].outputs
    assert (edge, feedback.outcome, feedback.reason, feedback.attempt) == ("feedback", "dropped", "reward_error", 0)
    assert counter(metrics.GROUPS_DROPPED, "reward-failure-test", "reward_error") == 1


def test_kl_penalized_rewards_sums_the_kl_of_a_request_and_subtracts_beta_times_it():
    # Request r0 has two records (a split multi-turn request): its KL is their sum, on both records.
    out = kl_penalized_rewards([1.0, 1.0, 0.0], [0.5, 1.5, -1.0], ["r0", "r0", "r1"], beta=0.1)
    assert out.tolist() == pytest.approx([1.0 - 0.1 * 2.0, 1.0 - 0.1 * 2.0, 0.0 + 0.1])


def test_a_split_request_with_disagreeing_rewards_is_dropped_not_held_forever():
    group = make_attempt("p", 0, 0, [1.0, 0.0, 0.5])
    records = list(group.records)
    # Records 0 and 1 are two turns of one request (same request_id) but were scored apart.
    same_request = msgspec.structs.replace(records[1].trajectory, request_id=records[0].trajectory.request_id, turn=2)
    records[1] = msgspec.structs.replace(records[1], trajectory=same_request)
    manifest = msgspec.structs.replace(group.manifest, record_ids=[r.record_id for r in records])
    group = ScoredGroup(manifest=manifest, records=records)
    out = run(Advantage(Cfg()), [group], FakeContext(run="inconsistent-test", stage="advantage", worker="w"))
    [(edge, feedback)] = out[-1].outputs
    assert (edge, feedback.reason) == ("feedback", "inconsistent_rewards")
    assert out[-1].release == [] and not out[-1].hold  # its one entry is acked


# ---------------------------------------------------------------- dead letters


def dead(record, edge="trajectories", payload=None):
    return DeadLetter(edge=edge, entry_id="1-0", payload=encode(record) if payload is None else payload,
                      error="TypeError: boom", stage="reward")


def test_a_dead_letter_names_the_group_of_any_entry_of_it_and_nothing_else():
    scored = make_attempt("p", 2, 5, [1.0, 0.0])
    task = PromptTask(prompt_id="p", attempt=2, generation_batch=5, num_generations=2, messages=[])
    train = TrainGroup(prompt_id="p", attempt=2, generation_batch=5, records=scored.records, advantages=[0.0, 0.0])
    whole = TrajectoryGroup(manifest=scored.manifest, trajectories=[r.trajectory for r in scored.records])
    for record in (task, whole, scored, train):  # every entry a group travels in, stage by stage
        feedback, past_advantage = dead_letter_drop(dead(record))
        assert (feedback.prompt_id, feedback.attempt, feedback.generation_batch) == ("p", 2, 5)
        assert (feedback.outcome, feedback.reason) == ("dropped", "dead_letter")
        assert past_advantage == isinstance(record, TrainGroup)
    letter = dead(scored)
    assert dead_letter_drop(dead(letter, edge="dead")) is None  # a dead letter's dead letter: never a loop
    assert dead_letter_drop(dead(letter, edge="trajectories")) is None  # a DeadLetter names no group
    assert dead_letter_drop(dead(None, payload=b"\x00\xffgarbage")) is None
    assert dead_letter_drop(dead(WeightsPublished(version=1, path="-"))) is None


def test_a_dead_letter_drops_its_group_once_and_later_entries_of_it_are_acked():
    stage = Advantage(Cfg())
    scored = make_attempt("p", 0, 3, [1.0, 0.0, 0.5])
    trajectories = TrajectoryGroup(manifest=scored.manifest, trajectories=[r.trajectory for r in scored.records])
    # The group's TrajectoryGroup was dead-lettered by the reward stage: the group will not be trained.
    [out] = run(stage, [dead(trajectories)], FakeContext(run="dead-letter-test", stage="advantage", worker="w"))
    [(edge, feedback)] = out.outputs
    assert (edge, feedback.reason, feedback.generation_batch) == ("feedback", "dead_letter", 3)
    assert out.release == [] and not out.hold
    # A later entry of it (a redelivered copy scored after all), and a second dead letter of it: acked, ignored.
    again = run(stage, [scored, dead(scored), dead(trajectories)], FakeContext(run="dead-letter-test", stage="advantage", worker="w"))
    assert [(h.outputs, h.hold, h.release) for h in again] == [([], False, [])] * 3
    assert counter(metrics.GROUPS_DROPPED, "dead-letter-test", "dead_letter") == 1
    # Its count rides on the next TrainGroup into the learner's metrics.
    [(_, train)] = run(stage, [make_attempt("q", 0, 3, [1.0, 0.0])], FakeContext(run="dead-letter-test", stage="advantage", worker="w"))[-1].outputs
    assert train.drops == {"dead_letter": 1}


def test_a_dead_letter_of_a_group_already_whole_is_ignored_but_its_train_group_is_dropped():
    stage = Advantage(Cfg())
    scored = make_attempt("p", 0, 0, [1.0, 0.0])
    [(_, train)] = run(stage, [scored])[-1].outputs
    # A duplicate of an entry of a trained group went dead: nothing to drop.
    assert run(stage, [dead(scored)])[0].outputs == []
    # The TrainGroup itself went dead at the learner: never trained, so dropped now (once).
    [out, twice] = run(stage, [dead(train, edge="train"), dead(train, edge="train")])
    assert [f.reason for _, f in out.outputs] == ["dead_letter"] and twice.outputs == []


def test_a_dead_letter_before_any_record_still_drops_the_group_and_garbage_is_acked():
    stage = Advantage(Cfg())
    task = PromptTask(prompt_id="p", attempt=1, generation_batch=2, num_generations=2, messages=[])
    [out] = run(stage, [dead(task, edge="prompts")])
    assert [(e, f.prompt_id, f.attempt) for e, f in out.outputs] == [("feedback", "p", 1)] and out.release == []
    assert [h.outputs for h in run(stage, [make_attempt("p", 1, 2, [1.0, 0.0])])] == [[]]
    garbage = [dead(None, payload=b"\x93junk"), dead(Feedback(prompt_id="p", attempt=0, generation_batch=0,
                                                               outcome="trained"))]
    assert [h.outputs for h in run(stage, garbage)] == [[], []]


def test_users_still_import_compute_advantages_from_the_stage():
    import stages.advantage

    assert stages.advantage.compute_advantages is compute_advantages
