"""What the agent loop reports after a step, and the loggable record of each decision."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from belayer_policy._kinds import check_kind
from belayer_policy._validate import non_negative, positive_int

__all__ = ["Decision", "Reason", "StepObservation"]


def _optional_non_negative(instance: object, attribute: Any, value: Any) -> None:
    if value is not None:
        non_negative(instance, attribute, value)


def _kind(_instance: object, _attribute: Any, value: str | None) -> None:
    check_kind(value)


@attrs.frozen
class StepObservation:
    """One environment step that just committed, as the agent loop saw it.

    ``step_index`` is the prefix length ``k`` after the step (1 after the first action).
    ``response_s`` and ``action_s`` are the step's LLM response and environment action
    times; ``now`` is the trainer's monotonic clock in seconds.  ``response_elapsed_s`` is ``x``, how far
    the next LLM response already is when a checkpoint would start (0 when it starts now).
    ``next_step_s`` overrides the policy's estimate of the next step's duration ``d_t``;
    ``remaining_steps`` the expected steps still to come (the agent loop knows ``max_rounds - turn``,
    an upper bound; without it the policy uses the mean length of finished trajectories).
    ``checkpoint_kind`` is the kind a checkpoint now would take (``full``, ``fresh-runtime`` or
    ``reference``: belayer-envckpt's `next_checkpoint_kind`); the policy then weighs that kind's
    cost.  None: unknown, weighed as ``full``.
    """

    step_index: int = attrs.field(validator=positive_int)
    response_s: float = attrs.field(validator=non_negative)
    action_s: float = attrs.field(validator=non_negative)
    now: float = attrs.field(validator=non_negative)
    response_elapsed_s: float = attrs.field(default=0.0, validator=non_negative)
    next_step_s: float | None = attrs.field(default=None, validator=_optional_non_negative)
    remaining_steps: float | None = attrs.field(default=None, validator=_optional_non_negative)
    checkpoint_kind: str | None = attrs.field(default=None, validator=_kind)


class Reason(enum.StrEnum):
    """Why a decision came out the way it did."""

    BENEFIT_EXCEEDS_COST = "benefit_exceeds_cost"
    COST_EXCEEDS_BENEFIT = "cost_exceeds_benefit"
    COOLDOWN = "cooldown"
    CHECKPOINT_IN_FLIGHT = "checkpoint_in_flight"
    COST_PROBE_IN_FLIGHT = "cost_probe_in_flight"
    COST_PROBE = "cost_probe"
    ALWAYS = "always"
    NEVER = "never"
    EVERY_K = "every_k"
    NOT_KTH_STEP = "not_kth_step"


@attrs.frozen
class Decision:
    """The outcome of one decision with every input that went into it, ready to be logged.

    ``benefit_s`` is ``p_t * C_t`` (expected seconds saved); ``visible_cost_s`` is
    ``c_t * (1 - q(x; c_t)) + extra_cost_s`` (expected seconds on the critical path plus the fixed
    extra).  Baselines report the same numbers even though they ignore them.
    """

    checkpoint: bool
    reason: Reason
    policy: str
    step_index: int
    now: float
    benefit_s: float
    visible_cost_s: float
    failure_probability: float
    regeneration_s: float
    checkpoint_cost_s: float
    hidden_probability: float
    hazard: float = 0.0
    remaining_steps: float = 0.0
    step_s: float = 0.0
    restore_cost_s: float = 0.0
    contenders: int = 1  # trajectories of the batch competing with this one for its critical path
    checkpoint_kind: str = "full"  # the kind whose cost was weighed (the observation's, else full)

    def to_dict(self) -> dict[str, Any]:
        """A flat JSON-ready dict (``reason`` as its string value)."""
        record = attrs.asdict(self)
        record["reason"] = self.reason.value
        return record
