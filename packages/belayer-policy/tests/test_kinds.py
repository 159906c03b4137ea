"""Per-kind checkpoint costs: a cheap kind is weighed at its own cost and learns only from its own."""

from __future__ import annotations

import pytest

from belayer_policy import (
    CHECKPOINT_KINDS,
    AdaptiveRule,
    CheckpointCostModel,
    CheckpointPolicy,
    FixedStepProbability,
    PolicyArgumentError,
    PolicySpec,
    ResponseTimeModel,
    SharedEstimators,
    StepObservation,
)


def costly_full_policy() -> CheckpointPolicy:
    """A full checkpoint (30 s) costs far more than the 1 s responses hide or failures lose."""
    return CheckpointPolicy(
        rule=AdaptiveRule(),
        failure_model=FixedStepProbability(0.01),
        checkpoint_costs=CheckpointCostModel(initial_s=30.0),
        response_times=ResponseTimeModel(),
    )


def run(policy: CheckpointPolicy, kind: str | None, steps: int = 6) -> list[bool]:
    taken = []
    for k in range(1, steps + 1):
        obs = StepObservation(k, 1.0, 1.0, 2.0 * k, remaining_steps=10, checkpoint_kind=kind)
        decision = policy.decide(obs)
        assert decision.checkpoint_kind == (kind or "full")
        taken.append(decision.checkpoint)
        if decision.checkpoint:
            cheap = policy.kind_costs.model(kind)
            policy.on_checkpoint_ready(30.0 if cheap is None else cheap.estimate)
    return taken


def test_the_kinds_are_envckpts():
    assert CHECKPOINT_KINDS == ("full", "fresh-runtime", "reference")


@pytest.mark.parametrize("kind", ["fresh-runtime", "reference"])
def test_a_cheap_kind_is_weighed_at_its_own_cost(kind: str) -> None:
    assert not any(run(costly_full_policy(), None))
    assert not any(run(costly_full_policy(), "full"))
    assert any(run(costly_full_policy(), kind))
    policy = costly_full_policy()
    decision = policy.decide(StepObservation(1, 1.0, 1.0, 2.0, remaining_steps=10, checkpoint_kind=kind))
    model = policy.kind_costs.model(kind)
    assert model is not None
    assert decision.checkpoint_cost_s == model.estimate < 0.1
    assert decision.to_dict()["checkpoint_kind"] == kind


def test_each_kind_learns_only_from_its_own_checkpoints() -> None:
    policy = CheckpointPolicy(failure_model=FixedStepProbability(0.5))
    assert policy.decide(StepObservation(1, 5.0, 1.0, 6.0, checkpoint_kind="fresh-runtime")).checkpoint
    policy.on_checkpoint_ready(0.02)  # the decision's kind
    assert policy.kind_costs.fresh_runtime.estimate == 0.02
    assert policy.kind_costs.fresh_runtime.num_observations == 1
    assert policy.checkpoint_costs.num_observations == 0
    assert policy.decide(StepObservation(2, 5.0, 1.0, 12.0, checkpoint_kind="fresh-runtime")).checkpoint
    policy.on_checkpoint_ready(1.5, kind="full")  # envckpt took a full one after all
    assert policy.checkpoint_costs.estimate == 1.5
    assert policy.kind_costs.fresh_runtime.num_observations == 1
    assert policy.decide(StepObservation(3, 5.0, 1.0, 18.0, checkpoint_kind="reference")).checkpoint
    policy.on_checkpoint_timeout(20.0, elapsed_s=0.5)
    assert policy.kind_costs.reference.estimate == 0.5
    assert policy.checkpoint_costs.num_observations == 1


def test_a_cheap_checkpoint_is_no_probe_of_the_full_cost() -> None:
    policy = CheckpointPolicy(failure_model=FixedStepProbability(0.5))
    assert policy.decide(StepObservation(1, 5.0, 1.0, 6.0, checkpoint_kind="reference")).checkpoint
    assert policy.checkpoint_costs.probe_started_at is None
    policy.on_checkpoint_ready(0.003)
    later = policy.decide(StepObservation(2, 5.0, 1.0, 600.0))
    assert later.checkpoint_cost_s == 1.0  # the full prior, not the 594 s since the reference began


def test_the_batch_shares_the_kind_costs() -> None:
    shared = SharedEstimators(batch_size=2)
    spec = PolicySpec.parse("adaptive")
    first, second = spec.build(shared, task="a"), spec.build(shared, task="b")
    first.kind_costs.reference.observe(0.004)
    assert second.kind_costs.reference.estimate == 0.004


def test_an_unknown_kind_is_refused_with_the_known_ones_named() -> None:
    with pytest.raises(PolicyArgumentError, match="fresh-runtime"):
        StepObservation(1, 1.0, 1.0, 2.0, checkpoint_kind="delta")
    policy = CheckpointPolicy(failure_model=FixedStepProbability(0.5))
    assert policy.decide(StepObservation(1, 5.0, 1.0, 6.0)).checkpoint
    with pytest.raises(PolicyArgumentError, match="checkpoint_kind"):
        policy.on_checkpoint_ready(0.1, kind="incremental")
