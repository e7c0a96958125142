"""The GRPO variants of issue 26 against numbers derived by hand from their formulas (float64, value and
gradient): CISPO, SAPO, the order of terms (the entropy mask leaves the KL term alone), off-policy sequence
masking, GDPO advantages; their config checks; the padding-free path; and each option in a short demo run
that still learns (real vLLM, marked e2e)."""

from __future__ import annotations

import asyncio
import json
import math
import uuid

import numpy as np
import pytest
import torch
from fake_context import FakeContext

from config import ConfigError, config_from_dict, load_config
from grpo.advantages import compute_advantages, rewards_per_func
from grpo.loss import policy_loss
from pipeline.records import (
    GroupClosed,
    ScoredGroup,
    ScoredTrajectory,
    TrainGroup,
    Trajectory,
    pack_f32,
    pack_i32,
)
from stages.advantage import Advantage

F64 = torch.float64
LN = math.log


def t(rows):
    return torch.tensor(rows, dtype=F64)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


# ----------------------------------------------------------------------------- CISPO


def test_cispo_weights_the_log_prob_by_the_detached_ratio_capped_at_epsilon_high():
    # ratios w: row 0 (A = +1) [2, 0.5], row 1 (A = -2) [4, 1]; epsilon_high = 1.5 caps w itself.
    logps = t([[LN(0.5), LN(0.25)], [LN(0.5), LN(0.5)]]).requires_grad_()
    old = t([[LN(0.25), LN(0.5)], [LN(0.125), LN(0.5)]])
    adv = t([1.0, -2.0])
    loss, stats = policy_loss(logps, old, None, adv, torch.ones(2, 2, dtype=F64), beta=0.0, loss_type="cispo",
                              epsilon=0.2, epsilon_high=1.5, num_items_in_batch=8.0)
    # L_t = -min(w, 1.5) A l_t, summed and divided by num_items_in_batch (as dapo)
    row0 = -(1.5 * LN(0.5) + 0.5 * LN(0.25)) * 1.0
    row1 = -(1.5 * LN(0.5) + 1.0 * LN(0.5)) * -2.0
    assert float(loss.detach()) == pytest.approx((row0 + row1) / 8, rel=1e-12)
    loss.backward()
    # the capped ratio is a constant: d/dl_t = -min(w, 1.5) A / 8
    torch.testing.assert_close(logps.grad, t([[-1.5 / 8, -0.5 / 8], [1.5 * 2 / 8, 1.0 * 2 / 8]]))
    # only w > epsilon_high with A > 0 counts (row 1's w = 4 has A < 0); no PPO clip ratios
    assert float(stats["cispo_clip_ratio"]) == pytest.approx(1 / 4)
    assert "clip_ratio/region_mean" not in stats


