"""What a loss costs the batch when trajectories' durations spread, one cost probe at a time, and
the duration of a future step (issue 34: the policy over the workload family)."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from belayer_policy import (
    CheckpointCostModel,
    FixedStepProbability,
    PolicySpec,
    Reason,
    SharedEstimators,
    StepObservation,
    batch_step_hazard,
    critical_share,
)


def monte_carlo_share(mu: float, cv: float, n: int, batches: int = 10000, seed: int = 7) -> float:
    """``(E[max(B + L)] - E[max B]) / E[max L]`` by sampling: B normal (sd cv), L a Poisson(mu)
    number of uniform losses on [0, 1]; common samples for the three maxima."""
    rng = random.Random(seed)

    def poisson() -> int:
        count, total = 0, rng.expovariate(1.0)
        while total < mu:
            count += 1
            total += rng.expovariate(1.0)
        return count

    both, base, loss = [], [], []
    for _ in range(batches):
        b = [rng.gauss(0.0, cv) for _ in range(n)]
        losses = [sum(rng.random() for _ in range(poisson())) for _ in range(n)]
        both.append(max(x + y for x, y in zip(b, losses, strict=True)))
        base.append(max(b))
        loss.append(max(losses))
    return (statistics.fmean(both) - statistics.fmean(base)) / statistics.fmean(loss)


@pytest.mark.parametrize(("mu", "cv", "n"), [(0.056, 0.115, 16), (0.22, 0.35, 16), (2.0, 0.2, 8)])
def test_the_critical_share_matches_a_simulated_batch(mu: float, cv: float, n: int) -> None:
    assert critical_share(mu, cv, n) == pytest.approx(monte_carlo_share(mu, cv, n), abs=0.04)


def test_the_critical_share_is_whole_without_spread_or_batch_and_falls_as_durations_spread() -> None:
    assert critical_share(0.3, 0.0, 16) == 1.0
    assert critical_share(0.3, 0.4, 1) == 1.0
    shares = [critical_share(0.3, cv, 16) for cv in (0.001, 0.05, 0.1, 0.2, 0.4, 0.8)]
    assert shares[0] > 0.97
    assert all(a >= b for a, b in itertools.pairwise(shares))
    assert 0.0 <= shares[-1] < 0.5


def test_the_batch_weight_with_spread_lies_between_the_own_rate_and_the_largest_loss() -> None:
    p, steps, n = 0.004, 14, 16
    rate = -math.log1p(-p)
    unspread = batch_step_hazard(p, steps, n)
    spread = batch_step_hazard(p, steps, n, duration_cv=0.115)
    assert rate < spread < unspread
    assert batch_step_hazard(p, steps, 1, duration_cv=0.115) == pytest.approx(rate)
    assert batch_step_hazard(p, steps, n, duration_cv=0.0) == unspread


def shared_with_unmeasured_costs() -> SharedEstimators:
    return SharedEstimators(
        failure_model=FixedStepProbability(0.2), checkpoint_costs=CheckpointCostModel(initial_s=1.0)
    )


def test_a_batch_takes_one_cost_probe_at_a_time() -> None:
    shared = shared_with_unmeasured_costs()
    first, second = (PolicySpec.parse("adaptive").build(shared) for _ in range(2))
    obs = StepObservation(3, 5.0, 1.0, now=18.0, remaining_steps=10)
    assert first.decide(obs).checkpoint  # the prior (1 s) makes it nearly free: the probe
    held = second.decide(StepObservation(3, 5.0, 1.0, now=18.5, remaining_steps=10))
    assert (held.checkpoint, held.reason) == (False, Reason.COST_PROBE_IN_FLIGHT)
    first.on_checkpoint_ready(2.0)  # measured: the others decide on it
    after = second.decide(StepObservation(4, 5.0, 1.0, now=24.0, remaining_steps=9))
    assert after.reason is not Reason.COST_PROBE_IN_FLIGHT
    assert after.checkpoint_cost_s == 2.0
    assert after.checkpoint  # at this hazard a 2 s checkpoint pays


def test_a_fixed_baseline_is_not_held_back_by_a_probe() -> None:
    shared = shared_with_unmeasured_costs()
    adaptive, always = PolicySpec.parse("adaptive").build(shared), PolicySpec.parse("always").build(shared)
    assert adaptive.decide(StepObservation(3, 5.0, 1.0, now=18.0, remaining_steps=10)).checkpoint
    assert always.decide(StepObservation(1, 5.0, 1.0, now=18.5, remaining_steps=12)).checkpoint


def test_a_future_step_is_the_batchs_mean_response_plus_the_trajectorys_actions() -> None:
    shared = SharedEstimators(failure_model=FixedStepProbability(0.01))
    calm, unlucky = PolicySpec.parse("adaptive").build(shared), PolicySpec.parse("adaptive").build(shared)
    for k in range(1, 5):
        calm.decide(StepObservation(k, 10.0, 2.0, now=12.0 * k, remaining_steps=20 - k))
    # One response from the heavy tail: this trajectory's next steps are not expected to be as long.
    decision = unlucky.decide(StepObservation(1, 90.0, 1.0, now=91.0, remaining_steps=19))
    mean_response = (4 * 10.0 + 90.0) / 5
    assert decision.step_s == pytest.approx(mean_response + 1.0)
    assert calm.decide(StepObservation(5, 10.0, 2.0, now=60.0, remaining_steps=15)).step_s == pytest.approx(
        (5 * 10.0 + 90.0) / 6 + 2.0
    )
