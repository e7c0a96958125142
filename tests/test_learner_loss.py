"""GRPO loss core against hand-computed numbers, and the padded batch layout."""

import math

import pytest
import torch

from grpo.loss import policy_loss
from pipeline.records import ScoredTrajectory, Trajectory, pack_f32, pack_i32
from trainer.model import Batch


def test_on_policy_grpo_loss_is_minus_mean_advantage_plus_kl():
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -1.0, -0.5]])
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, stats = policy_loss(logps, None, ref, adv, mask, beta=0.1)
    # ratio = 1: token loss = -A + beta * kl, kl = exp(d) - d - 1 with d = ref - logp
    kl = lambda d: math.exp(d) - d - 1
    row0 = ((-1.0 + 0.1 * kl(-0.5)) + (-1.0 + 0.1 * kl(0.0))) / 2
    row1 = ((2.0 + 0.1 * kl(0.0)) + (2.0 + 0.1 * kl(-0.5)) + (2.0 + 0.1 * kl(0.0))) / 3
    assert float(loss.detach()) == pytest.approx((row0 + row1) / 2, rel=1e-6)
    assert float(stats["kl"]) == pytest.approx((kl(-0.5) * 2) / 5, rel=1e-6)
    assert float(stats["clip_ratio/region_mean"]) == 0.0
    loss.backward()
    # d loss / d logp for row 0, token 0 (on-policy ratio gradient = -A, KL gradient = beta*(1 - exp(d))) / 2 tokens / 2 rows
    expected = (-1.0 + 0.1 * (1 - math.exp(-0.5))) / 2 / 2
    assert float(logps.grad[0, 0]) == pytest.approx(expected, rel=1e-5)
    assert float(logps.grad[0, 2]) == 0.0  # masked


def test_clipping_and_clip_ratio_stats():
    old = torch.zeros(1, 2)
    logps = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logps, old, None, adv, mask, beta=0.0, epsilon=0.2)
    # A > 0: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5
    assert float(loss) == pytest.approx(-(1.2 + 0.5) / 2)
    assert float(stats["clip_ratio/high_mean"]) == 0.5
    assert float(stats["clip_ratio/low_mean"]) == 0.0  # low clipping counts only when A < 0
    loss_hi, _ = policy_loss(logps, old, None, adv, mask, beta=0.0, epsilon=0.2, epsilon_high=0.6)
    assert float(loss_hi) == pytest.approx(-(1.5 + 0.5) / 2)


@pytest.mark.parametrize(
    "loss_type,expected",
    [
        ("grpo", ((1 + 1) / 2 + (1) / 1) / 2),  # per-sequence token means, then mean
        ("bnpo", 3 / 3),
        ("dr_grpo", 3 / (2 * 4)),  # B * max_completion_length
        ("dapo", 3 / 6),  # num_items_in_batch
    ],
)
def test_loss_type_normalisation(loss_type, expected):
    logps = torch.zeros(2, 2)
    adv = torch.tensor([-1.0, -1.0])  # token loss = +1 each
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, _ = policy_loss(logps, None, None, adv, mask, beta=0.0, loss_type=loss_type, max_completion_length=4, num_items_in_batch=6)
    assert float(loss) == pytest.approx(expected)


def test_sequence_level_ratio_is_the_geometric_mean():
    old = torch.zeros(1, 2)
    logps = torch.tensor([[0.1, 0.3]])
    loss, _ = policy_loss(logps, old, None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0,
                          importance_sampling_level="sequence", epsilon=10.0)
    assert float(loss) == pytest.approx(-math.exp(0.2))


def test_bad_loss_type_is_named():
    with pytest.raises(ValueError, match="loss_type"):
        policy_loss(torch.zeros(1, 1), None, None, torch.zeros(1), torch.ones(1, 1), loss_type="nope")


