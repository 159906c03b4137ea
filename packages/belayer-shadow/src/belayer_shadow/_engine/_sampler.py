"""Sampling the next token of every sequence in a batch: greedy, temperature and top-p, with logprobs.

A sampled token is drawn by inverting the (top-p truncated) cumulative distribution at a uniform
number that depends only on `(seed, index)`. The draw is thus independent of the batch, of the
step and of the process: a request resumed on another worker samples what it would have.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["keyed_uniform", "sample"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that is a pure function of `(seed, index)`."""
    mixed = _splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64))
    return (mixed >> 11) * (1.0 / (1 << 53))


def sample(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    uniforms: Sequence[float],
) -> tuple[list[int], list[float]]:
    """Token ids and their logprobs for each row of `logits` (num_rows, vocab).

    Rows with temperature 0 take the argmax and report its plain log-softmax; the others sample
    from softmax(logits / temperature) truncated to top-p, using that row's uniform number, and
    report the token's log-probability under softmax(logits / temperature).
    """
    logits = logits.float()
    device = logits.device
    num_rows = logits.shape[0]
    divisors = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float32, device=device)
    logprobs = torch.log_softmax(logits / divisors.unsqueeze(1), dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, t in enumerate(temperatures) if t > 0]
    if rows:
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        tokens[index] = _sample_top_p(
            logprobs[index],
            torch.tensor([top_ps[i] for i in rows], dtype=torch.float64, device=device),
            torch.tensor([uniforms[i] for i in rows], dtype=torch.float64, device=device),
        )
    chosen = logprobs[torch.arange(num_rows, device=device), tokens]
    return tokens.tolist(), chosen.tolist()


def _sample_top_p(logprobs: torch.Tensor, top_ps: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    # float64 so that the cumulative sums do not depend on the summation order's rounding.
    probs = logprobs.double().exp()
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Keep a token if the mass before it is still below top_p (the first token always stays).
    keep = (cumulative - sorted_probs) < top_ps.unsqueeze(1)
    sorted_probs = sorted_probs * keep
    cumulative = sorted_probs.cumsum(dim=-1)
    targets = uniforms * cumulative[:, -1]
    positions = torch.searchsorted(cumulative, targets.unsqueeze(1), right=True).squeeze(1)
    # Land on a kept token even when rounding puts the target at the very end.
    positions = torch.minimum(positions, keep.sum(dim=-1) - 1)
    return order.gather(1, positions.unsqueeze(1)).squeeze(1)
