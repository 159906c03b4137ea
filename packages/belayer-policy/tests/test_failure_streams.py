"""Failure streams: per-step common random numbers keep every policy's failures aligned."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from belayer_policy import (
    PER_ATTEMPT,
    PER_STEP,
    PolicyArgumentError,
    PolicySpec,
    SimulationConfig,
    Trajectory,
    simulate_trajectory,
)

POLICIES = ("never", "always", "every:3")


def first_attempt_failures(
    name: str, trajectory: Trajectory, config: SimulationConfig, seed: int
) -> set[int]:
    """Steps whose first attempt failed: a step is first attempted when the trajectory gets past
    every step it failed at before, so those are the failures that set a new furthest step."""
    policy = PolicySpec.parse(name).build()
    simulate_trajectory(trajectory, policy, config, random.Random(seed))
    recorded = policy.recorded_trajectory()
    assert recorded is not None
    firsts, furthest = set(), -1
    for failure in recorded.failures:
        if failure.step > furthest:
            firsts.add(failure.step)
            furthest = failure.step
    return firsts


def trajectory(steps: int) -> Trajectory:
    return Trajectory([1.0] * steps, [0.5] * steps, [0.3] * steps)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), steps=st.integers(2, 12), p=st.floats(0.05, 0.3))
def test_per_step_streams_fail_the_first_attempt_of_a_step_alike_under_every_policy(
    seed: int, steps: int, p: float
) -> None:
    config = SimulationConfig(fail_prob=p, failure_streams=PER_STEP)
    firsts = {frozenset(first_attempt_failures(name, trajectory(steps), config, seed)) for name in POLICIES}
    assert len(firsts) == 1


def test_per_attempt_streams_drift_apart_after_a_restore() -> None:
    # The default stream is drawn in attempt order: a restart from the start (never) and one from
    # the latest checkpoint (always) consume it differently, so their later first attempts differ.
    config = SimulationConfig(fail_prob=0.3)
    assert config.failure_streams == PER_ATTEMPT
    differ = [
        seed
        for seed in range(40)
        if first_attempt_failures("never", trajectory(12), config, seed)
        != first_attempt_failures("always", trajectory(12), config, seed)
    ]
    assert differ


def test_per_step_streams_keep_the_failure_rate() -> None:
    # Each attempt still fails with fail_prob: over many first attempts the share is p.
    config = SimulationConfig(fail_prob=0.2, failure_streams=PER_STEP)
    failed = sum(len(first_attempt_failures("always", trajectory(20), config, seed)) for seed in range(300))
    assert failed / (300 * 20) == pytest.approx(0.2, abs=0.02)


def test_an_unknown_stream_kind_is_refused() -> None:
    with pytest.raises(PolicyArgumentError, match="per-step"):
        SimulationConfig(failure_streams="per-run")