def test_batch_left_pads_prompts_and_right_pads_completions():
    def rec(prompt, completion):
        t = Trajectory(prompt_id="p", attempt=0, request_id=f"r{len(prompt)}", generation_batch=0,
                       prompt_ids=pack_i32(prompt), completion_ids=pack_i32(completion),
                       logprobs=pack_f32([0.0] * len(completion)), policy_version=0, max_policy_version=0)
        return ScoredTrajectory(trajectory=t, rewards={}, reward=0.0)

    b = Batch([rec([1, 2, 3], [7]), rec([4], [8, 9])], [1.0, -1.0], pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 7, 0], [0, 0, 4, 8, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert b.position_ids.tolist()[1][2:] == [0, 1, 2]
    assert b.completion_ids.tolist() == [[7, 0], [8, 9]]
    assert b.completion_mask.tolist() == [[1.0, 0.0], [1.0, 1.0]]


def test_kl_is_clamped_as_ms_swift():
    logps = torch.zeros(1, 1)
    ref = torch.tensor([[50.0]])  # x clamps to 20, exp(20) - 21 then clamps to 10
    loss, stats = policy_loss(logps, None, ref, torch.zeros(1), torch.ones(1, 1), beta=1.0)
    assert float(loss) == pytest.approx(10.0) and float(stats["kl"]) == pytest.approx(10.0)


def test_beta_without_reference_and_dr_grpo_without_length_are_errors():
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(torch.zeros(1, 1), None, None, torch.zeros(1), torch.ones(1, 1), beta=0.04)
    with pytest.raises(ValueError, match="max_completion_length"):
        policy_loss(torch.zeros(1, 1), None, None, torch.zeros(1), torch.ones(1, 1), beta=0.0, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="rollout_logps"):
        policy_loss(torch.zeros(1, 1), None, None, torch.zeros(1), torch.ones(1, 1), beta=0.0, rollout_is_mode="token_mask")


def test_empty_row_counts_in_grpo_mean():
    logps = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss, _ = policy_loss(logps, None, None, torch.tensor([-1.0, -1.0]), mask, beta=0.0)
    assert float(loss) == pytest.approx(0.5)  # row 0 gives 1, the empty row 0, mean over 2 rows


# Rollout IS correction: old = 0 (on-policy learner), rollout log-probs make r_t = exp(0 - rollout_t).
R = torch.log(torch.tensor([[2.0, 0.25]]))  # log r, r = [2.0, 0.25]
ROLLOUT = -R  # old - rollout = R


@pytest.mark.parametrize(
    "mode,weights",
    [
        ("token_truncate", [1.5, 0.25]),  # min(r, C=1.5)
        ("token_mask", [0.0, 0.25]),  # r > C masked
        ("sequence_truncate", [1.0, 1.0]),  # rho = exp(mean(log r)) = sqrt(2 * 0.25) = 0.707 -> min(rho, 1.5)
        ("sequence_mask", [2.0, 0.25]),  # rho <= C: keep the token ratios
    ],
)
def test_rollout_is_modes(mode, weights):
    logps = torch.zeros(1, 2)
    loss, stats = policy_loss(logps, torch.zeros(1, 2), None, torch.tensor([-1.0]), torch.ones(1, 2), beta=0.0,
                              rollout_logps=ROLLOUT, rollout_is_mode=mode, rollout_is_threshold=1.5)
    rho = math.sqrt(2.0 * 0.25)
    expected = [min(rho, 1.5)] * 2 if mode == "sequence_truncate" else weights
    # token loss = +1 (A = -1, ratio 1), times the weight, grpo mean over the row
    assert float(loss) == pytest.approx(sum(expected) / 2, rel=1e-5)
    assert float(stats["rollout_correction/is_weight_mean"]) == pytest.approx(sum(expected) / 2, rel=1e-5)


def test_rollout_logps_without_a_mode_change_nothing():
    base, _ = policy_loss(torch.zeros(1, 2), None, None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0)
    same, stats = policy_loss(torch.zeros(1, 2), None, None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0, rollout_logps=ROLLOUT)
    assert float(base) == float(same) and "rollout_correction/is_weight_mean" not in stats


def test_gspo_token_has_sequence_value_and_token_gradient():
    logps = torch.tensor([[0.1, 0.3]], requires_grad=True)
    loss, _ = policy_loss(logps, torch.zeros(1, 2), None, torch.tensor([1.0]), torch.ones(1, 2), beta=0.0,
                          importance_sampling_level="sequence_token", epsilon=10.0)
    assert float(loss.detach()) == pytest.approx(-math.exp(0.2))
    loss.backward()
    # d/dlogp_t of -(exp(sg(seq)) * exp(logp_t - sg(logp_t))) / 2 = -exp(0.2) / 2 for every token
    assert logps.grad.tolist()[0] == pytest.approx([-math.exp(0.2) / 2] * 2, rel=1e-5)


def test_loss_weights_mask_out_whole_rows():
    def rec(n):
        t = Trajectory(prompt_id="p", attempt=0, request_id=f"r{n}", generation_batch=0, prompt_ids=pack_i32([1]),
                       completion_ids=pack_i32([5] * n), logprobs=pack_f32([0.0] * n), policy_version=0,
                       max_policy_version=0, finish_reason="length" if n == 3 else "stop")
        return ScoredTrajectory(trajectory=t, rewards={}, reward=0.0)

    b = Batch([rec(2), rec(3)], [1.0, 1.0], pad_id=0, loss_weights=[1.0, 0.0])
    assert b.completion_mask.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]


