"""The learner's training loop on a tiny random Qwen2: seeded shuffle, when old log-probs are computed,
the rollout IS correction, NaN/inf step skipping, entropy logging and accumulation across batches."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from fake_context import FakeContext

import trainer.trainer as trainer_module
from config import load_config
from grpo.batching import needs_old_logps, shuffle_order
from grpo.loss import host_stats
from pipeline.records import FeederPosition, ScoredTrajectory, TrainGroup, Trajectory, pack_f32, pack_i32
from stages.learner import Learner
from trainer.model import Batch
from trainer.trainer import NonFiniteTrainingError, Trainer
from weights.snapshots import unused_snapshots

VOCAB = 64  # conftest's tiny_qwen2


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2):
    return tiny_qwen2


def make_learner(model_dir, tmp_path, *overrides, num_batches=10):
    cfg = load_config("configs/demo.toml", [
        f"model.model={model_dir}", "grpo.beta=0", "grpo.num_generations=4", "grpo.generation_batch_size=8",
        "grpo.per_device_train_batch_size=8", "learner.learning_rate=1e-2", *overrides,
    ])
    trainer = Trainer(cfg, model_dir, tmp_path / "out", num_batches=num_batches)
    trainer.load()
    trainer.run = "t"
    return trainer


def make_groups(seed=0, policy_version=0, logprobs=None, advantages=None, groups=2, size=4):
    """``groups`` TrainGroups of ``size`` records; record k has reward k (so a row's reward tells which
    records its step trained on) and engine log-probs ``logprobs(k, completion)`` (default -1.0 each)."""
    rng = np.random.default_rng(seed)
    out, k = [], 0
    for g in range(groups):
        records = []
        for i in range(size):
            prompt = rng.integers(1, VOCAB, size=int(rng.integers(2, 5)))
            completion = rng.integers(1, VOCAB, size=int(rng.integers(2, 6)))
            lp = logprobs(k, prompt, completion) if logprobs else np.full(len(completion), -1.0)
            t = Trajectory(prompt_id=f"p{g}", attempt=0, request_id=f"p{g}/0/{i}", generation_batch=0,
                           prompt_ids=pack_i32(prompt), completion_ids=pack_i32(completion), logprobs=pack_f32(lp),
                           policy_version=policy_version, max_policy_version=policy_version)
            records.append(ScoredTrajectory(trajectory=t, rewards={"accuracy": float(k)}, reward=float(k)))
            k += 1
        adv = advantages[g * size : (g + 1) * size] if advantages else [1.0, -1.0, 0.5, -0.5][:size]
        out.append(TrainGroup(prompt_id=f"p{g}", attempt=0, generation_batch=0, records=records, advantages=adv))
    return out


def weights(learner):
    return [p.detach().clone() for p in learner.model.parameters()]


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------- shuffle


def test_shuffle_order_is_a_seeded_permutation_that_moves_with_the_version():
    assert sorted(shuffle_order(8, 42, 0)) == list(range(8))
    assert shuffle_order(8, 42, 0) == shuffle_order(8, 42, 0)
    assert shuffle_order(8, 42, 0) != shuffle_order(8, 42, 1)
    assert shuffle_order(8, 42, 1) == shuffle_order(8, 41, 2)  # the seed is run.seed + version


def test_training_order_follows_the_seeded_shuffle(model_dir, tmp_path):
    # 4 mini-batches of 2, one optimizer step each: each row's reward is the mean of its 2 records' k.
    learner = make_learner(model_dir, tmp_path, "grpo.per_device_train_batch_size=2", "grpo.gradient_accumulation_steps=1")
    groups = make_groups()

    def step_rewards(version=0):
        return [row["reward"] for row in learner.train_generation_batch(groups, version)]

    first, again = step_rewards(), step_rewards()
    order = shuffle_order(8, learner.cfg.run.seed, 0)
    assert first == again == [(order[i] + order[i + 1]) / 2 for i in range(0, 8, 2)]
    assert first != [0.5, 2.5, 4.5, 6.5]  # not the arrival order
    assert step_rewards(version=1) != first


# ----------------------------------------------------------------------------- old log-probs


@pytest.mark.parametrize(
    "overrides,stale,expected",
    [
        ([], False, False),  # GA = steps_per_generation = 1: on-policy, ratio exactly 1
        (["grpo.num_iterations=2"], False, True),
        (["grpo.per_device_train_batch_size=2", "grpo.gradient_accumulation_steps=1"], False, True),  # 4 steps/batch
        (["grpo.per_device_train_batch_size=2", "grpo.gradient_accumulation_steps=4"], False, False),  # 1 step, aligned
        (["grpo.per_device_train_batch_size=2", "grpo.gradient_accumulation_steps=8"], False, False),  # 2 batches/step
        # ms-swift's rule (GA % spg != 0); the old rule (spg > GA) missed this: a step lands mid-batch
        (["grpo.per_device_train_batch_size=4", "grpo.gradient_accumulation_steps=3"], False, True),
        ([], True, True),  # trajectories from an older policy version
        (["grpo.rollout_importance_sampling_mode=token_mask"], False, True),  # IS weights compare old and rollout
    ],
)
def test_needs_old_logps(overrides, stale, expected):
    cfg = load_config("configs/demo.toml", ["grpo.num_generations=4", "grpo.generation_batch_size=8",
                                            "grpo.per_device_train_batch_size=8", *overrides])
    records = [r for g in make_groups(policy_version=0) for r in g.records]
    assert needs_old_logps(cfg.grpo, records, version=1 if stale else 0) is expected


# 2 mini-batches; beta = 0, so no reference passes. With one iteration the first mini-batch's training
# forward runs on the batch's starting weights and gives its old log-probs: only the second needs a pass.
@pytest.mark.parametrize("overrides,version,passes", [([], 0, 0), (["grpo.num_iterations=2"], 0, 2), ([], 1, 1)])
def test_old_logps_are_computed_once_per_mini_batch_only_when_needed(model_dir, tmp_path, monkeypatch, overrides, version, passes):
    learner = make_learner(model_dir, tmp_path, "grpo.per_device_train_batch_size=4",
                           "grpo.gradient_accumulation_steps=2", *overrides)
    calls = []
    real = trainer_module.completion_logps
    monkeypatch.setattr(trainer_module, "completion_logps", lambda *a, **k: calls.append(1) or real(*a, **k))
    learner.train_generation_batch(make_groups(policy_version=0), version)
    assert len(calls) == passes


@pytest.mark.parametrize("overrides", [[], ["learner.max_tokens_per_batch=12"]])
def test_the_training_forward_gives_the_old_pass_log_probs_bit_for_bit(model_dir, tmp_path, monkeypatch, overrides):
    """Why the first mini-batch needs no old pass: on the same weights, the no-grad pass and the training
    forward give the same log-probs exactly (padded and padding-free), so its ratio is 1 as with the pass."""
    learner = make_learner(model_dir, tmp_path, "grpo.per_device_train_batch_size=4", *overrides)
    [group] = make_groups(groups=1)
    mb = Batch(group.records, group.advantages, learner.pad_id)
    with torch.no_grad():
        old = learner.logps(learner.model, mb)
    captured = []
    real = trainer_module.policy_loss
    monkeypatch.setattr(trainer_module, "policy_loss",
                        lambda logps, *a, **k: captured.append(logps.detach()) or real(logps, *a, **k))
    learner.minibatch_backward(mb, None, None, beta=0.0, num_items_in_batch=1.0)
    train = torch.zeros_like(old)
    rows = [list(range(len(mb)))] if not overrides else trainer_module.token_budget_micro_batches(
        [len(seq) for seq in mb.sequences], 12)
    for part, logps in zip(rows, captured, strict=True):
        train[part] = logps
    assert torch.equal(train, old)


def test_reference_passes_run_in_their_own_thread_without_gradients(model_dir, tmp_path, monkeypatch):
    learner = make_learner(model_dir, tmp_path, "grpo.beta=0.04", "grpo.per_device_train_batch_size=4")
    seen = []
    real = learner.ref_logps

    def spy(mb):
        out = real(mb)
        seen.append((threading.current_thread().name, out.requires_grad))
        return out

    monkeypatch.setattr(learner, "ref_logps", spy)
    rows = learner.train_generation_batch(make_groups(), 0)
    assert seen == [("ref-pass_0", False)] * 2  # 2 mini-batches
    assert all(math.isfinite(row["kl"]) for row in rows)


# ----------------------------------------------------------------------------- rollout IS correction


def own_logprobs(learner):
    """Engine log-probs equal to the learner's own: then every IS weight is 1."""

    def logprobs(k, prompt, completion):
        t = Trajectory(prompt_id="x", attempt=0, request_id="x", generation_batch=0, prompt_ids=pack_i32(prompt),
                       completion_ids=pack_i32(completion), logprobs=b"", policy_version=0, max_policy_version=0)
        with torch.no_grad():
            return trainer_module.completion_logps(
                learner.model, Batch([ScoredTrajectory(trajectory=t, rewards={}, reward=0.0)], [0.0], 0), 1.0
            )[0].numpy()

    return logprobs


