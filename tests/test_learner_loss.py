"""GRPO loss core against hand-computed numbers, and the padded batch layout."""

import math

import pytest
import torch

from pipeline.records import ScoredTrajectory, Trajectory, pack_f32, pack_i32
from stages.learner import Batch, policy_loss


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
    assert float(loss) == pytest.approx((row0 + row1) / 2, rel=1e-6)
    assert stats["kl"] == pytest.approx((kl(-0.5) * 2) / 5, rel=1e-6)
    assert stats["clip_ratio/region_mean"] == 0.0
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
    assert stats["clip_ratio/high_mean"] == 0.5
    assert stats["clip_ratio/low_mean"] == 0.0  # low clipping counts only when A < 0
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