def test_cispo_without_num_items_divides_by_the_tokens_and_refuses_a_sequence_ratio():
    logps = t([[-1.0, -3.0, 0.0]])
    mask = t([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(logps, None, None, t([1.0]), mask, beta=0.0, loss_type="cispo", epsilon_high=5.0)
    assert float(loss.detach()) == pytest.approx(-(-1.0 - 3.0) / 2)  # w = 1 on-policy: -A l summed over 2 tokens
    for level in ("sequence", "sequence_token"):
        with pytest.raises(ValueError, match="cispo.*importance_sampling_level='token'"):
            policy_loss(logps, None, None, t([1.0]), mask, beta=0.0, loss_type="cispo",
                        importance_sampling_level=level)


# ----------------------------------------------------------------------------- SAPO


def test_sapo_soft_gate_value_and_gradient():
    # row 0: A = +1 (tau_pos = 2), w = [1.5, 1]; row 1: A = -1 (tau_neg = 1.05 default), w = [0.5], one token.
    logps = t([[LN(1.5), 0.0], [LN(0.5), 0.0]]).requires_grad_()
    old = torch.zeros(2, 2, dtype=F64)
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = policy_loss(logps, old, None, t([1.0, -1.0]), mask, beta=0.0, loss_type="sapo", tau_pos=2.0)
    # L_t = -sigmoid(tau (w - 1)) (4 / tau) A, averaged as grpo (per row, then over rows)
    tok00 = -sigmoid(2.0 * 0.5) * (4 / 2.0) * 1.0
    tok01 = -sigmoid(0.0) * (4 / 2.0) * 1.0
    tok10 = -sigmoid(1.05 * -0.5) * (4 / 1.05) * -1.0
    assert float(loss.detach()) == pytest.approx(((tok00 + tok01) / 2 + tok10) / 2, rel=1e-12)
    loss.backward()
    # dL_t/dl_t = -4 s (1 - s) w A with s = sigmoid(tau (w - 1)); at w = 1 it is -A, GRPO's on-policy gradient
    s00, s10 = sigmoid(1.0), sigmoid(-0.525)
    expected = t([[-4 * s00 * (1 - s00) * 1.5 / 4, -1.0 / 4], [4 * s10 * (1 - s10) * 0.5 / 2, 0.0]])
    torch.testing.assert_close(logps.grad, expected)
    assert set(stats) == {"kl"}  # no clip ratio for sapo, as ms-swift


# ----------------------------------------------------------------------------- order of terms


def test_entropy_mask_scales_the_policy_term_only_then_kl_then_the_rollout_is_weight():
    # On-policy (w = 1, A = 1: P_t = -1), ref - logp = [ln 2, -ln 2], rollout IS token_truncate at 1.5 of
    # r = exp(old - rollout) = [0.5, 2] -> [0.5, 1.5]; the entropy mask drops token 0's policy term.
    logps = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = t([[LN(2.0), -LN(2.0)]])
    rollout = t([[LN(2.0), LN(0.5)]])
    loss, stats = policy_loss(logps, None, ref, t([1.0]), torch.ones(1, 2, dtype=F64), beta=0.5,
                              rollout_logps=rollout, rollout_is_mode="token_truncate", rollout_is_threshold=1.5,
                              entropy_mask=t([[0.0, 1.0]]))
    kl0, kl1 = 2.0 - LN(2.0) - 1, 0.5 + LN(2.0) - 1  # k3: e^x - x - 1
    # L_t = (P_t * mask_t + beta * KL_t) * is_t; grpo: the row's mean over its 2 tokens
    assert float(loss.detach()) == pytest.approx(((0 + 0.5 * kl0) * 0.5 + (-1 + 0.5 * kl1) * 1.5) / 2, rel=1e-12)
    loss.backward()
    # dKL/dl = 1 - e^x, dP/dl = -A w: token 0 keeps its KL gradient (the old order zeroed it)
    torch.testing.assert_close(logps.grad, t([[0.5 * (1 - 2.0) * 0.5 / 2, (-1 + 0.5 * (1 - 0.5)) * 1.5 / 2]]))
    assert float(stats["kl"]) == pytest.approx((kl0 + kl1) / 2)


# ----------------------------------------------------------------------------- off-policy sequence mask

# Current log-probs 0 (on-policy, w = 1, P_t = -A). Engine log-probs: rows 0 and 1 are 0.8 nats more likely
# under the engine (mean over tokens), row 2 only 0.2. delta = 0.5: row 0 (A = -1) is dropped, row 1
# (A = +2, positive) and row 2 (gap below delta) stay.
ROLLOUT = [[1.0, 0.6], [1.0, 0.6], [0.2, 0.0]]
MASK = [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]]
ADV = [-1.0, 2.0, -1.0]


@pytest.mark.parametrize(
    "loss_type,masked,unmasked",
    [
        ("grpo", (0 - 2 + 1) / 3, (1 - 2 + 1) / 3),  # a dropped row adds 0 and still counts in the mean over rows
        ("bnpo", (-4 + 1) / 3, (2 - 4 + 1) / 5),  # the dropped tokens leave the token count
        ("dapo", (-4 + 1) / 5, (2 - 4 + 1) / 5),  # num_items_in_batch (5) stays
        ("dr_grpo", (-4 + 1) / (3 * 2), (2 - 4 + 1) / (3 * 2)),  # rows x max_completion_length stays
        ("sapo", (0 - 2 + 1) / 3, (1 - 2 + 1) / 3),  # averaged as grpo (tau = 2 below makes P_t = -A too)
    ],
)
def test_off_policy_mask_drops_negative_sequences_far_from_the_engine(loss_type, masked, unmasked):
    logps = torch.zeros(3, 2, dtype=F64, requires_grad=True)
    kwargs = {"beta": 0.0, "loss_type": loss_type, "max_completion_length": 2, "num_items_in_batch": 5.0,
              "rollout_logps": t(ROLLOUT)}
    if loss_type == "sapo":  # tau = 2 on both sides: sigmoid(0) * 4 / 2 = 1, so P_t = -A as the others
        kwargs.update(tau_pos=2.0, tau_neg=2.0)
    loss, stats = policy_loss(logps, None, None, t(ADV), t(MASK), off_policy_sequence_mask_delta=0.5, **kwargs)
    assert float(loss.detach()) == pytest.approx(masked, rel=1e-12)
    assert float(stats["off_policy_sequence_mask/dropped_token_ratio"]) == pytest.approx(2 / 5)
    loss.backward()
    assert logps.grad[0].tolist() == [0.0, 0.0] and logps.grad[1].abs().sum() > 0
    off, off_stats = policy_loss(torch.zeros(3, 2, dtype=F64), None, None, t(ADV), t(MASK), **kwargs)
    assert float(off) == pytest.approx(unmasked, rel=1e-12)
    assert "off_policy_sequence_mask/dropped_token_ratio" not in off_stats


def test_off_policy_mask_reads_the_engine_log_probs_else_the_old_ones():
    logps, mask, adv = torch.zeros(3, 2, dtype=F64), t(MASK), t(ADV)
    key = "off_policy_sequence_mask/dropped_token_ratio"
    # No engine log-probs: the old policy's are the behaviour policy (row 0 dropped as above).
    _, stats = policy_loss(logps, t(ROLLOUT), None, adv, mask, beta=0.0, off_policy_sequence_mask_delta=0.5)
    assert float(stats[key]) == pytest.approx(2 / 5)
    # Both given: the engine's win (here equal to the current policy: nothing is dropped).
    _, stats = policy_loss(logps, t(ROLLOUT), None, adv, mask, beta=0.0, off_policy_sequence_mask_delta=0.5,
                           rollout_logps=torch.zeros(3, 2, dtype=F64))
    assert float(stats[key]) == 0.0
    # The gap must EXCEED delta: 0.8 is not above 0.8.
    _, stats = policy_loss(logps, None, None, adv, mask, beta=0.0, off_policy_sequence_mask_delta=0.8,
                           rollout_logps=t(ROLLOUT))
    assert float(stats[key]) == 0.0


# ----------------------------------------------------------------------------- GDPO

# Two prompts of three requests, two reward functions weighted [1, 0.5]; NaN = the function returned None.
GDPO_PER_FUNC = [[1.0, 1.0], [0.0, 1.0], [0.0, np.nan], [1.0, 0.0], [1.0, 0.5], [1.0, 1.0]]
GDPO_PROMPTS = ["a", "a", "a", "b", "b", "b"]


def test_gdpo_normalises_each_function_per_group_then_the_weighted_sum_over_the_batch():
    # a, f1 = [1, 0, 0]: mean 1/3, Bessel std sqrt(1/3) -> [2/sqrt(3), -1/sqrt(3), -1/sqrt(3)]
    # a, f2 = [1, 1, None]: std 0 over its two scores -> 0 / 1e-8 = 0; the None -> 0
    # b, f1 = [1, 1, 1]: 0;  b, f2 = [0, 0.5, 1]: mean 0.5, std 0.5 -> [-1, 0, 1], weight 0.5 -> [-0.5, 0, 0.5]
    # sums [2/sqrt3, -1/sqrt3, -1/sqrt3, -0.5, 0, 0.5]: mean 0, Bessel std sqrt((4/3 + 1/3 + 1/3 + 1/2) / 5) = sqrt(1/2)
    adv = compute_advantages([0.0] * 6, GDPO_PROMPTS, [f"r{i}" for i in range(6)], scale_rewards="gdpo",
                             rewards_per_func=GDPO_PER_FUNC, reward_weights=[1.0, 0.5])
    r = math.sqrt(2 / 3)
    assert adv == pytest.approx([2 * r, -r, -r, -math.sqrt(0.5), 0.0, math.sqrt(0.5)], rel=1e-7)


def test_gdpo_counts_a_split_request_once_and_a_lone_score_as_zero():
    # Request a0 split into two records: the statistics see it once, both records get its advantage.
    per_func = [GDPO_PER_FUNC[0], *GDPO_PER_FUNC]
    requests = ["r0", *[f"r{i}" for i in range(6)]]
    adv = compute_advantages([0.0] * 7, ["a", *GDPO_PROMPTS], requests, scale_rewards="gdpo",
                             rewards_per_func=per_func, reward_weights=[1.0, 0.5])
    r = math.sqrt(2 / 3)
    assert adv[:4] == pytest.approx([2 * r, 2 * r, -r, -r], rel=1e-7)
    # One score in a group has no std (ms-swift's nanstd is NaN, then 0): f2 adds nothing to group a.
    lone = [[1.0, 5.0], [0.0, np.nan], [0.0, np.nan]]
    adv = compute_advantages([0.0] * 3, ["a"] * 3, ["x", "y", "z"], scale_rewards="gdpo",
                             rewards_per_func=lone, reward_weights=[1.0, 1.0])
    third = 1 / math.sqrt(3)
    assert adv == pytest.approx([2 * third, -third, -third], rel=1e-7)  # f1 alone; then over the batch: std 1
    assert compute_advantages([1.0], ["a"], ["x"], scale_rewards="gdpo", rewards_per_func=[[1.0]],
                              reward_weights=[1.0]).tolist() == [0.0]


def test_gdpo_needs_the_per_function_rewards_and_the_grpo_estimator():
    with pytest.raises(ValueError, match="rewards_per_func"):
        compute_advantages([1.0, 0.0], ["a", "a"], ["x", "y"], scale_rewards="gdpo")
    with pytest.raises(ValueError, match="2 functions but reward_weights 1"):
        compute_advantages([1.0, 0.0], ["a", "a"], ["x", "y"], scale_rewards="gdpo",
                           rewards_per_func=[[1, 0], [0, 1]], reward_weights=[1.0])
    with pytest.raises(ValueError, match="estimator must be grpo"):
        compute_advantages([1.0, 0.0], ["a", "a"], ["x", "y"], scale_rewards="gdpo", estimator="rloo",
                           rewards_per_func=[[1], [0]], reward_weights=[1.0])
    with pytest.raises(ValueError, match="group, batch, none, gdpo"):
        compute_advantages([1.0], ["a"], ["x"], scale_rewards="nope")


def scored_group(prompt, scores):
    records = []
    for i, (accuracy, fmt) in enumerate(scores):
        traj = Trajectory(prompt_id=prompt, attempt=0, request_id=f"{prompt}/0/{i}", generation_batch=0,
                          prompt_ids=pack_i32([1]), completion_ids=pack_i32([2]), logprobs=pack_f32([-1.0]),
                          policy_version=0, max_policy_version=0)
        rewards = {"accuracy": accuracy, "format": None if fmt is None or math.isnan(fmt) else fmt}
        total = sum(w * v for w, v in zip((1.0, 0.5), (accuracy, rewards["format"])) if v is not None)
        records.append(ScoredTrajectory(trajectory=traj, rewards=rewards, reward=total))
    manifest = GroupClosed(prompt_id=prompt, attempt=0, generation_batch=0, record_ids=[r.record_id for r in records])
    return ScoredGroup(manifest=manifest, records=records)


def test_the_stage_passes_the_per_function_rewards_and_waits_for_the_generation_batch():
    cfg = config_from_dict({
        "reward": {"reward_funcs": ["accuracy", "format"], "reward_weights": [1.0, 0.5]},
        "grpo": {"num_generations": 3, "generation_batch_size": 6, "per_device_train_batch_size": 6,
                 "scale_rewards": "gdpo"},
    })
    stage = Advantage(cfg)
    stream = [scored_group("a", GDPO_PER_FUNC[:3]), scored_group("b", GDPO_PER_FUNC[3:])]
    assert rewards_per_func([r for g in stream for r in g.records], stage.reward_names)[2, 1] != 0

    async def drive():
        return [await stage.handle(record, FakeContext(stage='advantage', worker='w')) for record in stream]

    outs = asyncio.run(drive())
    assert all(not o.outputs for o in outs[:-1])  # group a waits for b: the sum is normalised over the batch
    a, b = (group for _, group in outs[-1].outputs)
    r = math.sqrt(2 / 3)
    assert a.advantages + b.advantages == pytest.approx([2 * r, -r, -r, -math.sqrt(0.5), 0.0, math.sqrt(0.5)])


# ----------------------------------------------------------------------------- public signatures


def test_the_public_functions_keep_their_homes_and_take_the_new_options_as_keywords():
    import inspect

    import stages.advantage
    import stages.learner

    loss = inspect.signature(stages.learner.policy_loss).parameters
    for name, default in (("tau_pos", 1.0), ("tau_neg", 1.05), ("entropy_mask", None),
                          ("off_policy_sequence_mask_delta", None)):
        assert (loss[name].kind, loss[name].default) == (inspect.Parameter.KEYWORD_ONLY, default)
    advantages = inspect.signature(stages.advantage.compute_advantages).parameters
    assert list(advantages)[:3] == ["rewards", "prompt_ids", "request_ids"]
    for name in ("rewards_per_func", "reward_weights"):
        assert (advantages[name].kind, advantages[name].default) == (inspect.Parameter.KEYWORD_ONLY, None)


# ----------------------------------------------------------------------------- config


def cfg_with(*overrides):
    return load_config("configs/demo.toml", list(overrides))


def test_config_takes_the_new_values_with_ms_swift_names():
    g = cfg_with("grpo.loss_type=cispo", "grpo.epsilon_high=5.0").grpo
    assert (g.loss_type, g.epsilon_high) == ("cispo", 5.0)
    g = cfg_with("grpo.loss_type=sapo", "grpo.tau_pos=0.5", "grpo.tau_neg=2.0").grpo
    assert (g.loss_type, g.tau_pos, g.tau_neg) == ("sapo", 0.5, 2.0)
    g = cfg_with("grpo.off_policy_sequence_mask_delta=0.1", "grpo.scale_rewards=gdpo").grpo
    assert (g.off_policy_sequence_mask_delta, g.scale_rewards) == (0.1, "gdpo")
    g = cfg_with().grpo
    assert (g.tau_pos, g.tau_neg, g.off_policy_sequence_mask_delta) == (1.0, 1.05, None)


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["grpo.loss_type=cispoo"], ["grpo, bnpo, dr_grpo, dapo, cispo, sapo", "did you mean cispo"]),
        (["grpo.scale_rewards=gpdo"], ["group, batch, none, gdpo"]),
        (["grpo.loss_type=cispo", "grpo.importance_sampling_level=sequence"], ["cispo", "importance_sampling_level"]),
        (["grpo.scale_rewards=gdpo", "grpo.advantage_estimator=rloo"], ["gdpo", "advantage_estimator"]),
        (["grpo.scale_rewards=gdpo", "grpo.kl_in_reward=true"], ["gdpo", "kl_in_reward = false"]),
        (["grpo.off_policy_sequence_mask_delta=0.1", "grpo.loss_type=bnpo", "learner.max_tokens_per_batch=512"],
         ["off_policy_sequence_mask_delta", "max_tokens_per_batch"]),
        (["grpo.tau_neg=0"], ["grpo.tau_neg", "> 0"]),
        (["grpo.off_policy_sequence_mask_delta=-1"], ["off_policy_sequence_mask_delta", ">= 0"]),
    ],
)
def test_config_names_the_valid_values_and_refuses_what_cannot_work(overrides, words):
    with pytest.raises(ConfigError) as error:
        cfg_with(*overrides)
    for word in words:
        assert word in str(error.value)