def test_batch_pads_the_engine_logprobs_like_the_completions():
    groups = make_groups(logprobs=lambda k, p, c: -np.arange(1, len(c) + 1, dtype=np.float32))
    records = [r for g in groups for r in g.records]
    b = Batch(records, [0.0] * len(records), pad_id=0)
    for i, r in enumerate(records):
        n = len(r.trajectory.completion_token_ids())
        assert b.rollout_logps[i, :n].tolist() == [-float(j) for j in range(1, n + 1)]
        assert b.rollout_logps[i, n:].abs().sum() == 0


def test_rollout_is_correction_weights_the_loss(model_dir, tmp_path):
    mode = "grpo.rollout_importance_sampling_mode=token_truncate"
    plain = make_learner(model_dir, tmp_path / "a")
    (plain_row,) = plain.train_generation_batch(make_groups(advantages=[1.0, -1.0, 0.5, -0.5, -1.0, -1.0, 2.0, 0.5]), 0)
    assert "rollout_correction/is_weight_mean" not in plain_row

    # Engine log-probs of -1 against a random model's ~-log(64): r = exp(old - rollout) ~ exp(-3.2) < 1
    corrected = make_learner(model_dir, tmp_path / "b", mode)
    (row,) = corrected.train_generation_batch(make_groups(advantages=[1.0, -1.0, 0.5, -0.5, -1.0, -1.0, 2.0, 0.5]), 0)
    assert 0.0 < row["rollout_correction/is_weight_mean"] < 0.2
    assert row["loss"] != pytest.approx(plain_row["loss"], rel=1e-3)

    # The engine agreeing with the learner: weights 1, the loss of no correction.
    agreeing = make_learner(model_dir, tmp_path / "c", mode)
    groups = make_groups(logprobs=own_logprobs(agreeing), advantages=[1.0, -1.0, 0.5, -0.5, -1.0, -1.0, 2.0, 0.5])
    (row,) = agreeing.train_generation_batch(groups, 0)
    assert row["rollout_correction/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert row["loss"] == pytest.approx(plain_row["loss"], abs=1e-5)

    # A threshold below every ratio truncates them all to it.
    low = make_learner(model_dir, tmp_path / "d", mode, "grpo.rollout_importance_sampling_threshold=0.001")
    (row,) = low.train_generation_batch(make_groups(advantages=[1.0, -1.0, 0.5, -0.5, -1.0, -1.0, 2.0, 0.5]), 0)
    assert row["rollout_correction/is_weight_mean"] == pytest.approx(0.001, rel=1e-4)
    assert row["rollout_correction/is_weight_min"] == pytest.approx(0.001, rel=1e-4) == row["rollout_correction/is_weight_max"]


# ----------------------------------------------------------------------------- NaN/inf steps


def test_a_nan_step_is_skipped_and_counted(model_dir, tmp_path):
    learner = make_learner(model_dir, tmp_path)
    before = weights(learner)
    bad = [1.0, -1.0, float("nan"), -0.5, 1.0, -1.0, 0.5, -0.5]
    (row,) = learner.train_generation_batch(make_groups(advantages=bad), 0)
    assert row["nan_skipped"] == 1 and learner.nan_skipped == 1 and math.isnan(row["loss"])
    assert learner.step == 0 and same_weights(before, weights(learner))
    assert all(p.grad is None for p in learner.model.parameters()) and not learner.optimizer.state
    (row,) = learner.train_generation_batch(make_groups(), 0)
    assert row["nan_skipped"] == 0 and learner.nan_skipped == 1 and learner.step == 1
    assert not same_weights(before, weights(learner))


def test_three_nan_steps_in_a_row_stop_the_learner(model_dir, tmp_path):
    learner = make_learner(model_dir, tmp_path)
    bad = make_groups(advantages=[float("inf")] * 8)
    learner.train_generation_batch(bad, 0)
    learner.train_generation_batch(bad, 0)
    learner.train_generation_batch(make_groups(), 0)  # a good step resets the run of bad ones
    learner.train_generation_batch(bad, 0)
    learner.train_generation_batch(bad, 0)
    assert learner.nan_skipped == 4 and learner.step == 1
    with pytest.raises(RuntimeError, match=r"3 optimizer steps in a row, the last at step 2"):
        learner.train_generation_batch(bad, 0)


# ----------------------------------------------------------------------------- entropy, accumulation


def test_log_entropy_is_the_token_mean_policy_entropy(model_dir, tmp_path):
    learner = make_learner(model_dir, tmp_path, "grpo.log_entropy=true")
    groups = make_groups()
    records = [r for g in groups for r in g.records]
    batch = Batch(records, [0.0] * len(records), learner.pad_id)
    with torch.no_grad():
        logits = learner.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               position_ids=batch.position_ids).logits[:, -batch.width_c - 1 : -1].float()
        p = torch.softmax(logits, -1)
        entropy = -(p * torch.log(p)).sum(-1)
    expected = float((entropy * batch.completion_mask).sum() / batch.completion_mask.sum())
    (row,) = learner.train_generation_batch(groups, 0)
    assert row["entropy/mean"] == pytest.approx(expected, rel=1e-5)
    assert 0 < expected < math.log(VOCAB)
    assert "entropy/mean" not in make_learner(model_dir, tmp_path / "off").train_generation_batch(groups, 0)[0]


