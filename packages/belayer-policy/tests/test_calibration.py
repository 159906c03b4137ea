"""Cost estimates calibrated against the clock: a measured cost off by a constant factor converges to
what the checkpoints cost the trajectory, and an exact one stays put."""

from __future__ import annotations

import math

import pytest

from belayer_policy import (
    AdaptiveRule,
    CheckpointCostModel,
    CheckpointPolicy,
    ClockProbe,
    CostCalibration,
    FixedStepProbability,
    ResponseTimeModel,
    StepObservation,
)


def test_a_constant_ratio_converges_after_shrinkage() -> None:
    calibration = CostCalibration(prior_weight=2.0)
    assert calibration.factor(None) == 1.0
    calibration.observe("full", 2.0)
    # One measurement: its noise is the prior's (two pseudo-observations of it, 2/3 of the
    # prior's variance over three), so it moves 1 / (1 + 2/3) = 60 % of the way in logs.
    assert calibration.factor("full") == pytest.approx(2.0**0.6)
    for _ in range(40):
        calibration.observe("full", 2.0)
    # No spread: the noise estimate falls with every measurement (0.6.0 stayed 4 % low here).
    assert calibration.factor(None) == pytest.approx(2.0, rel=0.015)
    assert calibration.factor("fresh-runtime") == 1.0  # each kind its own


def test_noisy_ratios_are_shrunk_more_than_consistent_ones() -> None:
    consistent, noisy = CostCalibration(), CostCalibration()
    for _ in range(5):
        consistent.observe(None, 2.0)
    for ratio in (1.0, 4.0, 1.0, 4.0, 2.0):  # the same geometric mean, 2
        noisy.observe(None, ratio)
    assert 1.9 < consistent.factor(None) < 2.0
    assert 1.0 < noisy.factor(None) < consistent.factor(None) - 0.08
    unsure = CostCalibration(prior_log_sd=0.0)  # no room for an error: the factor stays 1
    unsure.observe(None, 2.0)
    assert unsure.factor(None) == 1.0


def test_a_hidden_checkpoint_only_pulls_the_factor_down_to_its_bound() -> None:
    calibration = CostCalibration()
    for _ in range(20):
        calibration.observe(None, 2.0)
    high = calibration.factor(None)
    calibration.observe_bound(None, 5.0)  # hidden, and cost at most 5x: says nothing new
    assert calibration.factor(None) == pytest.approx(high)
    for _ in range(60):
        calibration.observe_bound(None, 0.5)
    assert 0.5 < calibration.factor(None) < 0.7


def run_visible_checkpoints(
    measured_factor: float,
    *,
    true_cost: float = 4.0,
    overhead: float = 0.0,
    elapsed: float = 0.0,
    steps: int = 100,
) -> tuple[CheckpointPolicy, list[float]]:
    """A trajectory of 1 s responses and 1 s actions whose every checkpoint (``true_cost`` seconds,
    mostly visible: the action waits for it) is reported as ``measured_factor`` times its cost; the
    clock also runs ``overhead`` seconds per step, and every other decision comes ``elapsed`` seconds
    into the next response (a checkpoint then starts there).  Returns the policy and the cost weighed
    at each decision."""
    policy = CheckpointPolicy(
        rule=AdaptiveRule(),
        failure_model=FixedStepProbability(0.2),  # checkpoints pay: it takes one whenever it can
        checkpoint_costs=CheckpointCostModel(initial_s=1.0),
        response_times=ResponseTimeModel(),
    )
    now, weighed, wait, x = 0.0, [], 0.0, 0.0
    for k in range(1, steps + 1):
        # the rest of the response, the wait, the action, then the next response up to the decision
        now += (1.0 - x) + wait + 1.0 + overhead
        x = elapsed if k % 2 else 0.0
        now += x
        obs = StepObservation(k, 1.0, 1.0, now, response_elapsed_s=x, remaining_steps=steps + 5 - k)
        decision = policy.decide(obs)
        weighed.append(decision.checkpoint_cost_s)
        wait = 0.0
        if decision.checkpoint:
            policy.on_checkpoint_ready(true_cost * measured_factor)
            wait = max(0.0, true_cost - (1.0 - x))
    return policy, weighed


