"""GRPO arithmetic against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from belayer_grpo._algorithm import group_advantages, grpo_loss, kl_k3
from belayer_grpo._errors import BelayerGrpoError


def test_advantages_of_two_groups_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    adv = group_advantages(rewards, 4, eps=0.0)
    # Group 1: mean 0.25, unbiased std sqrt(0.75/3) = 0.5 -> (0.75/0.5, -0.25/0.5, ...).
    assert adv[:4].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5])
    # Group 2: mean 0.75, std 0.5.
    assert adv[4:].tolist() == pytest.approx([0.5, 0.5, -1.5, 0.5])


def test_equal_rewards_give_zero_advantage_and_mean_only_mode() -> None:
    assert group_advantages(torch.tensor([1.0, 1.0, 1.0]), 3).tolist() == [0.0, 0.0, 0.0]
    adv = group_advantages(torch.tensor([3.0, 1.0]), 2, normalize_std=False)
    assert adv.tolist() == [1.0, -1.0]


def test_advantages_reject_ragged_groups() -> None:
    with pytest.raises(BelayerGrpoError, match="groups of 3"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 3)


def test_loss_at_ratio_one_is_minus_mean_advantage() -> None:
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(logp, logp.clone(), adv, mask)
    # token_mean: tokens (2, 2, -1) -> -(2 + 2 - 1) / 3 = -1.
    assert float(loss) == pytest.approx(-1.0)
    assert stats.clip_fraction == 0.0
    assert stats.num_tokens == 3
    seq, _ = grpo_loss(logp, logp.clone(), adv, mask, aggregation="sequence_mean")
    assert float(seq) == pytest.approx(-(2.0 + -1.0) / 2)  # per-sequence means 2 and -1
    norm, _ = grpo_loss(logp, logp.clone(), adv, mask, aggregation="sequence_sum_norm")
    assert float(norm) == pytest.approx(-(2.0 + 2.0 - 1.0) / 4)  # B * T = 4


def test_clipping_by_hand() -> None:
    old = torch.zeros((1, 3))
    # ratios e^0.5 = 1.6487 (above 1 + 0.2), e^-0.5 = 0.6065 (below 1 - 0.2), 1.1 inside.
    new = torch.log(torch.tensor([[math.exp(0.5), math.exp(-0.5), 1.1]]))
    mask = torch.ones((1, 3))
    loss, stats = grpo_loss(new, old, torch.tensor([1.0]), mask, epsilon=0.2, epsilon_high=0.28)
    # Positive advantage: min(r, clip(r)) = (1.28, 0.6065, 1.1).
    assert float(loss) == pytest.approx(-(1.28 + math.exp(-0.5) + 1.1) / 3, rel=1e-5)
    assert stats.clip_fraction == pytest.approx(1 / 3)
    loss_neg, stats_neg = grpo_loss(new, old, torch.tensor([-1.0]), mask, epsilon=0.2, epsilon_high=0.28)
    # Negative advantage: min(-r, -clip(r)) = (-1.6487, -0.8, -1.1); loss is minus that.
    assert float(loss_neg) == pytest.approx((math.exp(0.5) + 0.8 + 1.1) / 3, rel=1e-5)
    assert stats_neg.clip_fraction == pytest.approx(1 / 3)


def test_clipped_tokens_get_no_gradient() -> None:
    old = torch.zeros((1, 2))
    new = torch.tensor([[0.5, 0.0]], requires_grad=True)
    loss, _ = grpo_loss(new, old, torch.tensor([1.0]), torch.ones((1, 2)), epsilon=0.2)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0, 0] == 0.0  # ratio 1.65 > 1.2: clipped
    assert float(new.grad[0, 1]) == pytest.approx(-0.5)  # d(-r/2)/dlogp at r = 1


def test_kl_k3_by_hand_and_in_the_loss() -> None:
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    # delta = ref - logp = (-0.5, 0): e^-0.5 + 0.5 - 1 and 0.
    expected = math.exp(-0.5) + 0.5 - 1.0
    assert kl_k3(logp, ref)[0].tolist() == pytest.approx([expected, 0.0])
    mask = torch.ones((1, 2))
    loss, stats = grpo_loss(logp, logp.clone(), torch.tensor([0.0]), mask, beta=0.1, ref_logprobs=ref)
    assert stats.kl == pytest.approx(expected / 2)
    assert float(loss) == pytest.approx(0.1 * expected / 2)
    with pytest.raises(BelayerGrpoError, match="ref_logprobs"):
        grpo_loss(logp, logp, torch.tensor([0.0]), mask, beta=0.1)


def test_shape_errors_name_the_tensors() -> None:
    with pytest.raises(BelayerGrpoError, match="advantages"):
        grpo_loss(torch.zeros((2, 3)), torch.zeros((2, 3)), torch.zeros(3), torch.ones((2, 3)))
    with pytest.raises(BelayerGrpoError, match="mask"):
        grpo_loss(torch.zeros((2, 3)), torch.zeros((2, 3)), torch.zeros(2), torch.ones((2, 2)))
    with pytest.raises(BelayerGrpoError, match="aggregation"):
        grpo_loss(
            torch.zeros((1, 1)), torch.zeros((1, 1)), torch.zeros(1), torch.ones((1, 1)), aggregation="x"
        )