def test_gradient_accumulation_carries_over_generation_batches(model_dir, tmp_path):
    # GA = 2 mini-batches, 1 mini-batch per generation batch: one optimizer step every second batch.
    learner = make_learner(model_dir, tmp_path, "grpo.gradient_accumulation_steps=2")
    before = weights(learner)
    assert learner.train_generation_batch(make_groups(seed=1), 0) == [] and learner.step == 0
    assert same_weights(before, weights(learner))
    (row,) = learner.train_generation_batch(make_groups(seed=2), 0)
    assert learner.step == 1 and row["reward"] == pytest.approx(3.5)  # the mean over both batches' records
    assert not same_weights(before, weights(learner))


def test_each_step_sets_the_prometheus_training_gauges(model_dir, tmp_path):
    from pipeline import metrics

    learner = make_learner(model_dir, tmp_path)
    (row,) = learner.train_generation_batch(make_groups(), 0)
    for name in ("reward", "loss", "learning_rate", "completions/mean_length", "staleness/mean", "step"):
        gauge = metrics.TRAIN_GAUGES[metrics.train_gauge_name(name)]
        assert gauge.labels(learner.run)._value.get() == pytest.approx(row[name])


# ----------------------------------------------------------------------------- kl_in_reward


def test_kl_in_reward_defaults_follow_the_estimator_as_ms_swift():
    base = ["grpo.beta=0.04"]
    assert load_config("configs/demo.toml", base).grpo.kl_in_reward is False
    for estimator in ("rloo", "reinforce_plus_plus"):
        assert load_config("configs/demo.toml", [*base, f"grpo.advantage_estimator={estimator}"]).grpo.kl_in_reward
    assert not load_config("configs/demo.toml", [*base, "grpo.advantage_estimator=rloo", "grpo.kl_in_reward=false"]).grpo.kl_in_reward


def test_kl_in_reward_with_policy_equal_to_ref_is_plain_grpo_on_recomputed_advantages(model_dir, tmp_path):
    from grpo.advantages import compute_advantages

    # The stage's advantages are deliberately wrong: with kl_in_reward the learner recomputes them from the
    # rewards (0..7 here) minus beta * KL, and KL = 0 while the policy is still the reference.
    groups = make_groups(advantages=[9.0] * 8)
    kl_learner = make_learner(model_dir, tmp_path / "kl", "grpo.beta=0.04", "grpo.kl_in_reward=true")
    (row,) = kl_learner.train_generation_batch(groups, 0)
    rewards = [r.reward for g in groups for r in g.records]
    expected = compute_advantages(rewards, [r.group_id for g in groups for r in g.records],
                                  [r.trajectory.request_id for g in groups for r in g.records])
    plain = make_learner(model_dir, tmp_path / "plain")  # beta = 0: no KL anywhere
    (plain_row,) = plain.train_generation_batch(make_groups(advantages=expected.tolist()), 0)
    assert row["kl"] == pytest.approx(0.0, abs=1e-6)
    assert row["loss"] == pytest.approx(plain_row["loss"], abs=1e-6)


