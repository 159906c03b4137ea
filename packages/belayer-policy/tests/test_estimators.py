"""Estimators: q, p_t, response-time window, checkpoint cost, regeneration cost, online hazard."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from belayer_policy import (
    CheckpointCostModel,
    ConstantHazard,
    FixedStepProbability,
    OnlineHazard,
    PolicyStateError,
    RegenerationCost,
    ResponseTimeModel,
)

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
samples = st.lists(st.floats(min_value=0.0, max_value=600.0), min_size=0, max_size=80)


def _model(values: list[float], window: int = 64) -> ResponseTimeModel:
    model = ResponseTimeModel(window=window)
    for v in values:
        model.observe(v)
    return model


@given(samples, seconds, seconds)
def test_q_is_a_probability(values: list[float], x: float, c: float) -> None:
    assert 0.0 <= _model(values).hidden_probability(x, c) <= 1.0


@given(samples, seconds, seconds, seconds)
def test_q_does_not_increase_with_cost(values: list[float], x: float, c1: float, c2: float) -> None:
    model = _model(values)
    low, high = sorted((c1, c2))
    assert model.hidden_probability(x, high) <= model.hidden_probability(x, low)


@given(samples, seconds)
def test_q_of_a_free_checkpoint_is_one(values: list[float], x: float) -> None:
    assert _model(values).hidden_probability(x, 0.0) == 1.0


def test_q_usable_after_one_observation() -> None:
    model = _model([10.0])
    assert model.hidden_probability(0.0, 4.0) == 1.0
    assert model.hidden_probability(0.0, 10.5) == 0.0
    assert model.hidden_probability(6.0, 4.0) == 1.0
    assert model.hidden_probability(6.0, 4.5) == 0.0


def test_q_conditions_on_elapsed_time() -> None:
    model = _model([10.0, 20.0, 30.0, 40.0])
    # P(T >= 25 | T >= 15) = 2/3
    assert model.hidden_probability(15.0, 10.0) == pytest.approx(2 / 3)


def test_q_without_samples_is_pessimistic() -> None:
    assert ResponseTimeModel().hidden_probability(0.0, 0.5) == 0.0


def test_q_beyond_every_sample_uses_exponential_tail() -> None:
    model = _model([10.0, 30.0])
    assert model.hidden_probability(50.0, 5.0) == pytest.approx(math.exp(-5.0 / 20.0))


def test_response_window_bounds_memory_and_follows_drift() -> None:
    model = _model([60.0] * 10, window=4)
    assert model.num_observations == 4
    for _ in range(4):
        model.observe(2.0)
    assert model.num_observations == 4
    assert model.mean == pytest.approx(2.0)
    assert model.hidden_probability(0.0, 5.0) == 0.0


@given(st.floats(min_value=0.0, max_value=1.0), seconds, seconds)
def test_constant_hazard_p_increases_with_duration(rate: float, d1: float, d2: float) -> None:
    hazard = ConstantHazard(rate)
    low, high = sorted((d1, d2))
    assert hazard.failure_probability(low) <= hazard.failure_probability(high)
    assert 0.0 <= hazard.failure_probability(high) <= 1.0


@given(st.floats(min_value=1e-6, max_value=1e-2), st.floats(min_value=0.0, max_value=100.0))
def test_constant_hazard_p_strictly_increases_in_its_range(rate: float, d: float) -> None:
    hazard = ConstantHazard(rate)
    assert hazard.failure_probability(d) < hazard.failure_probability(d + 1.0)


def test_constant_hazard_formula() -> None:
    assert ConstantHazard(0.01).failure_probability(30.0) == pytest.approx(1 - math.exp(-0.3))


def test_fixed_step_probability_ignores_duration() -> None:
    fixed = FixedStepProbability(0.05)
    assert fixed.failure_probability(1.0) == fixed.failure_probability(100.0) == 0.05


def test_online_hazard_learns_rate_from_failures_and_exposure() -> None:
    hazard = OnlineHazard(prior_failures=1.0, prior_exposure_s=100.0)
    assert hazard.rate == pytest.approx(0.01)
    hazard.observe_exposure(900.0)
    for _ in range(9):
        hazard.observe_failure()
    assert hazard.rate == pytest.approx(10 / 1000)
    hazard.observe_exposure(9000.0)
    assert hazard.rate == pytest.approx(10 / 10000)
    assert hazard.failure_probability(10.0) == pytest.approx(1 - math.exp(-0.01))


def test_checkpoint_cost_s_starts_at_prior_then_follows_measurements() -> None:
    model = CheckpointCostModel(initial_s=2.0, smoothing=0.5)
    assert model.estimate == 2.0
    model.observe(1.0)
    assert model.estimate == 1.0
    model.observe(3.0)
    assert model.estimate == pytest.approx(2.0)
    assert model.num_observations == 2


def test_regeneration_s_resets_on_ready_and_rolls_back_on_restore() -> None:
    regen = RegenerationCost()
    regen.add(10.0)
    regen.capture()
    regen.add(5.0)  # work while the checkpoint is in flight stays counted
    assert regen.in_flight
    regen.mark_ready()
    assert regen.cost_s == pytest.approx(5.0)
    regen.add(7.0)
    regen.restore()
    assert regen.cost_s == 0.0
    regen.add(3.0)
    regen.capture()
    regen.abandon()
    assert regen.cost_s == pytest.approx(3.0)
    regen.restore()
    assert regen.cost_s == 0.0


def test_regeneration_restore_without_checkpoint_goes_to_start() -> None:
    regen = RegenerationCost()
    regen.add(12.0)
    regen.restore()
    assert regen.cost_s == 0.0


def test_ready_without_capture_is_a_state_error() -> None:
    with pytest.raises(PolicyStateError, match="on_checkpoint_ready"):
        RegenerationCost().mark_ready()
