"""The decision rule, its guards, the baselines and the record it returns."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from belayer_policy import (
    CheckpointCostModel,
    CheckpointPolicy,
    ConstantHazard,
    EveryKRule,
    FixedStepProbability,
    PaperRule,
    PolicySpec,
    PolicyStateError,
    Reason,
    ResponseTimeModel,
    SharedEstimators,
    StepObservation,
)

# Durations in seconds; subnormal ones (below 2e-308 s) would only test float underflow of p * C.
steps = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=120.0, allow_subnormal=False),
        st.floats(min_value=0.0, max_value=30.0, allow_subnormal=False),
    ),
    min_size=1,
    max_size=30,
)


def _observe(policy: CheckpointPolicy, pairs: list[tuple[float, float]]) -> list[bool]:
    taken = []
    now = 0.0
    for k, (response, action) in enumerate(pairs, start=1):
        now += response + action
        decision = policy.decide(StepObservation(k, response, action, now))
        taken.append(decision.checkpoint)
        if decision.checkpoint:
            policy.on_checkpoint_ready(policy.checkpoint_costs.estimate)
    return taken


@pytest.mark.parametrize("rule", ["adaptive", "paper"])
@given(pairs=steps, cost=st.floats(min_value=0.0, max_value=10.0))
def test_never_checkpoints_when_failure_is_impossible(
    rule: str, pairs: list[tuple[float, float]], cost: float
) -> None:
    policy = CheckpointPolicy(
        rule=PolicySpec.parse(rule).rule,
        failure_model=FixedStepProbability(0.0),
        checkpoint_costs=CheckpointCostModel(initial_s=cost),
    )
    assert not any(_observe(policy, pairs))


@pytest.mark.parametrize("rule", ["adaptive", "paper"])
@given(pairs=steps, p=st.floats(min_value=1e-6, max_value=1.0))
def test_always_checkpoints_when_free_and_there_is_work(
    rule: str, pairs: list[tuple[float, float]], p: float
) -> None:
    policy = CheckpointPolicy(
        rule=PolicySpec.parse(rule).rule,
        failure_model=FixedStepProbability(p),
        checkpoint_costs=CheckpointCostModel(initial_s=0.0),
    )
    now = 0.0
    for k, (response, action) in enumerate(pairs, start=1):
        now += response + action
        decision = policy.decide(StepObservation(k, response, action, now))
        assert decision.checkpoint == (decision.regeneration_s > 0)
        if decision.checkpoint:
            policy.on_checkpoint_ready(0.0)


def test_decision_record_holds_the_comparison() -> None:
    responses = ResponseTimeModel()
    for t in (10.0, 20.0, 30.0, 40.0):
        responses.observe(t)
    policy = CheckpointPolicy(
        rule=PaperRule(),
        failure_model=ConstantHazard(0.001),
        response_times=responses,
        checkpoint_costs=CheckpointCostModel(initial_s=15.0),
        extra_cost_s=0.1,
    )
    decision = policy.decide(StepObservation(1, 20.0, 5.0, now=25.0, response_elapsed_s=20.0))
    p = decision.failure_probability
    assert decision.regeneration_s == 25.0
    assert decision.benefit_s == pytest.approx(p * 25.0)
    # q(20; 15) = P(T >= 35 | T >= 20) = 1/4 with the window {10, 20, 20, 30, 40} -> 1/4
    assert decision.hidden_probability == pytest.approx(1 / 4)
    assert decision.visible_cost_s == pytest.approx(15.0 * 0.75 + 0.1)
    assert not decision.checkpoint
    assert decision.reason is Reason.COST_EXCEEDS_BENEFIT
    record = json.loads(json.dumps(decision.to_dict()))
    assert record["reason"] == "cost_exceeds_benefit"
    assert record["policy"] == "paper"


def test_paper_rule_checkpoints_once_regeneration_outweighs_visible_cost() -> None:
    policy = CheckpointPolicy(
        rule=PaperRule(),
        failure_model=FixedStepProbability(0.1),
        checkpoint_costs=CheckpointCostModel(initial_s=50.0),  # longer than any response: visible
    )
    taken = _observe(policy, [(10.0, 0.0)] * 10)
    # visible cost 50 s; benefit 0.1 * C_t exceeds it once C_t > 500 s: never within 100 s of work
    assert not any(taken)
    taken = _observe(policy, [(10.0, 0.0)] * 60)
    assert taken.index(True) == 40  # C_t = 10 + 500 = 510 > 500 at the 41st step of this call


def test_timeout_starts_cooldown() -> None:
    policy = CheckpointPolicy(
        failure_model=FixedStepProbability(0.5), checkpoint_costs=CheckpointCostModel(initial_s=0.0)
    )
    assert policy.decide(StepObservation(1, 5.0, 1.0, now=6.0)).checkpoint
    policy.on_checkpoint_timeout(now=10.0, elapsed_s=4.0)
    assert policy.checkpoint_costs.estimate == 4.0
    decision = policy.decide(StepObservation(2, 5.0, 1.0, now=29.9))
    assert (decision.checkpoint, decision.reason) == (False, Reason.COOLDOWN)
    assert policy.regeneration_s == 12.0  # the timed-out checkpoint never became the restore point
    assert policy.decide(StepObservation(3, 5.0, 1.0, now=30.0)).checkpoint


def test_no_second_checkpoint_while_one_is_in_flight() -> None:
    policy = CheckpointPolicy(rule=PolicySpec.parse("always").rule)
    assert policy.decide(StepObservation(1, 5.0, 1.0, now=6.0)).checkpoint
    decision = policy.decide(StepObservation(2, 5.0, 1.0, now=12.0))
    assert (decision.checkpoint, decision.reason) == (False, Reason.CHECKPOINT_IN_FLIGHT)
    policy.on_checkpoint_ready(0.4)
    assert policy.regeneration_s == 6.0


def test_failure_loses_the_checkpoint_in_flight_and_restore_rolls_back() -> None:
    policy = CheckpointPolicy(rule=PolicySpec.parse("always").rule, failure_model=ConstantHazard(0.0))
    policy.decide(StepObservation(1, 5.0, 1.0, now=6.0))
    policy.on_checkpoint_ready(0.5)
    policy.decide(StepObservation(2, 5.0, 1.0, now=12.0))
    policy.on_failure(now=13.0, exposure_s=1.0)
    assert not policy.checkpoint_in_flight
    with pytest.raises(PolicyStateError):
        policy.on_checkpoint_ready(0.5)
    policy.on_restore()
    assert policy.regeneration_s == 0.0


def test_online_hazard_sees_failures_through_the_policy() -> None:
    shared = SharedEstimators()
    policy = PolicySpec.parse("adaptive").build(shared)
    before = shared.failure_model.failure_probability(30.0)
    policy.on_failure(now=1.0, exposure_s=0.0)
    assert shared.failure_model.failure_probability(30.0) > before


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("never", [False] * 6),
        ("always", [True] * 6),
        ("every:3", [False, False, True, False, False, True]),
    ],
)
def test_baselines(name: str, expected: list[bool]) -> None:
    policy = PolicySpec.parse(name).build()
    assert _observe(policy, [(10.0, 1.0)] * 6) == expected
    assert policy.name == name


def test_every_k_counts_the_prefix_after_a_restore() -> None:
    policy = CheckpointPolicy(rule=EveryKRule(2))
    assert not policy.decide(StepObservation(1, 1.0, 1.0, now=2.0)).checkpoint
    policy.on_failure(now=3.0)
    policy.on_restore()
    assert not policy.decide(StepObservation(1, 1.0, 1.0, now=5.0)).checkpoint
    assert policy.decide(StepObservation(2, 1.0, 1.0, now=7.0)).checkpoint


def test_shared_estimators_pool_learning_across_trajectories() -> None:
    shared = SharedEstimators()
    a, b = (PolicySpec.parse("adaptive").build(shared) for _ in range(2))
    a.decide(StepObservation(1, 30.0, 1.0, now=31.0))
    b.decide(StepObservation(1, 50.0, 1.0, now=51.0))
    assert shared.response_times.num_observations == 2
    assert a.regeneration_s == 31.0
    assert b.regeneration_s == 51.0


def test_renamed_keywords_still_work_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="cooldown_seconds= is deprecated, use cooldown_s="):
        assert PolicySpec.parse("never", cooldown_seconds=5.0).cooldown_s == 5.0
    with pytest.warns(DeprecationWarning, match="extra_cost= is deprecated, use extra_cost_s="):
        spec = PolicySpec.parse("never", extra_cost=1.0)
    assert spec.extra_cost_s == 1.0
    policy = spec.build()
    with pytest.warns(DeprecationWarning, match="exposure_seconds"):
        policy.on_failure(1.0, exposure_seconds=3.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'cooldown'"):
        PolicySpec.parse("never", cooldown=5.0)