def test_kl_in_reward_moves_the_kl_from_the_loss_into_the_advantages(model_dir, tmp_path, monkeypatch):
    from grpo.advantages import compute_advantages, kl_penalized_rewards

    learner = make_learner(model_dir, tmp_path, "grpo.beta=0.5", "grpo.kl_in_reward=true")
    with torch.no_grad():  # a reference that differs from the policy
        for p in learner.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    seen = []
    real_policy_loss = trainer_module.policy_loss

    def spy(logps, old, ref, advantages, mask, **kw):
        seen.append((old, ref, advantages.clone(), kw["beta"]))
        return real_policy_loss(logps, old, ref, advantages, mask, **kw)

    monkeypatch.setattr(trainer_module, "policy_loss", spy)
    groups = make_groups()
    (row,) = learner.train_generation_batch(groups, 0)
    [(old, ref, advantages, beta)] = seen
    assert ref is None and beta == 0.0  # no KL term in the loss
    assert row["kl"] != 0.0
    # Recompute from the same old log-probs and the reference, in the learner's shuffled order.
    records = [r for g in groups for r in g.records]
    order = shuffle_order(len(records), learner.cfg.run.seed, learner.version)
    records = [records[i] for i in order]
    batch = Batch(records, [0.0] * len(records), learner.pad_id)
    ref_logps = trainer_module.completion_logps(learner.ref_model, batch, learner.cfg.grpo.temperature)
    kl = ((old - ref_logps) * batch.completion_mask).sum(-1).tolist()
    request_ids = [r.trajectory.request_id for r in records]
    rewards = kl_penalized_rewards([r.reward for r in records], kl, request_ids, 0.5)
    expected = compute_advantages(rewards, [r.group_id for r in records], request_ids)
    assert advantages.tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert row["kl"] == pytest.approx(float(np.mean(kl)), abs=1e-5)


# ----------------------------------------------------------------------------- checkpoints and resume


def batch_groups(b, advantages=(1.0, -1.0, 0.5, -0.5, -1.0, 1.5, 0.25, -0.75)):
    """Generation batch ``b``: 2 groups with ids of their own, sampled at version b (staleness 0)."""
    return [msgspec.structs.replace(g, prompt_id=f"b{b}/{g.prompt_id}", generation_batch=b)
            for g in make_groups(seed=b, policy_version=b, advantages=list(advantages))]


RESUME_OVERRIDES = (
    # 4 mini-batches of 2 per batch, a step every 2: 2 steps per batch, old log-probs needed; a moving
    # reference (synced at steps 3 and 6) and a decaying lr: Adam's moments, the scheduler and the ref all
    # have to be restored.
    "grpo.per_device_train_batch_size=2", "grpo.gradient_accumulation_steps=2", "grpo.beta=0.04",
    "learner.lr_scheduler_type=linear", "learner.warmup_ratio=0.25", "learner.weight_decay=0.1",
    "learner.save_steps=3", "learner.sync_ref_model=true", "learner.ref_model_sync_steps=3",
)


def new_learner(model_dir, out, *overrides, resume_from=None, num_batches=4):
    cfg = load_config("configs/demo.toml", [
        f"model.model={model_dir}", "grpo.num_generations=4", "grpo.generation_batch_size=8",
        "grpo.per_device_train_batch_size=8", "learner.learning_rate=1e-2", *overrides,
    ])
    learner = Learner(cfg, model_dir, out, num_batches=num_batches)
    learner.resume_from = resume_from
    return learner


async def train_batches(learner, batches, advantages=None, ctx=None):
    """Feed generation batches to ``handle``; returns the context and the weights records published."""
    ctx = ctx or FakeContext(stage="learner", worker="w")
    if learner.trainer.model is None:
        await learner.start(ctx)
    ctx.published = []
    for b in batches:
        for group in batch_groups(b) if advantages is None else batch_groups(b, advantages):
            handled = await learner.handle(group, ctx)
            ctx.published += [record for edge, record in handled.outputs if edge == "weights"]
    return ctx


def jsonl_steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