@pytest.mark.parametrize("elapsed", [0.0, 0.4])
@pytest.mark.parametrize("measured_factor", [0.5, 1.5])
def test_a_biased_measurement_converges_to_the_clocks_cost(measured_factor: float, elapsed: float) -> None:
    policy, weighed = run_visible_checkpoints(measured_factor, elapsed=elapsed)
    assert policy.checkpoint_costs.estimate == pytest.approx(4.0 * measured_factor)
    assert abs(math.log(weighed[1] / 4.0)) > 0.3  # at first the biased measurement
    assert weighed[-1] == pytest.approx(4.0, rel=0.1)  # then the cost on the clock


@pytest.mark.parametrize(("overhead", "elapsed"), [(0.0, 0.0), (0.7, 0.0), (0.3, 0.6)])
def test_an_exact_measurement_stays_exact(overhead: float, elapsed: float) -> None:
    policy, weighed = run_visible_checkpoints(1.0, overhead=overhead, elapsed=elapsed)
    assert policy.cost_calibration.num_observations(None) > 5
    assert weighed[-1] == pytest.approx(4.0, rel=0.02)


def test_a_clock_that_does_not_run_calibrates_nothing() -> None:
    policy = CheckpointPolicy(rule=AdaptiveRule(), failure_model=FixedStepProbability(0.2))
    for k in range(1, 20):
        if policy.decide(StepObservation(k, 1.0, 1.0, 5.0, remaining_steps=30)).checkpoint:
            policy.on_checkpoint_ready(0.5)
    assert policy.cost_calibration.num_observations(None) == 0
    assert policy.cost_calibration.factor(None) == 1.0


def test_a_failure_between_checkpoint_and_next_step_is_no_measurement() -> None:
    policy = CheckpointPolicy(rule=AdaptiveRule(), failure_model=FixedStepProbability(0.2))
    assert policy.decide(StepObservation(1, 1.0, 1.0, 2.0, remaining_steps=30)).checkpoint
    policy.on_checkpoint_ready(0.5)
    assert policy.decide(StepObservation(2, 1.0, 1.0, 4.0, remaining_steps=29)).checkpoint
    policy.on_failure(5.0, exposure_s=0.5)
    policy.on_restore(2.0)
    # 30 s on the clock since the last decision: the failure and the restore, not the checkpoint.
    policy.decide(StepObservation(3, 1.0, 1.0, 34.0, remaining_steps=28))
    assert policy.cost_calibration.num_observations(None) == 0


def test_the_clock_measures_from_where_the_checkpoint_started_in_the_response() -> None:
    calibration = CostCalibration(prior_weight=0.0)
    probe = ClockProbe(calibration)
    first = StepObservation(1, 1.0, 1.0, 10.0, response_elapsed_s=0.5)
    probe.step(first)
    probe.started(first, None, 2.0)  # weighed at 2 s, started 0.5 s into a 3 s response
    # The response ends 2.5 s later, the action waits 1.5 s (a 4 s checkpoint) and runs 1 s; the
    # next decision comes 0.8 s into the following response.
    probe.step(StepObservation(2, 3.0, 1.0, 10.0 + 2.5 + 1.5 + 1.0 + 0.8, response_elapsed_s=0.8))
    assert calibration.factor(None) == pytest.approx(2.0)
    # A reference checkpoint weighed at 2 s and hidden by the next 3 s response (no wait): it took
    # at most 1.5x its estimate, above the factor (1): nothing learned.  Weighed at 6 s, at most
    # 0.5x: learned.
    probe.started(StepObservation(2, 3.0, 1.0, 15.8, response_elapsed_s=0.8), "reference", 2.0)
    probe.step(StepObservation(3, 3.0, 1.0, 15.8 + 2.2 + 1.0))
    assert calibration.num_observations("reference") == 0
    probe.started(StepObservation(3, 3.0, 1.0, 19.0), "reference", 6.0)
    probe.step(StepObservation(4, 3.0, 1.0, 23.0))
    assert calibration.factor("reference") == pytest.approx(0.5)
