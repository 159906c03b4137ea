"""The exact loss of a stretch under restarts (all orders in the failure rate; issue 34's
workloads 38 and 150: a tenth of the steps fail, and the first-order loss declined every checkpoint)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from belayer_policy import (
    AdaptiveRule,
    RenewalLoss,
    StepContext,
    compare_now_and_later,
    protected_cost,
)


def simulated_loss(rate: float, step_s: float, restore_s: float, before: int, steps: int, runs: int) -> float:
    """Mean seconds beyond ``steps * step_s`` to run ``steps`` steps after ``before`` unprotected ones:
    failures a Poisson process of ``rate`` per step; each pays ``restore_s`` and restarts from the
    ready checkpoint (``before`` steps back)."""
    rng = random.Random(11)
    per_s = rate / step_s
    losses = []
    for _ in range(runs):
        done, total = float(before * step_s), 0.0  # work done since the checkpoint, time spent
        end = (before + steps) * step_s
        start = done
        while True:
            fail_in = rng.expovariate(per_s)
            if done + fail_in >= end:
                total += end - done
                break
            total += fail_in + restore_s
            done = 0.0
        losses.append(total - (end - start))
    return statistics.fmean(losses)


@pytest.mark.parametrize(("rate", "before", "steps"), [(0.1, 0, 6), (0.1, 3, 3), (0.3, 2, 4)])
def test_the_loss_is_that_of_restarts(rate: float, before: int, steps: int) -> None:
    loss = RenewalLoss(rate, 2.0, 2.0)(before, steps)
    sampled = simulated_loss(rate, 2.0, 2.0, before, steps, runs=40000)
    assert loss == pytest.approx(sampled, rel=0.03)


def test_to_first_order_the_model_loss_plus_one_restore_a_failure() -> None:
    rate, d, restore, u, steps = 1e-6, 3.0, 2.0, 4.0, 5.0
    first_order = rate * d * (steps * u + steps * steps / 2.0) + rate * steps * restore
    assert RenewalLoss(rate, d, restore)(u, steps) == pytest.approx(first_order, rel=1e-5)
    # the weight scales it; no rate, no loss
    assert RenewalLoss(rate, d, restore, weight=3.0)(u, steps) == pytest.approx(3.0 * first_order, rel=1e-5)
    assert RenewalLoss(0.0, d, restore)(u, steps) == 0.0


def test_an_impossible_stretch_stays_finite() -> None:
    loss = RenewalLoss(0.7, 0.25, 1.0)
    assert math.isfinite(loss(1e5, 10))
    assert loss(1e5, 10) >= loss(10, 10)
    # both exponents at their cap: their product must not overflow either
    assert math.isfinite(loss(1e5, 1e5))
    assert loss(1e5, 1e5) >= loss(1e5, 10)
    # no work to redo, or a weight of 0: finite, never nan (0 * inf)
    assert RenewalLoss(0.7, 0.0, 1.0)(1e5, 1e5) == RenewalLoss(0.7, 0.0, 1.0)(1e5, 1e5) >= 0.0
    assert RenewalLoss(0.7, 0.25, 1.0, weight=0.0)(1e5, 1e5) == 0.0


@given(
    st.integers(1, 40),
    st.floats(1e-4, 0.7),
    st.floats(0.01, 60.0),
    st.floats(0.0, 10.0),
    st.floats(0.0, 60.0),
)
def test_protected_cost_is_the_least_over_every_stretch_count_under_restarts(
    steps: int, rate: float, step_s: float, restore_s: float, visible: float
) -> None:
    loss = RenewalLoss(rate, step_s, restore_s)
    by_k = []
    for k in range(1, steps + 1):
        q, r = divmod(steps, k)
        by_k.append((k - 1) * visible + (k - r) * loss(0.0, q) + r * loss(0.0, q + 1))
    assert protected_cost(steps, 0.0, visible, loss) == pytest.approx(min(by_k), rel=1e-9)


def test_at_a_tenth_of_the_steps_failing_a_checkpoint_pays_that_the_first_order_declined() -> None:
    # One trajectory (its own rate), p = 0.1 a step of 2 s, 2 s restores, 5 unprotected steps and 3
    # to go; a checkpoint shows 5 s.  First order: it saves 3.2 s < 5 s, no checkpoint.  With the
    # failures of the redone work and their restores it saves 5.4 s, and sampled restarts agree.
    p, d, restore, visible = 0.1, 2.0, 2.0, 5.0
    rate = -math.log1p(-p)
    context = StepContext(
        step_index=5, regeneration_s=10.0, step_s=d, failure_probability=p, checkpoint_cost_s=visible,
        hidden_probability=0.0, visible_now_s=visible, visible_future_s=visible, extra_cost_s=0.0,
        remaining_steps=3, batch_size=1, restore_s=restore,
    )  # fmt: skip
    first_order = compare_now_and_later(5.0, 3.0, rate * d, visible)
    assert first_order.saving_s < visible
    verdict = AdaptiveRule().choose(context)
    assert verdict.checkpoint
    exact = compare_now_and_later(5.0, 3.0, 0.0, visible, RenewalLoss(rate, d, restore))
    assert verdict.benefit_s == pytest.approx(exact.saving_s)
    assert exact.delay_steps == 0  # the best plan that waits never checkpoints
    # sampled restarts: running the 3 steps unprotected loses more than a checkpoint now shows
    never = simulated_loss(rate, d, restore, 5, 3, runs=40000)
    now = simulated_loss(rate, d, restore, 0, 3, runs=40000)
    assert never - now > visible