async def test_resume_from_a_checkpoint_continues_exactly(model_dir, tmp_path):
    from trainer import checkpoint as checkpoints

    out = tmp_path / "run"
    straight = new_learner(model_dir, out, *RESUME_OVERRIDES)
    straight.feeder_position = lambda b: FeederPosition(batch=b, slot=0, cursor=100 + b)
    ctx = await train_batches(straight, range(4))
    await straight.close()
    assert straight.trainer.step == 8 and straight.version == 4 and ctx.stops[-1][1] is True
    expected = weights(straight.trainer)
    # save_steps = 3: the first boundary after step 3 is the end of batch 1 (step 4); then step 6; then the end
    assert [p.name for p in checkpoints.listed(out)] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    ckpt = checkpoints.load(out / "checkpoint-4")
    assert ckpt.state["policy_version"] == 2 and ckpt.state["batches_trained"] == 2
    assert ckpt.feeder_position == FeederPosition(batch=2, slot=0, cursor=102)

    resumed = new_learner(model_dir, out, *RESUME_OVERRIDES, resume_from=ckpt)
    await resumed.start(FakeContext(stage="learner", worker="w"))
    assert (resumed.trainer.step, resumed.version, resumed.batches_trained) == (4, 2, 2)
    assert jsonl_steps(out / "metrics.jsonl") == [1, 2, 3, 4]  # rows written after the checkpoint are cut
    await train_batches(resumed, range(2, 4))
    await resumed.close()
    assert resumed.trainer.step == 8 and resumed.version == 4
    for a, b in zip(expected, weights(resumed.trainer)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert jsonl_steps(out / "metrics.jsonl") == list(range(1, 9))

    # Without the optimizer state the same resume ends elsewhere: the test can tell.
    (ckpt.path / "optimizer.pt").unlink()
    bare = new_learner(model_dir, tmp_path / "bare", *RESUME_OVERRIDES)
    await bare.start(FakeContext(stage="learner", worker="w"))
    from safetensors.torch import load_model

    load_model(bare.trainer.model, str(ckpt.path / "model.safetensors"))
    bare.version, bare.trainer.step, bare.batches_trained = 2, 4, 2
    bare.trainer.scheduler.load_state_dict(torch.load(ckpt.path / "scheduler.pt", weights_only=True))
    await train_batches(bare, range(2, 4))
    assert max(float((a - b).abs().max()) for a, b in zip(expected, weights(bare.trainer))) > 1e-4


async def test_resume_announces_the_restored_weights(model_dir, tmp_path):
    from trainer import checkpoint as checkpoints

    out = tmp_path / "run"
    first = new_learner(model_dir, out, *RESUME_OVERRIDES)
    await train_batches(first, range(2))
    resumed = new_learner(model_dir, out, *RESUME_OVERRIDES, resume_from=checkpoints.latest(out))
    await resumed.start(FakeContext(stage="learner", worker="w"))
    [[(edge, record)]] = [item async for item in resumed.source(FakeContext(stage="learner", worker="w"))]
    assert edge == "weights" and record.version == 2 and record.step == 4
    from safetensors.torch import load_file

    snapshot = load_file(str(Path(record.path) / "model.safetensors"))
    assert all(torch.equal(snapshot[k], v) for k, v in resumed.trainer.model.state_dict().items())
    assert [item async for item in first.source(FakeContext(stage="learner", worker="w"))] == []  # no resume, no announcement


def test_truncated_or_partial_checkpoints_are_skipped(model_dir, tmp_path):
    from trainer import checkpoint as checkpoints

    learner = make_learner(model_dir, tmp_path, "learner.save_total_limit=3")
    for step in (1, 2, 3, 4):
        learner.step = step
        learner.save_checkpoint()
    out = learner.output_dir
    assert [p.name for p in checkpoints.listed(out)] == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    optimizer = out / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:10])  # truncated after the rename
    (out / "checkpoint-3" / "trainer_state.json").unlink()  # never finished
    (out / ".checkpoint-5-abc").mkdir()  # a temp dir left by a crash mid-write
    assert "optimizer.pt" in checkpoints.problem(out / "checkpoint-4")
    assert checkpoints.latest(out).path.name == "checkpoint-2"
    assert checkpoints.resolve("latest", out, "t").step == 2
    with pytest.raises(checkpoints.CheckpointError, match="truncated"):
        checkpoints.resolve(str(out / "checkpoint-4"), None, "t")
    with pytest.raises(checkpoints.CheckpointError, match="no complete checkpoint"):
        checkpoints.resolve("latest", tmp_path / "nothing", "t")


def test_rng_states_round_trip():
    import random

    from trainer import checkpoint as checkpoints

    states = checkpoints.rng_states()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoints.set_rng_states(states)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


NAN = [float("nan")] * 8


async def test_a_batch_whose_steps_were_all_skipped_writes_no_new_snapshot(model_dir, tmp_path):
    learner = new_learner(model_dir, tmp_path / "out", "grpo.beta=0", num_batches=10)
    leased = {"weights": {"rollout": 0}}  # a rollout worker still uses the base: no snapshot is deleted
    good = await train_batches(learner, [0], ctx=FakeContext(stage="learner", worker="w", leased=leased))
    bad = await train_batches(learner, [1], advantages=NAN, ctx=FakeContext(stage="learner", worker="w", leased=leased))
    again = await train_batches(learner, [2], ctx=FakeContext(stage="learner", worker="w", leased=leased))
    [v1], [v2], [v3] = good.published, bad.published, again.published
    assert (v1.version, v2.version, v3.version) == (1, 2, 3)  # versions still count generation batches
    assert v2.path == v1.path and v3.path != v1.path  # the skipped batch announces the unchanged weights
    assert sorted(p.name for p in (tmp_path / "out" / "weights").iterdir()) == ["v000001", "v000003"]
    assert learner.trainer.nan_skipped == 1 and learner.trainer.step == 2


async def test_three_non_finite_steps_in_a_row_stop_the_run_with_a_checkpoint(model_dir, tmp_path):
    from trainer import checkpoint as checkpoints

    out = tmp_path / "out"
    learner = new_learner(model_dir, out, "grpo.beta=0", num_batches=10)
    learner.feeder_position = lambda b: FeederPosition(batch=b, cursor=8 * b)
    await train_batches(learner, [0])
    good = weights(learner.trainer)
    await train_batches(learner, [1, 2], advantages=NAN)
    with pytest.raises(NonFiniteTrainingError, match=r"3 optimizer steps in a row.*Checkpoint of the last good step: .*checkpoint-1"):
        await train_batches(learner, [3], advantages=NAN)
    saved = checkpoints.load(out / "checkpoint-1")
    assert saved.state["nan_skipped"] == 3 and saved.state["nan_in_a_row"] == 3
    assert saved.feeder_position == FeederPosition(batch=3, cursor=24)  # batch 3 was not trained
    from safetensors.torch import load_file

    state = load_file(str(saved.path / "model.safetensors"))
    names = [n for n, _ in learner.trainer.model.named_parameters()]
    assert all(torch.equal(state[n], w) for n, w in zip(names, good))


