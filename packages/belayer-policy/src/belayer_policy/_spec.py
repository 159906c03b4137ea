"""Policy names as the CLI and the simulator take them, and building one policy per trajectory."""

from __future__ import annotations

import attrs

from belayer_policy._calibration import CostCalibration
from belayer_policy._errors import PolicyArgumentError
from belayer_policy._estimators import (
    CheckpointCostModel,
    ResponseTimeModel,
    RestoreCostModel,
    TrajectoryLengthModel,
)
from belayer_policy._hazard import FailureModel, OnlineHazard
from belayer_policy._kinds import KindCosts
from belayer_policy._policy import CheckpointPolicy
from belayer_policy._pooled import CostModel, HazardView, KeyTable, PooledCost
from belayer_policy._rules import (
    AdaptiveRule,
    AlwaysRule,
    DecisionRule,
    EveryKRule,
    NeverRule,
    PaperRule,
)
from belayer_policy._validate import non_negative, positive_int, renamed_keywords

__all__ = ["PolicySpec", "SharedEstimators"]


@attrs.frozen
class SharedEstimators:
    """Estimators shared by the policies of every trajectory in one batch, so they learn together.

    ``batch_size`` is how many trajectories roll out together (the slowest ends the batch).
    Per-task and per-node factors (``KeyTable``) apply to policies built with ``task`` / ``node``.
    """

    failure_model: FailureModel = attrs.field(factory=OnlineHazard)
    response_times: ResponseTimeModel = attrs.field(factory=ResponseTimeModel)
    checkpoint_costs: CheckpointCostModel = attrs.field(factory=CheckpointCostModel)
    restore_costs: RestoreCostModel = attrs.field(factory=RestoreCostModel)
    trajectory_lengths: TrajectoryLengthModel = attrs.field(factory=TrajectoryLengthModel)
    batch_size: int = attrs.field(default=1, validator=positive_int)
    hazard_by_label: KeyTable = attrs.field(factory=KeyTable)
    cost_by_label: KeyTable = attrs.field(factory=KeyTable)
    kind_costs: KindCosts = attrs.field(factory=KindCosts)
    cost_calibration: CostCalibration = attrs.field(factory=CostCalibration)


def _labels(task: str | None, node: str | None) -> tuple[str, ...]:
    return tuple(f"{kind}:{value}" for kind, value in (("task", task), ("node", node)) if value is not None)


@attrs.frozen
class PolicySpec:
    """A named policy: ``adaptive``, ``paper``, ``always``, ``never`` or ``every:K``, plus settings."""

    rule: DecisionRule
    extra_cost_s: float = attrs.field(default=0.0, validator=non_negative)
    cooldown_s: float = attrs.field(default=20.0, validator=non_negative)

    @classmethod
    def parse(
        cls, text: str, *, extra_cost_s: float = 0.0, cooldown_s: float = 20.0, **deprecated: float
    ) -> PolicySpec:
        """Parse ``adaptive``, ``paper``, ``always``, ``never`` or ``every:K`` (K an integer >= 1).

        The old keywords ``extra_cost=`` and ``cooldown_seconds=`` still work, with a
        ``DeprecationWarning``.
        """
        renamed = renamed_keywords(
            "PolicySpec.parse", deprecated, {"extra_cost": "extra_cost_s", "cooldown_seconds": "cooldown_s"}
        )
        extra_cost_s = renamed.get("extra_cost_s", extra_cost_s)
        cooldown_s = renamed.get("cooldown_s", cooldown_s)
        name = text.strip().lower()
        rule: DecisionRule
        if name == "adaptive":
            rule = AdaptiveRule()
        elif name == "paper":
            rule = PaperRule()
        elif name == "always":
            rule = AlwaysRule()
        elif name == "never":
            rule = NeverRule()
        elif name.startswith("every:"):
            try:
                k = int(name.removeprefix("every:"))
            except ValueError:
                raise PolicyArgumentError(f"policy {text!r}: K in every:K must be an integer >= 1") from None
            if k < 1:
                raise PolicyArgumentError(f"policy {text!r}: K in every:K must be an integer >= 1")
            rule = EveryKRule(k)
        else:
            raise PolicyArgumentError(
                f"policy must be adaptive, paper, always, never or every:K, got {text!r}"
            )
        return cls(rule, extra_cost_s=extra_cost_s, cooldown_s=cooldown_s)

    @property
    def name(self) -> str:
        """The rule's name."""
        return self.rule.name

    def build(
        self, estimators: SharedEstimators | None = None, *, task: str | None = None, node: str | None = None
    ) -> CheckpointPolicy:
        """A fresh policy for one trajectory, using ``estimators`` (fresh ones when omitted).

        With ``task`` and/or ``node`` the failure hazard and the checkpoint cost also learn a factor
        for that task and that node, pooled with the shared estimate.
        """
        shared = SharedEstimators() if estimators is None else estimators
        labels = _labels(task, node)
        failure_model: FailureModel = shared.failure_model
        checkpoint_costs: CostModel = shared.checkpoint_costs
        if labels:
            failure_model = HazardView(shared.failure_model, shared.hazard_by_label, labels)
            checkpoint_costs = PooledCost(shared.checkpoint_costs, shared.cost_by_label, labels)
        return CheckpointPolicy(
            rule=self.rule,
            failure_model=failure_model,
            response_times=shared.response_times,
            checkpoint_costs=checkpoint_costs,
            extra_cost_s=self.extra_cost_s,
            cooldown_s=self.cooldown_s,
            restore_costs=shared.restore_costs,
            trajectory_lengths=shared.trajectory_lengths,
            batch_size=shared.batch_size,
            kind_costs=shared.kind_costs,
            cost_calibration=shared.cost_calibration,
        )
