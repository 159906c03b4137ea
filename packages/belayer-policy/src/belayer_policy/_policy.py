"""The checkpoint policy the agent loop calls after every step, and its decision rules.

One :class:`CheckpointPolicy` per trajectory holds that trajectory's state (``C_t``, a checkpoint in
flight, the cooldown).  The estimators (failure model, response times, checkpoint costs) may be
shared by all trajectories of a batch so that they learn from every trajectory at once.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from belayer_policy._decision import Decision, Reason, StepObservation
from belayer_policy._estimators import CheckpointCostModel, RegenerationCost, ResponseTimeModel
from belayer_policy._hazard import FailureModel, OnlineHazard
from belayer_policy._validate import (
    non_negative,
    positive_int,
    renamed_keywords,
    require_non_negative,
    unit_fraction,
)

__all__ = [
    "AdaptiveRule",
    "AlwaysRule",
    "CheckpointPolicy",
    "DecisionRule",
    "EveryKRule",
    "NeverRule",
]


class DecisionRule(Protocol):
    """Turns the evaluated benefit and visible cost of one step into checkpoint or not."""

    @property
    def name(self) -> str:
        """Short name for logs and tables (``adaptive``, ``every:3``)."""
        ...

    def choose(self, step_index: int, benefit: float, visible_cost_s: float) -> tuple[bool, Reason]:
        """Checkpoint or not, and why."""
        ...


@attrs.frozen
class AdaptiveRule:
    """Checkpoint iff ``p_t * C_t > c_t * (1 - q(x; c_t)) + extra_cost_s``."""

    name: str = "adaptive"

    def choose(self, step_index: int, benefit: float, visible_cost_s: float) -> tuple[bool, Reason]:
        """The risk-aware comparison."""
        if benefit > visible_cost_s:
            return True, Reason.BENEFIT_EXCEEDS_COST
        return False, Reason.COST_EXCEEDS_BENEFIT


@attrs.frozen
class AlwaysRule:
    """Baseline: checkpoint after every step."""

    name: str = "always"

    def choose(self, step_index: int, benefit: float, visible_cost_s: float) -> tuple[bool, Reason]:
        """Always."""
        return True, Reason.ALWAYS


@attrs.frozen
class NeverRule:
    """Baseline: never checkpoint; a failure restarts the trajectory from the base image."""

    name: str = "never"

    def choose(self, step_index: int, benefit: float, visible_cost_s: float) -> tuple[bool, Reason]:
        """Never."""
        return False, Reason.NEVER


@attrs.frozen
class EveryKRule:
    """Baseline: checkpoint when the prefix length is a multiple of ``k``."""

    k: int = attrs.field(validator=positive_int)

    @property
    def name(self) -> str:
        """``every:K``."""
        return f"every:{self.k}"

    def choose(self, step_index: int, benefit: float, visible_cost_s: float) -> tuple[bool, Reason]:
        """Every ``k``-th prefix."""
        if step_index % self.k == 0:
            return True, Reason.EVERY_K
        return False, Reason.NOT_KTH_STEP


@attrs.define
class CheckpointPolicy:
    """Decides after each committed step of one trajectory whether to take a full checkpoint now.

    Protocol for the agent loop: ``decide(obs)`` after every step; after a ``checkpoint=True``
    decision exactly one of ``on_checkpoint_ready(cost_s)``, ``on_checkpoint_timeout(now)`` or
    ``on_failure(now)``; after a failure and restore, ``on_restore()``.  Two guards apply to every
    rule: no new checkpoint while one is in flight, none during the cooldown after a timeout.
    """

    rule: DecisionRule = attrs.field(factory=AdaptiveRule)
    failure_model: FailureModel = attrs.field(factory=OnlineHazard)
    response_times: ResponseTimeModel = attrs.field(factory=ResponseTimeModel)
    checkpoint_costs: CheckpointCostModel = attrs.field(factory=CheckpointCostModel)
    extra_cost_s: float = attrs.field(default=0.0, validator=non_negative)
    cooldown_s: float = attrs.field(default=20.0, validator=non_negative)
    step_smoothing: float = attrs.field(default=0.3, validator=unit_fraction)
    _regeneration: RegenerationCost = attrs.field(init=False, factory=RegenerationCost)
    _cooldown_until: float = attrs.field(init=False, default=float("-inf"))
    _step_estimate: float | None = attrs.field(init=False, default=None)

    @property
    def name(self) -> str:
        """The rule's name."""
        return self.rule.name

    @property
    def regeneration_s(self) -> float:
        """Current ``C_t`` in seconds."""
        return self._regeneration.cost_s

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether a decided checkpoint has not been reported ready, timed out or lost yet."""
        return self._regeneration.in_flight

    def decide(self, obs: StepObservation) -> Decision:
        """Record the step, then decide whether to checkpoint the prefix ``obs.step_index`` now."""
        step_s = obs.response_s + obs.action_s
        self._regeneration.add(step_s)
        self.failure_model.observe_exposure(step_s)
        self.response_times.observe(obs.response_s)
        if self._step_estimate is None:
            self._step_estimate = step_s
        else:
            self._step_estimate += self.step_smoothing * (step_s - self._step_estimate)
        duration = self._step_estimate if obs.next_step_s is None else obs.next_step_s

        p = self.failure_model.failure_probability(duration)
        regeneration = self._regeneration.cost_s
        cost = self.checkpoint_costs.estimate
        q = self.response_times.hidden_probability(obs.response_elapsed_s, cost)
        benefit = p * regeneration
        visible_cost_s = cost * (1.0 - q) + self.extra_cost_s

        if self._regeneration.in_flight:
            checkpoint, reason = False, Reason.CHECKPOINT_IN_FLIGHT
        elif obs.now < self._cooldown_until:
            checkpoint, reason = False, Reason.COOLDOWN
        else:
            checkpoint, reason = self.rule.choose(obs.step_index, benefit, visible_cost_s)
        if checkpoint:
            self._regeneration.capture()
        return Decision(
            checkpoint=checkpoint,
            reason=reason,
            policy=self.rule.name,
            step_index=obs.step_index,
            now=obs.now,
            benefit_s=benefit,
            visible_cost_s=visible_cost_s,
            failure_probability=p,
            regeneration_s=regeneration,
            checkpoint_cost_s=cost,
            hidden_probability=q,
        )

    def observe_response(self, response_s: float) -> None:
        """Add a response time that did not come through :meth:`decide` (for example a resumed one)."""
        self.response_times.observe(response_s)

    def on_checkpoint_ready(self, cost_s: float) -> None:
        """The decided checkpoint is ready after ``cost_s`` seconds: ``C_t`` drops to the work since it."""
        cost_s = require_non_negative("cost_s", cost_s)
        self._regeneration.mark_ready()
        self.checkpoint_costs.observe(cost_s)

    def on_checkpoint_timeout(self, now: float, elapsed_s: float | None = None) -> None:
        """The decided checkpoint exceeded its timeout at ``now``: start the cooldown.

        ``elapsed_s`` (seconds it ran before being abandoned), when given, is recorded as a lower
        bound of the checkpoint cost so that the cost estimate reflects the load that caused the
        timeout.
        """
        now = require_non_negative("now", now)
        self._regeneration.abandon()
        self._cooldown_until = now + self.cooldown_s
        if elapsed_s is not None:
            self.checkpoint_costs.observe(elapsed_s)

    def on_failure(self, now: float, exposure_s: float = 0.0, **deprecated: float) -> None:
        """The container failed at ``now``, ``exposure_s`` into a step not yet reported.

        A checkpoint in flight is lost; the previous ready one stays the restore point.
        (``exposure_seconds=`` still works, with a ``DeprecationWarning``.)
        """
        exposure_s = renamed_keywords("on_failure", deprecated, {"exposure_seconds": "exposure_s"}).get(
            "exposure_s", exposure_s
        )
        require_non_negative("now", now)
        self.failure_model.observe_exposure(exposure_s)
        self.failure_model.observe_failure()
        self._regeneration.abandon()

    def on_restore(self) -> None:
        """The environment and LLM context went back to the latest ready checkpoint (or the start)."""
        self._regeneration.restore()