def test_sync_ref_model_every_ref_model_sync_steps(model_dir, tmp_path):
    learner = make_learner(model_dir, tmp_path, "grpo.beta=0.04", "learner.sync_ref_model=true",
                           "learner.ref_model_sync_steps=2", "learner.ref_model_mixup_alpha=0.25")
    initial = [p.detach().clone() for p in learner.ref_model.parameters()]
    learner.train_generation_batch(make_groups(seed=1), 0)
    assert learner.step == 1 and same_weights(initial, [p.detach() for p in learner.ref_model.parameters()])
    learner.train_generation_batch(make_groups(seed=2), 0)
    assert learner.step == 2
    expected = [0.25 * p + 0.75 * r for p, r in zip(weights(learner), initial)]
    for got, want in zip(learner.ref_model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-7)
    assert not same_weights(initial, [p.detach() for p in learner.ref_model.parameters()])


def test_sync_ref_model_needs_a_reference():
    from config import ConfigError

    with pytest.raises(ConfigError, match=r"learner.sync_ref_model=true with grpo.beta=0"):
        load_config("configs/demo.toml", ["grpo.beta=0", "learner.sync_ref_model=true"])


def test_top_entropy_quantile_trains_only_the_high_entropy_tokens(model_dir, tmp_path, monkeypatch):
    from grpo.loss import high_entropy_mask

    seen = []
    real = trainer_module.policy_loss
    monkeypatch.setattr(trainer_module, "policy_loss",
                        lambda *a, **kw: seen.append((a[4], kw["entropy_mask"])) or real(*a, **kw))
    learner = make_learner(model_dir, tmp_path, "grpo.top_entropy_quantile=0.2")
    groups = make_groups()
    records = [r for g in groups for r in g.records]
    order = shuffle_order(len(records), learner.cfg.run.seed, 0)
    batch = Batch([records[i] for i in order], [0.0] * len(records), learner.pad_id)
    with torch.no_grad():
        _, entropy = trainer_module.completion_logps_and_entropy(learner.model, batch, 1.0)
    (row,) = learner.train_generation_batch(groups, 0)
    [(mask, entropy_mask)] = seen
    assert torch.equal(entropy_mask, high_entropy_mask(entropy, batch.completion_mask, 0.2))
    kept, tokens = float(entropy_mask.sum()), float(mask.sum())
    assert 0 < kept <= math.ceil(0.2 * tokens) + 1 and kept < tokens
    assert "entropy/mean" not in row  # entropy for the mask only; log_entropy is off
    seen.clear()
    make_learner(model_dir, tmp_path / "all").train_generation_batch(groups, 0)
    assert seen[0][1] is None  # 1.0 = every token, no mask


def test_dapo_divides_by_the_completion_tokens_of_the_whole_generation_batch(model_dir, tmp_path):
    # 2 mini-batches of 4, one optimizer step: on-policy (ratio 1) and beta = 0, so a token's loss is -A_i
    # and a mini-batch's loss is -sum_i A_i n_i / N with N the tokens of all 8 completions, not of its 4.
    advantages = [1.0, -1.0, 0.5, -0.5, -1.0, 1.5, 0.25, -0.75]
    learner = make_learner(model_dir, tmp_path, "grpo.loss_type=dapo", "grpo.per_device_train_batch_size=4",
                           "grpo.gradient_accumulation_steps=2")
    groups = make_groups(advantages=advantages)
    (row,) = learner.train_generation_batch(groups, 0)
    lengths = [len(r.trajectory.completion_token_ids()) for g in groups for r in g.records]
    order = shuffle_order(8, learner.cfg.run.seed, 0)
    total = sum(lengths)
    per_minibatch = [-sum(advantages[i] * lengths[i] for i in order[k : k + 4]) / total for k in (0, 4)]
    assert row["loss"] == pytest.approx(sum(per_minibatch) / 2, abs=1e-6)
    # the mini-batch's own token count would give another number: the test can tell
    own = [-sum(advantages[i] * lengths[i] for i in order[k : k + 4]) / sum(lengths[i] for i in order[k : k + 4])
           for k in (0, 4)]
    assert sum(own) / 2 != pytest.approx(row["loss"], abs=1e-3)


# ----------------------------------------------------------------------------- padding-free, checkpointing


def test_token_budget_micro_batches_fill_in_order_within_the_budget():
    from grpo.batching import token_budget_micro_batches

    assert token_budget_micro_batches([4, 4, 3, 9, 20, 1], 8) == [[0, 1], [2], [3], [4], [5]]
    assert token_budget_micro_batches([4, 4, 3], 100) == [[0, 1, 2]]
    assert token_budget_micro_batches([], 8) == []


def grads(learner):
    return [p.grad.detach().clone() for p in learner.model.parameters()]