# ----------------------------------------------------------------------------- top_entropy_quantile


def test_high_entropy_mask_keeps_the_top_quantile_of_completion_tokens():
    from grpo.loss import high_entropy_mask

    entropy = torch.tensor([[0.1, 0.5, 0.9, 0.3]])
    # median of [0.1, 0.3, 0.5, 0.9] (linear interpolation) = 0.4: the two above it stay
    assert high_entropy_mask(entropy, torch.ones(1, 4), 0.5).tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert high_entropy_mask(entropy, torch.ones(1, 4), 1.0).tolist() == [[1.0, 1.0, 1.0, 1.0]]
    # a padded position never counts, however high its entropy: quantile over [0.1, 0.5, 0.9] -> 0.5
    padded = torch.tensor([[0.1, 0.5, 0.9, 5.0]])
    assert high_entropy_mask(padded, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), 0.5).tolist() == [[0.0, 1.0, 1.0, 0.0]]
    assert high_entropy_mask(entropy, torch.zeros(1, 4), 0.5).sum() == 0


def test_entropy_mask_zeroes_token_losses_but_keeps_the_normaliser():
    # On-policy, beta = 0, A = 1: every token loss is -1. grpo divides row 0 by its 3 tokens even
    # though only 2 are trained (TRL/ms-swift multiply the token loss, not the mask).
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    entropy_mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = policy_loss(logps, None, None, torch.tensor([1.0, 1.0]), mask, beta=0.0, entropy_mask=entropy_mask)
    assert float(loss.detach()) == pytest.approx((-2 / 3 + -1 / 2) / 2)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -1 / 6, -1 / 6], [-1 / 4, 0.0, 0.0]]))


# ----------------------------------------------------------------------------- sync_ref_model


def test_sync_ref_model_mixes_alpha_of_the_policy_into_the_reference():
    from trainer.model import sync_ref_model

    policy, ref = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[1.0, 2.0]]))
        policy.bias.fill_(4.0)
        ref.weight.copy_(torch.tensor([[3.0, -2.0]]))
        ref.bias.fill_(0.0)
    sync_ref_model(ref, policy, alpha=0.25)
    assert ref.weight.tolist() == [[0.25 * 1 + 0.75 * 3, 0.25 * 2 + 0.75 * -2]]
    assert ref.bias.tolist() == [1.0]
    assert policy.weight.tolist() == [[1.0, 2.0]]  # the policy is untouched


def test_users_still_import_policy_loss_from_the_learner_stage():
    import stages.learner

    assert stages.learner.policy_loss is policy_loss
