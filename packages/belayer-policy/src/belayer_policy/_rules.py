"""Decision rules: the adaptive renewal rule, the paper's one-step rule and the fixed baselines.

A rule sees a :class:`StepContext` (every estimate the policy holds for this step) and returns a
:class:`Verdict`.  Baselines report the paper's two sides too, so every record logs the same fields.
"""

from __future__ import annotations

import math
from typing import Protocol

import attrs

from belayer_policy._decision import Reason
from belayer_policy._horizon import batch_step_hazard, compare_now_and_later
from belayer_policy._renewal import RenewalLoss
from belayer_policy._validate import positive_int

__all__ = [
    "AdaptiveRule",
    "AlwaysRule",
    "DecisionRule",
    "EveryKRule",
    "NeverRule",
    "PaperRule",
    "StepContext",
    "Verdict",
]


@attrs.frozen
class StepContext:
    """What a rule may weigh for one decision (seconds unless said otherwise).

    ``failure_probability`` is ``p_t`` of the next step of this trajectory; ``visible_now_s`` the
    expected part of a checkpoint now that the current response does not hide;
    ``visible_future_s`` the same for a checkpoint at the start of a response.  ``batch_size`` is
    how many trajectories of the batch compete with this one for its critical path (those at
    least as long as this one; the whole batch until the policy knows the lengths).  ``step_sd_s``
    is the standard deviation of a step's duration (0: unknown), from which the spread of the
    trajectories' durations follows.  ``restore_s`` is one restore's expected seconds.
    """

    step_index: int
    regeneration_s: float
    step_s: float
    failure_probability: float
    checkpoint_cost_s: float
    hidden_probability: float
    visible_now_s: float
    visible_future_s: float
    extra_cost_s: float
    remaining_steps: float
    batch_size: int
    step_sd_s: float = 0.0
    restore_s: float = 0.0


@attrs.frozen
class Verdict:
    """A rule's answer: checkpoint or not, why, and the two sides it compared.

    ``hazard`` is the per-step failure weight the rule used (``p_t`` for the paper's rule, the
    batch's critical-path weight for the adaptive one).
    """

    checkpoint: bool
    reason: Reason
    benefit_s: float
    visible_cost_s: float
    hazard: float


class DecisionRule(Protocol):
    """Turns the context of one step into checkpoint or not."""

    @property
    def name(self) -> str:
        """Short name for logs and tables (``adaptive``, ``every:3``)."""
        ...

    def choose(self, context: StepContext) -> Verdict:
        """Checkpoint or not, and why."""
        ...


def _compare(benefit_s: float, visible_cost_s: float, hazard: float) -> Verdict:
    if benefit_s > visible_cost_s:
        return Verdict(True, Reason.BENEFIT_EXCEEDS_COST, benefit_s, visible_cost_s, hazard)
    return Verdict(False, Reason.COST_EXCEEDS_BENEFIT, benefit_s, visible_cost_s, hazard)


def paper_sides(context: StepContext) -> tuple[float, float]:
    """``p_t * C_t`` and ``c_t * (1 - q(x; c_t)) + extra_cost_s``: the paper's two sides."""
    benefit = context.failure_probability * context.regeneration_s
    visible = context.checkpoint_cost_s * (1.0 - context.hidden_probability) + context.extra_cost_s
    return benefit, visible


@attrs.frozen
class PaperRule:
    """The paper's one-step rule: checkpoint iff ``p_t * C_t > c_t * (1 - q(x; c_t)) + extra_cost_s``."""

    name: str = "paper"

    def choose(self, context: StepContext) -> Verdict:
        """The one-step comparison."""
        benefit, visible = paper_sides(context)
        return _compare(benefit, visible, context.failure_probability)


