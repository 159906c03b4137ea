"""Policy names as the CLI and the simulator take them, and building one policy per trajectory."""

from __future__ import annotations

import attrs

from belayer_policy._errors import PolicyArgumentError
from belayer_policy._estimators import CheckpointCostModel, ResponseTimeModel
from belayer_policy._hazard import FailureModel, OnlineHazard
from belayer_policy._policy import (
    AdaptiveRule,
    AlwaysRule,
    CheckpointPolicy,
    DecisionRule,
    EveryKRule,
    NeverRule,
)
from belayer_policy._validate import non_negative, renamed_keywords

__all__ = ["PolicySpec", "SharedEstimators"]


@attrs.frozen
class SharedEstimators:
    """Estimators shared by the policies of every trajectory in one batch, so they learn together."""

    failure_model: FailureModel = attrs.field(factory=OnlineHazard)
    response_times: ResponseTimeModel = attrs.field(factory=ResponseTimeModel)
    checkpoint_costs: CheckpointCostModel = attrs.field(factory=CheckpointCostModel)


@attrs.frozen
class PolicySpec:
    """A named policy: ``adaptive``, ``always``, ``never`` or ``every:K``, plus its settings."""

    rule: DecisionRule
    extra_cost_s: float = attrs.field(default=0.0, validator=non_negative)
    cooldown_s: float = attrs.field(default=20.0, validator=non_negative)

    @classmethod
    def parse(
        cls, text: str, *, extra_cost_s: float = 0.0, cooldown_s: float = 20.0, **deprecated: float
    ) -> PolicySpec:
        """Parse ``adaptive``, ``always``, ``never`` or ``every:K`` (K an integer >= 1).

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
            raise PolicyArgumentError(f"policy must be adaptive, always, never or every:K, got {text!r}")
        return cls(rule, extra_cost_s=extra_cost_s, cooldown_s=cooldown_s)

    @property
    def name(self) -> str:
        """The rule's name."""
        return self.rule.name

    def build(self, estimators: SharedEstimators | None = None) -> CheckpointPolicy:
        """A fresh policy for one trajectory, using ``estimators`` (fresh ones when omitted)."""
        shared = SharedEstimators() if estimators is None else estimators
        return CheckpointPolicy(
            rule=self.rule,
            failure_model=shared.failure_model,
            response_times=shared.response_times,
            checkpoint_costs=shared.checkpoint_costs,
            extra_cost_s=self.extra_cost_s,
            cooldown_s=self.cooldown_s,
        )