@pytest.mark.parametrize("overrides", [
    ["grpo.loss_type=grpo"],
    ["grpo.loss_type=bnpo", "grpo.beta=0.04"],
    ["grpo.loss_type=dr_grpo", "grpo.importance_sampling_level=sequence"],
    ["grpo.loss_type=dapo", "grpo.rollout_importance_sampling_mode=token_truncate", "grpo.num_iterations=2"],
])
def test_padding_free_micro_batches_give_the_padded_loss_and_gradients(model_dir, tmp_path, overrides):
    groups = make_groups(advantages=[1.0, -1.0, 0.5, -0.5, -1.0, 1.5, 0.25, -0.75])
    records = [r for g in groups for r in g.records]
    lengths = [len(r.trajectory.prompt_token_ids()) + len(r.trajectory.completion_token_ids()) for r in records]
    padded = make_learner(model_dir, tmp_path / "padded", *overrides)
    packed = make_learner(model_dir, tmp_path / "packed", *overrides, "learner.max_tokens_per_batch=12")
    assert max(lengths) > min(lengths) and sum(lengths) > 3 * 12  # real padding, several micro-batches

    batch = Batch(records, [1.0, -1.0, 0.5, -0.5, -1.0, 1.5, 0.25, -0.75], padded.pad_id)
    with torch.no_grad():  # the padding-free old-logps pass agrees with the padded one (padding is masked)
        m = batch.completion_mask
        torch.testing.assert_close(packed.logps(packed.model, batch) * m, padded.logps(padded.model, batch) * m,
                                   rtol=0, atol=1e-5)
        old = padded.logps(padded.model, batch) - 0.05 * torch.arange(batch.width_c)  # ratios away from 1
        ref = padded.logps(padded.model, batch) + 0.1 if padded.ref_model is not None else None
    beta = padded.cfg.grpo.beta
    a, b = host_stats([padded.minibatch_backward(batch, old, ref, beta=beta, num_items_in_batch=40.0),
                       packed.minibatch_backward(batch, old, ref, beta=beta, num_items_in_batch=40.0)])
    assert a.keys() == b.keys()
    for key in a:
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert a["loss"] != 0.0
    for x, y in zip(grads(padded), grads(packed)):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5)

    # The whole training step too: same metrics row, same weights after it.
    padded.optimizer.zero_grad()
    packed.optimizer.zero_grad()
    rows_a, rows_b = padded.train_generation_batch(groups, 0), packed.train_generation_batch(groups, 0)
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for key in ("loss", "kl", "clip_ratio/region_mean", "grad_norm"):
            assert rb[key] == pytest.approx(ra[key], abs=1e-5), key
    # Adam's first step is about lr * g / |g|: for a near-zero gradient, float rounding (1e-5 apart above)
    # moves the update by a visible fraction of lr = 1e-2, so weights are compared to a tenth of one step.
    for x, y in zip(weights(padded), weights(packed)):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-3)


def test_gradient_checkpointing_changes_memory_not_numbers(model_dir, tmp_path):
    plain = make_learner(model_dir, tmp_path / "plain", "grpo.beta=0.04")
    checkpointed = make_learner(model_dir, tmp_path / "gc", "grpo.beta=0.04", "learner.gradient_checkpointing=true")
    assert checkpointed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    (a,), (b,) = plain.train_generation_batch(make_groups(), 0), checkpointed.train_generation_batch(make_groups(), 0)
    assert b["loss"] == pytest.approx(a["loss"], abs=1e-6) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for x, y in zip(weights(plain), weights(checkpointed)):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- LoRA


