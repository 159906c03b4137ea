"""One cost probe of a full checkpoint whose cost was never measured (issue 34: a prior that says
"too dear" is otherwise never tested, workload 168 of the family)."""

from __future__ import annotations

import math

import pytest

from belayer_policy import (
    CheckpointCostModel,
    FixedStepProbability,
    KindCosts,
    PolicySpec,
    Reason,
    SharedEstimators,
    StepObservation,
)

# One trajectory, steps of a 0.5 s response and no action, 20 steps to come: a checkpoint on the
# 1 s prior is half visible (0.5 s), and the rule alone would rather wait.
FIRST = StepObservation(1, 0.5, 0.0, now=0.5, remaining_steps=20)


def shared(fail_prob: float, kind_costs: KindCosts | None = None) -> SharedEstimators:
    return SharedEstimators(
        batch_size=1,
        failure_model=FixedStepProbability(fail_prob),
        checkpoint_costs=CheckpointCostModel(initial_s=1.0),
        kind_costs=KindCosts() if kind_costs is None else kind_costs,
    )


def stake(fail_prob: float, unprotected_steps: float, remaining: int, step_s: float) -> float:
    """What the rest of the trajectory loses with no checkpoint, under restarts with the 2 s restore
    prior: ``(d / r + R) e^(r u) (e^(r m) - 1) - m d``; to first order ``a * (m * u + m**2 / 2)``
    plus ``r * m * R``."""
    r, restore = -math.log1p(-fail_prob), 2.0
    return (step_s / r + restore) * math.exp(r * unprotected_steps) * math.expm1(
        r * remaining
    ) - remaining * step_s


def test_a_never_measured_cost_is_probed_when_the_stake_exceeds_the_probes_visible_cost() -> None:
    policy = PolicySpec.parse("adaptive").build(shared(0.01))
    decision = policy.decide(FIRST)
    assert (decision.checkpoint, decision.reason) == (True, Reason.COST_PROBE)
    assert decision.benefit_s == pytest.approx(stake(0.01, 1.0, 20, 0.5))
    assert decision.visible_cost_s == pytest.approx(0.5)
    policy.on_checkpoint_ready(0.05)
    # Measured: the rule decides on the measurement, and no second probe is taken.
    after = policy.decide(StepObservation(2, 0.5, 0.0, now=1.05, remaining_steps=19))
    assert after.checkpoint_cost_s == pytest.approx(0.05)
    assert after.reason in (Reason.BENEFIT_EXCEEDS_COST, Reason.COST_EXCEEDS_BENEFIT)


def test_no_probe_where_the_stake_is_below_the_probes_visible_cost() -> None:
    policy = PolicySpec.parse("adaptive").build(shared(0.001))
    decision = policy.decide(FIRST)
    assert (decision.checkpoint, decision.reason) == (False, Reason.COST_EXCEEDS_BENEFIT)
    assert decision.benefit_s == pytest.approx(stake(0.001, 1.0, 20, 0.5))


def test_a_measured_cost_is_never_probed_again() -> None:
    estimators = shared(0.01)
    estimators.checkpoint_costs.observe(1.0)  # measured once, at the prior's value
    decision = PolicySpec.parse("adaptive").build(estimators).decide(FIRST)
    assert (decision.checkpoint, decision.reason) == (False, Reason.COST_EXCEEDS_BENEFIT)


def test_one_probe_at_a_time_and_none_for_the_paper_rule() -> None:
    estimators = shared(0.01)
    first, second = (PolicySpec.parse("adaptive").build(estimators) for _ in range(2))
    assert first.decide(FIRST).reason is Reason.COST_PROBE
    held = second.decide(FIRST)
    assert (held.checkpoint, held.reason) == (False, Reason.COST_EXCEEDS_BENEFIT)
    first.on_failure(1.0)  # the probe is lost: the cost is still unmeasured, the next may probe
    assert (
        second.decide(StepObservation(2, 0.5, 0.0, now=1.5, remaining_steps=19)).reason is Reason.COST_PROBE
    )
    paper = PolicySpec.parse("paper").build(shared(0.01)).decide(FIRST)
    assert paper.reason is not Reason.COST_PROBE


def test_a_cheap_kinds_prior_is_not_probed() -> None:
    # fresh-runtime's prior comes from envckpt's measurements; made dear here, it is not probed.
    kinds = KindCosts(fresh_runtime=CheckpointCostModel(initial_s=1.0))
    policy = PolicySpec.parse("adaptive").build(shared(0.01, kind_costs=kinds))
    decision = policy.decide(
        StepObservation(1, 0.5, 0.0, now=0.5, remaining_steps=20, checkpoint_kind="fresh-runtime")
    )
    assert (decision.checkpoint, decision.reason) == (False, Reason.COST_EXCEEDS_BENEFIT)
