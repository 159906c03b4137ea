"""The sampler as a pure function: keyed uniforms, greedy, top-p truncation, logprobs."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from belayer_shadow._engine._sampler import keyed_uniform, sample

LOGITS = st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=40)


def test_keyed_uniform_is_a_pure_function_of_seed_and_index() -> None:
    draws = [keyed_uniform(seed, index) for seed in range(50) for index in range(50)]
    assert draws == [keyed_uniform(seed, index) for seed in range(50) for index in range(50)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    mean = sum(draws) / len(draws)
    assert abs(mean - 0.5) < 0.02
    assert keyed_uniform(2**64 - 1, 10**12) != keyed_uniform(0, 10**12)


@settings(max_examples=200, deadline=None)
@given(
    values=LOGITS, temperature=st.floats(0.05, 5.0), top_p=st.floats(0.01, 1.0), u=st.floats(0.0, 0.999999)
)
def test_sampled_token_is_inside_the_top_p_nucleus(
    values: list[float], temperature: float, top_p: float, u: float
) -> None:
    logits = torch.tensor([values])
    (token,), (logprob,) = sample(logits, [temperature], [top_p], [u])
    probs = torch.softmax(logits[0] / temperature, dim=-1).double()
    # The nucleus: tokens whose higher-ranked mass (strictly more likely ones) is below top_p.
    more_likely_mass = probs[probs > probs[token]].sum().item()
    assert more_likely_mass < top_p + 1e-9
    assert logprob == torch.log_softmax(logits[0] / temperature, dim=-1)[token].item()
    assert math.isfinite(logprob)


@settings(max_examples=100, deadline=None)
@given(values=LOGITS)
def test_greedy_takes_the_argmax_with_its_plain_logprob(values: list[float]) -> None:
    logits = torch.tensor([values])
    (token,), (logprob,) = sample(logits, [0.0], [1.0], [0.7])
    assert logits[0, token] == logits[0].max()  # compared as the float32 the model produces
    assert logprob == torch.log_softmax(logits[0], dim=-1)[token].item()


def test_the_uniform_picks_the_token_by_cumulative_probability() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    picks = [sample(logits, [1.0], [1.0], [u])[0][0] for u in (0.0, 0.49, 0.51, 0.79, 0.81, 0.999)]
    assert picks == [0, 0, 1, 1, 2, 2]
    # top_p = 0.6 keeps {0, 1} and renormalises: 0.5 / 0.8 = 0.625 for token 0.
    picks = [sample(logits, [1.0], [0.6], [u])[0][0] for u in (0.6, 0.65, 0.999)]
    assert picks == [0, 1, 1]


def test_rows_are_independent_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    temps, top_ps, us = (
        [0.0, 0.7, 1.0, 1.3, 0.0, 0.9],
        [1.0, 0.9, 0.5, 1.0, 1.0, 0.95],
        [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
    )
    together = sample(logits, temps, top_ps, us)
    alone = [sample(logits[i : i + 1], [temps[i]], [top_ps[i]], [us[i]]) for i in range(6)]
    assert together[0] == [a[0][0] for a in alone]
    assert together[1] == [a[1][0] for a in alone]
