"""GRPO: group-normalised advantages and the clipped policy-gradient loss with optional KL.

Everything here is a pure function of tensors, so the arithmetic is tested against hand-computed
cases. Shapes: ``B`` sequences, ``T`` completion positions (right-padded), ``mask`` 1.0 on real
completion tokens and 0.0 on padding.
"""

from __future__ import annotations

import attrs
import torch

from belayer_grpo._errors import BelayerGrpoError

__all__ = ["LOSS_AGGREGATIONS", "LossStats", "group_advantages", "grpo_loss", "kl_k3", "token_logprobs"]

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "sequence_sum_norm")


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """``(r - mean(group)) / (std(group) + eps)`` per sample; groups are consecutive runs of ``group_size``.

    ``std`` is the unbiased (n - 1) standard deviation, as in DeepSeekMath's GRPO; with
    ``normalize_std=False`` only the group mean is subtracted (Dr. GRPO). A group whose rewards
    are all equal gets advantage 0 for every sample: it carries no signal.
    """
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise BelayerGrpoError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size} (need >= 2)"
        )
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` per position: logits (B, T, V), targets (B, T) -> (B, T)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@attrs.frozen
class LossStats:
    """Diagnostics of one loss evaluation (plain floats, for logging)."""

    loss: float
    policy_loss: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    num_tokens: int


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    if how == "token_mean":
        # Every token weighs the same (DAPO): long completions are not diluted.
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if how == "sequence_mean":
        # Mean over each sequence's tokens, then over sequences (the original GRPO).
        lengths = mask.sum(dim=1).clamp(min=1.0)
        return ((per_token * mask).sum(dim=1) / lengths).mean()
    if how == "sequence_sum_norm":
        # Sum per sequence over a constant (Dr. GRPO): no length bias.
        return (per_token * mask).sum() / (mask.shape[0] * mask.shape[1])
    raise BelayerGrpoError(f"unknown loss aggregation {how!r}; use one of {LOSS_AGGREGATIONS}")


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    aggregation: str = "token_mean",
) -> tuple[torch.Tensor, LossStats]:
    """The clipped GRPO objective, negated for minimisation, and its diagnostics.

    Per token: ``-min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL``
    with ``ratio = exp(logprobs - old_logprobs)``; ``advantages`` are per sequence (B,).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise BelayerGrpoError(
            f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and mask "
            f"{tuple(mask.shape)} must all be (B, T)"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise BelayerGrpoError(
            f"advantages must be (B,) = {tuple(logprobs.shape[:1])}, got {tuple(advantages.shape)}"
        )
    if beta > 0 and ref_logprobs is None:
        raise BelayerGrpoError("beta > 0 needs ref_logprobs (the reference model's logprobs)")
    high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.float()
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages.float().unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    policy_loss = _aggregate(per_token, mask, aggregation)
    kl = torch.zeros((), dtype=policy_loss.dtype)
    if ref_logprobs is not None:
        kl = _aggregate(kl_k3(logprobs, ref_logprobs), mask, aggregation)
    loss = policy_loss + beta * kl if beta > 0 else policy_loss
    with torch.no_grad():
        num_tokens = float(mask.sum().clamp(min=1.0))
        was_clipped = ((clipped < unclipped).float() * mask).sum() / num_tokens
        stats = LossStats(
            loss=float(loss),
            policy_loss=float(policy_loss),
            kl=float(kl),
            clip_fraction=float(was_clipped),
            ratio_mean=float((ratio * mask).sum() / num_tokens),
            num_tokens=int(mask.sum()),
        )
    return loss, stats