# ----------------------------------------------------------------------------- the learner


@pytest.fixture(scope="module")
def model_dir(tiny_qwen2):
    return tiny_qwen2  # conftest's one-layer random Qwen2


def make_trainer(model_dir, out, *overrides):
    from trainer.trainer import Trainer

    cfg = load_config("configs/demo.toml", [
        f"model.model={model_dir}", "grpo.beta=0", "grpo.num_generations=4", "grpo.generation_batch_size=8",
        "grpo.per_device_train_batch_size=8", "learner.learning_rate=1e-2", *overrides,
    ])
    trainer = Trainer(cfg, model_dir, out, num_batches=10)
    trainer.load()
    trainer.run = "t"
    return trainer


def records_and_advantages(seed=0):
    """8 records with engine log-probs far above the tiny model's (about -4 nats), so a negative-advantage
    sequence is masked at any small delta."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(8):
        prompt = rng.integers(1, 64, size=int(rng.integers(2, 5)))
        completion = rng.integers(1, 64, size=int(rng.integers(2, 6)))
        traj = Trajectory(prompt_id=f"p{i // 4}", attempt=0, request_id=f"p{i // 4}/0/{i}", generation_batch=0,
                          prompt_ids=pack_i32(prompt), completion_ids=pack_i32(completion),
                          logprobs=pack_f32(np.full(len(completion), -0.5)), policy_version=0, max_policy_version=0)
        records.append(ScoredTrajectory(trajectory=traj, rewards={"accuracy": float(i)}, reward=float(i)))
    return records, [1.0, -1.0, 0.5, -0.5, -1.0, 1.5, 0.25, -0.75]


@pytest.mark.parametrize("overrides", [
    ["grpo.loss_type=cispo", "grpo.epsilon_high=1.1"],
    ["grpo.loss_type=sapo", "grpo.beta=0.04"],
    ["grpo.loss_type=dapo", "grpo.off_policy_sequence_mask_delta=0.5"],
    ["grpo.loss_type=grpo", "grpo.off_policy_sequence_mask_delta=0.5", "grpo.rollout_importance_sampling_mode=token_mask"],
])
def test_padding_free_micro_batches_give_the_padded_loss_and_gradients(model_dir, tmp_path, overrides):
    from grpo.loss import host_stats
    from trainer.model import Batch

    records, advantages = records_and_advantages()
    padded = make_trainer(model_dir, tmp_path / "padded", *overrides)
    packed = make_trainer(model_dir, tmp_path / "packed", *overrides, "learner.max_tokens_per_batch=12")
    batch = Batch(records, advantages, padded.pad_id)
    with torch.no_grad():
        old = padded.logps(padded.model, batch) - 0.2 * torch.arange(batch.width_c)  # ratios away from 1
        ref = padded.logps(padded.model, batch) + 0.1 if padded.ref_model is not None else None
    beta = padded.cfg.grpo.beta
    a, b = host_stats([padded.minibatch_backward(batch, old, ref, beta=beta, num_items_in_batch=40.0),
                       packed.minibatch_backward(batch, old, ref, beta=beta, num_items_in_batch=40.0)])
    assert a.keys() == b.keys() and a["loss"] != 0.0
    for key in a:
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    if "grpo.off_policy_sequence_mask_delta=0.5" in overrides:  # engine log-probs far above: every A < 0 row goes
        kept = [i for i, adv in enumerate(advantages) if adv >= 0]
        dropped_tokens = 1 - float(batch.completion_mask[kept].sum() / batch.completion_mask.sum())
        assert a["off_policy_sequence_mask/dropped_token_ratio"] == pytest.approx(dropped_tokens, abs=1e-6)
    for x, y in zip(padded.model.parameters(), packed.model.parameters()):
        torch.testing.assert_close(y.grad, x.grad, rtol=0, atol=1e-5)
    # The optimizer step's metrics row carries the variant's stats under their names.
    padded.optimizer.zero_grad()
    groups = [TrainGroup(prompt_id=f"p{g}", attempt=0, generation_batch=0, records=records[4 * g : 4 * g + 4],
                         advantages=advantages[4 * g : 4 * g + 4]) for g in (0, 1)]
    (row,) = padded.train_generation_batch(groups, 0)
    assert math.isfinite(row["loss"])
    assert ("cispo_clip_ratio" in row) == ("grpo.loss_type=cispo" in overrides)
    assert ("clip_ratio/region_mean" in row) == any(o in overrides for o in ("grpo.loss_type=dapo", "grpo.loss_type=grpo"))


# ----------------------------------------------------------------------------- the demo still learns

DEMO_STEPS = 20


@pytest.mark.e2e
@pytest.mark.parametrize("option", [
    ["grpo.loss_type=cispo", "grpo.epsilon_high=5.0"],
    ["grpo.loss_type=sapo"],
    ["grpo.scale_rewards=gdpo"],
    ["grpo.off_policy_sequence_mask_delta=0.01"],
], ids=["cispo", "sapo", "gdpo", "off_policy_mask"])
async def test_each_variant_still_learns_the_demo(tmp_path, vllm_engine, option):
    from rollstream import train

    cfg = load_config("configs/demo.toml", [
        f"run.output_dir={json.dumps(str(tmp_path))}", f"run.max_steps={DEMO_STEPS}", "rollout.max_model_len=256",
        f"run.name=variant-{uuid.uuid4().hex[:6]}", *option,
    ])
    result = await train.run_pipeline(cfg, engine=vllm_engine)
    assert result.exit_code == 0
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == DEMO_STEPS and all(math.isfinite(r["loss"]) and r["nan_skipped"] == 0 for r in rows)
    accuracy = [r["rewards/accuracy/mean"] for r in rows]
    quarter = DEMO_STEPS // 4
    assert sum(accuracy[-quarter:]) / quarter > sum(accuracy[:quarter]) / quarter
    if "grpo.loss_type=cispo" in option:
        assert all("cispo_clip_ratio" in r and "clip_ratio/region_mean" not in r for r in rows)
    if "grpo.off_policy_sequence_mask_delta=0.01" in option:  # one-step-off samples: some sequences go
        assert max(r["off_policy_sequence_mask/dropped_token_ratio"] for r in rows) > 0
