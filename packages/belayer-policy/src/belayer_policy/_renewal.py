"""The exact expected loss of a stretch of steps under restarts (all orders in the failure rate).

The first-order model of :mod:`belayer_policy._horizon` prices a stretch of ``L`` steps that starts
``u`` unprotected steps after the latest ready checkpoint at ``a * (L * u + L**2 / 2)`` seconds: one
failure, paid once.  Where failures are frequent (a tenth of the steps) that undercounts: the work
a failure makes the trajectory redo is itself exposed, so failures come again, and each pays a
restore.  With failures a Poisson process of ``r`` per step (steps of ``d`` seconds), a restore of
``R`` seconds and restarts from the ready checkpoint, running the stretch takes
``(d / r + R) * e^(r u) * (e^(r L) - 1)`` seconds in expectation (the renewal equation), of which
``L * d`` is its work: the rest is its loss.  To first order that is the model's loss plus
``r * L * R`` (one restore a failure, the same for every plan).
"""

from __future__ import annotations

import math

import attrs

from belayer_policy._validate import non_negative

__all__ = ["RenewalLoss"]

# Beyond e^300 expected restarts a stretch never ends in practice; each exponent is capped there so
# that the plans' costs stay finite and comparable (a cap only ties plans that are all hopeless):
# the loss multiplies two of them, and e^600 times a step's seconds stays far below a float's e^709.
_MAX_EXPONENT = 300.0


def _expm1_minus_x_over_r(r: float, steps: float) -> float:
    """``(e^(r L) - 1 - r L) / r`` without the cancellation at small ``r L``."""
    x = r * steps
    if x < 1e-4:
        return steps * x * (0.5 + x / 6.0 + x * x / 24.0)
    return (math.expm1(x) - x) / r


@attrs.frozen
class RenewalLoss:
    """Expected seconds a stretch of steps loses to failures, restores and the redone work.

    ``step_rate``: the trajectory's own failures per step (``-log(1 - p)``); ``step_s``: a step's
    duration; ``restore_s``: one restore; ``weight``: what one second of this trajectory's loss
    costs the batch (the batch's critical-path weight over the trajectory's own rate, at least 1).
    Called with ``(unprotected_steps, steps)``: the loss of running ``steps`` more steps when
    ``unprotected_steps`` of work precede them since the ready checkpoint.
    """

    step_rate: float = attrs.field(validator=non_negative)
    step_s: float = attrs.field(validator=non_negative)
    restore_s: float = attrs.field(default=0.0, validator=non_negative)
    weight: float = attrs.field(default=1.0, validator=non_negative)

    def __call__(self, unprotected_steps: float, steps: float) -> float:
        """``weight * ((d / r + R) * e^(r u) * (e^(r L) - 1) - L * d)``, 0 without failures."""
        r, d = self.step_rate, self.step_s
        if r <= 0.0 or steps <= 0.0:
            return 0.0
        before = min(r * unprotected_steps, _MAX_EXPONENT)
        during = min(r * steps, _MAX_EXPONENT)
        # (d / r) e^(ru) (e^(rL) - 1) - L d, split so that small rates keep their precision
        redo = d * (math.expm1(before) * math.expm1(during) / r + _expm1_minus_x_over_r(r, during / r))
        restores = self.restore_s * math.exp(before) * math.expm1(during)
        return self.weight * (redo + restores)