async def test_lora_trains_the_adapter_against_the_base_and_publishes_it_alone(model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    lora = ["grpo.beta=0.04", "learner.train_type=lora", "learner.lora_rank=4", "learner.lora_alpha=8",
            "learner.lora_dropout=0", "learner.target_modules=[\"q_proj\", \"v_proj\"]", "learner.save_steps=1"]
    learner = new_learner(model_dir, out, *lora)
    await learner.start(FakeContext(stage="learner", worker="w"))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    trainable = {n for n, p in learner.trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "v_proj"}  # ...q_proj.lora_A.default.weight
    frozen = {n: p.detach().clone() for n, p in learner.trainer.model.named_parameters() if not p.requires_grad}
    assert learner.trainer.ref_model is None  # the reference is the base itself

    ctx = await train_batches(learner, [0, 1])
    assert learner.trainer.step == 2
    assert all(torch.equal(p, frozen[n]) for n, p in learner.trainer.model.named_parameters() if not p.requires_grad)
    groups = batch_groups(2)
    records = [r for g in groups for r in g.records]
    batch = Batch(records, [0.0] * len(records), learner.trainer.pad_id)
    with torch.no_grad():  # adapter disabled = the base model: the KL is measured against the initial policy
        torch.testing.assert_close(learner.trainer.ref_logps(batch), trainer_module.completion_logps(base, batch, 1.0),
                                   rtol=0, atol=1e-6)
        policy = trainer_module.completion_logps(learner.trainer.model, batch, 1.0)
    assert float(((policy - learner.trainer.ref_logps(batch)).abs() * batch.completion_mask).max()) > 1e-4

    # The snapshot holds the adapter alone; peft loads it onto a fresh base and gets the learner's policy.
    snapshot = Path(ctx.published[-1].path)
    files = {p.name for p in snapshot.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model_dir)), str(snapshot)).eval()
    with torch.no_grad():
        torch.testing.assert_close(trainer_module.completion_logps(loaded, batch, 1.0), policy, rtol=0, atol=1e-6)
    await learner.close()

    # A LoRA checkpoint restores into a fresh LoRA learner: the same adapter, the same Adam state.
    from trainer import checkpoint as checkpoints

    restored = new_learner(model_dir, out, *lora, resume_from=checkpoints.latest(out))
    await restored.start(FakeContext(stage="learner", worker="w"))
    assert restored.trainer.step == 2 and restored.trainer.optimizer.state_dict()["state"].keys() == learner.trainer.optimizer.state_dict()["state"].keys()
    for (name, a), (_, b) in zip(learner.trainer.model.named_parameters(), restored.trainer.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    await restored.close()


def test_lora_rejects_a_separate_reference():
    from config import ConfigError

    with pytest.raises(ConfigError, match=r"learner.train_type=\"lora\" uses the base model"):
        load_config("configs/demo.toml", ["learner.train_type=lora", "learner.sync_ref_model=true"])


def test_every_scored_reward_gets_its_mean_and_std_row_a_reward_model_included(model_dir, tmp_path):
    import msgspec

    groups = [
        msgspec.structs.replace(g, records=[
            msgspec.structs.replace(r, rewards={**r.rewards, "reward_model": 2.0 * r.reward}) for r in g.records
        ])
        for g in make_groups()
    ]
    (row,) = make_learner(model_dir, tmp_path).train_generation_batch(groups, 0)
    assert row["rewards/reward_model/mean"] == pytest.approx(7.0)  # 2 * mean(0..7)
    assert row["rewards/accuracy/mean"] == pytest.approx(3.5)


# ----------------------------------------------------------------------------- snapshot garbage collection


def test_unused_snapshots_are_those_below_the_oldest_lease():
    assert unused_snapshots([1, 2, 3, 4], [3, 2]) == [1]
    assert unused_snapshots([1, 2, 3, 4], [0]) == []
    assert unused_snapshots([1, 2, 3, 4], []) == [1, 2, 3]  # no worker: only the newest stays
    assert unused_snapshots([1, 2, 3, 4], [9]) == [1, 2, 3]  # never the newest
    assert unused_snapshots([1, 2, 3, 4], [], keep="v000002") == [1, 3]
    assert unused_snapshots([], [1]) == []


async def test_the_learner_deletes_snapshots_no_worker_leases(model_dir, tmp_path):
    out = tmp_path / "out"
    learner = new_learner(model_dir, out, num_batches=6)
    ctx = FakeContext(stage="learner", worker="w", leased={"weights": {"rollout-a": 0}})

    def kept():
        return sorted(int(d.name[1:]) for d in (out / "weights").glob("v*"))

    await train_batches(learner, [0, 1, 2], ctx=ctx)
    assert kept() == [1, 2, 3]  # a worker still samples with the base: nothing is deleted
    ctx.leased = {"weights": {"rollout-a": 2, "rollout-b": 3}}
    await train_batches(learner, [3], ctx=ctx)
    assert kept() == [2, 3, 4]
    ctx.leased = {}  # both workers died and their leases expired
    await train_batches(learner, [4], ctx=ctx)
    assert kept() == [5]
    await train_batches(learner, [5], ctx=ctx)
    assert kept() == [6] and (out / "final" / "model.safetensors").exists()
    await learner.close()
# ----------------------------------------------------------------------------- acks at checkpoints


async def test_a_drain_checkpoints_what_was_trained_and_releases_the_groups_it_held(model_dir, tmp_path):
    """SIGTERM: the worker calls drain once in-flight work is done; trained groups no checkpoint covered
    are covered now and acked, where a kill would leave them to be trained again."""
    from trainer import checkpoint as checkpoints

    out = tmp_path / "run"
    learner = new_learner(model_dir, out, *RESUME_OVERRIDES, "learner.save_steps=1000")
    ctx = FakeContext(stage="learner", worker="w")
    await learner.start(ctx)
    assert (await learner.drain(ctx)).release == [] and checkpoints.listed(out) == []  # nothing trained yet
    handled = [await learner.handle(group, ctx) for group in batch_groups(0)]
    assert handled[-1].hold and not handled[-1].release
    drained = await learner.drain(ctx)
    assert sorted(drained.release) == sorted(g.group_id for g in batch_groups(0))
    assert checkpoints.latest(out).step == learner.trainer.step == 2
    assert (await learner.drain(ctx)).release == [] and len(checkpoints.listed(out)) == 1  # nothing new
    await learner.close()


async def test_trained_groups_are_acked_only_once_a_checkpoint_covers_them(model_dir, tmp_path):
    from trainer import checkpoint as checkpoints

    out = tmp_path / "run"
    learner = new_learner(model_dir, out, *RESUME_OVERRIDES, "learner.save_steps=4")  # 2 steps per batch
    ctx = FakeContext(stage="learner", worker="w")
    await learner.start(ctx)
    ids = {b: [g.group_id for g in batch_groups(b)] for b in range(3)}

    async def feed(target, b):
        return [await target.handle(group, ctx) for group in batch_groups(b)]

    first = await feed(learner, 0)  # trained and published, but no checkpoint yet: every group stays held
    assert learner.trainer.step == 2 and any(edge == "weights" for edge, _ in first[-1].outputs)
    assert all(h.hold for h in first) and not any(h.release for h in first)
    assert not any(edge == "feedback" for h in first for edge, _ in h.outputs)  # "trained" waits for the ack
    second = await feed(learner, 1)  # checkpoint-4 covers batches 0 and 1: both are acked with its outputs
    assert not second[-1].hold and sorted(second[-1].release) == sorted(ids[0] + ids[1])
    trained = [f.prompt_id for edge, f in second[-1].outputs if edge == "feedback" and f.outcome == "trained"]
    assert trained == [g.prompt_id for b in (0, 1) for g in batch_groups(b)]
    assert checkpoints.load(out / "checkpoint-4").state["unacked_group_ids"] == ids[0] + ids[1]
    third = await feed(learner, 2)
    assert learner.trainer.step == 6 and third[-1].hold and not third[-1].release
    await learner.close()

    # Killed here: the transport redelivers batch 1 (if its ack was lost) and batch 2 (held). The resumed
    # learner acks batch 1 without training it and trains batch 2 again from checkpoint-4.
    resumed = new_learner(model_dir, out, *RESUME_OVERRIDES, "learner.save_steps=4",
                          resume_from=checkpoints.latest(out))
    await resumed.start(ctx)
    again = await feed(resumed, 1)  # acked untrained, with the "trained" feedback the kill kept from landing
    assert [(h.hold, h.release) for h in again] == [(False, [])] * 2 and resumed.trainer.step == 4
    assert [[(e, f.outcome, f.prompt_id) for e, f in h.outputs] for h in again] == [
        [("feedback", "trained", g.prompt_id)] for g in batch_groups(1)]
    retrained = await feed(resumed, 2)
    assert resumed.trainer.step == 6 and retrained[-1].hold
    assert jsonl_steps(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    await resumed.close()

    # save_steps = 0 (a checkpoint only at the end): nothing to resume from before it, so each batch is acked
    at_once = new_learner(model_dir, tmp_path / "at-once", *RESUME_OVERRIDES, "learner.save_steps=0")
    await at_once.start(ctx)
    handled = await feed(at_once, 0)
    assert not handled[-1].hold and sorted(handled[-1].release) == sorted(ids[0])
    await at_once.close()