@attrs.frozen
class AdaptiveRule:
    """Values a checkpoint by the regeneration it saves over the rest of the trajectory.

    Compares the best plan that checkpoints now with the best that waits ``s >= 1`` steps (or
    never), over the expected remaining steps, with the per-step weight of the batch's critical
    path (:func:`batch_step_hazard`, scaled by the share of a loss that the trajectories' spread
    does not absorb); checkpoints iff the saving exceeds the visible cost now.  The stretches are
    priced exactly under restarts at the trajectory's own rate (:class:`RenewalLoss`: the redone
    work fails again, every failure pays a restore), weighted by the batch's weight over that rate.
    """

    name: str = "adaptive"

    @staticmethod
    def _hazard(c: StepContext) -> float:
        total = c.step_index + c.remaining_steps
        # Independent steps: the duration's spread over its mean is the step's, over sqrt(steps).
        cv = c.step_sd_s / (c.step_s * math.sqrt(total)) if c.step_s > 0 and total > 0 else 0.0
        return batch_step_hazard(c.failure_probability, total, c.batch_size, cv)

    @staticmethod
    def _loss(c: StepContext, hazard: float) -> RenewalLoss:
        """The stretches' exact loss at the trajectory's own rate, weighted as the batch weighs it."""
        rate = -math.log1p(-min(c.failure_probability, 1.0 - 1e-12))
        return RenewalLoss(rate, c.step_s, c.restore_s, hazard / rate if rate > 0.0 else 0.0)

    def choose(self, context: StepContext) -> Verdict:
        """The renewal comparison."""
        c = context
        hazard = self._hazard(c)
        visible = c.visible_now_s + c.extra_cost_s
        if c.step_s <= 0.0 or hazard <= 0.0 or c.remaining_steps <= 0.0:
            return _compare(0.0, visible, hazard)
        verdict = compare_now_and_later(
            c.regeneration_s / c.step_s,
            c.remaining_steps,
            hazard * c.step_s,
            c.visible_future_s + c.extra_cost_s,
            self._loss(c, hazard),
        )
        # Plans that tie (nothing unprotected) differ only by rounding: count that as no saving.
        saving = verdict.saving_s if verdict.saving_s > 1e-12 * verdict.later_s else 0.0
        return _compare(saving, visible, hazard)

    def probe(self, context: StepContext) -> Verdict:
        """A cost probe: checkpoint a kind whose cost was never measured iff it is cheap to learn.

        The cost weighed is then only a prior, and a prior that says "too dear" is never tested:
        no checkpoint, no measurement.  The stake is what the rest of this trajectory loses in
        expectation with no checkpoint at all (to first order ``a * (m * u + m**2 / 2)``, priced
        under restarts as the plans are): about what checkpoints could save at best, were they
        free, but since 0.8.1 it also counts the restores, which every plan pays (to first order
        ``h * m * R``), so it overstates that saving by them (a known fault, left for a later
        version: the family's results were measured with it).  One probe pays when that stake exceeds its visible
        cost at the prior (``benefit_s`` is the stake; reason ``cost_probe``).  The measurement
        then serves every later decision of the batch.
        """
        c = context
        hazard = self._hazard(c)
        visible = c.visible_now_s + c.extra_cost_s
        m = round(c.remaining_steps)
        if c.step_s <= 0.0 or hazard <= 0.0 or m <= 0:
            return _compare(0.0, visible, hazard)
        stake = self._loss(c, hazard)(c.regeneration_s / c.step_s, m)
        if stake > visible:
            return Verdict(True, Reason.COST_PROBE, stake, visible, hazard)
        return Verdict(False, Reason.COST_EXCEEDS_BENEFIT, stake, visible, hazard)


def _baseline(checkpoint: bool, reason: Reason, context: StepContext) -> Verdict:
    benefit, visible = paper_sides(context)
    return Verdict(checkpoint, reason, benefit, visible, context.failure_probability)


@attrs.frozen
class AlwaysRule:
    """Baseline: checkpoint after every step."""

    name: str = "always"

    def choose(self, context: StepContext) -> Verdict:
        """Always."""
        return _baseline(True, Reason.ALWAYS, context)


@attrs.frozen
class NeverRule:
    """Baseline: never checkpoint; a failure restarts the trajectory from the base image."""

    name: str = "never"

    def choose(self, context: StepContext) -> Verdict:
        """Never."""
        return _baseline(False, Reason.NEVER, context)


@attrs.frozen
class EveryKRule:
    """Baseline: checkpoint when the prefix length is a multiple of ``k``."""

    k: int = attrs.field(validator=positive_int)

    @property
    def name(self) -> str:
        """``every:K``."""
        return f"every:{self.k}"

    def choose(self, context: StepContext) -> Verdict:
        """Every ``k``-th prefix."""
        if context.step_index % self.k == 0:
            return _baseline(True, Reason.EVERY_K, context)
        return _baseline(False, Reason.NOT_KTH_STEP, context)
