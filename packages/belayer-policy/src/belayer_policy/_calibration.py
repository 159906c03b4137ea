"""Calibration of the checkpoint-cost estimates against the trainer's clock.

A measured checkpoint cost can be off by a constant factor (a timer that stops before the I/O is
done, contention that slows the concurrent response, a prior from another machine), and an online
mean of such measurements keeps the error.  What the batch pays is on the clock: the next action
waits for the checkpoint, so the step after a checkpoint took ``wait`` seconds longer than its
response and action, and the checkpoint ran ``response - x + wait`` seconds when ``wait > 0`` (``x``:
how far the response already was when it started).  A checkpoint that the response hid (no wait)
only bounds its cost from above.

:class:`CostCalibration` (shared by a batch) keeps, per checkpoint kind, a shrunk mean of
``log(clock cost / estimate the rule weighed)``: ``prior_weight`` pseudo-observations of no error,
then every checkpoint measured on the clock, older ones forgotten over ``window``.  A hidden
checkpoint whose bound lies below the current factor counts as an observation at the bound; one
whose bound lies above says nothing more and is not counted.  :class:`ClockProbe` is
one trajectory's side: it remembers the checkpoint in flight and the overhead of steps without one.
"""

from __future__ import annotations

import math

import attrs

from belayer_policy._decision import StepObservation
from belayer_policy._validate import non_negative, positive_int

__all__ = ["ClockProbe", "CostCalibration"]

_FULL = "full"


@attrs.define
class _LogMean:
    total: float = 0.0
    weight: float = 0.0


@attrs.define
class CostCalibration:
    """Per kind, the factor by which the cost estimates should be multiplied (1.0 until measured).

    ``factor(kind) = exp(sum(log ratios) / (n + prior_weight))`` with the ratios and ``n`` decayed by
    ``1 - 1 / window`` per observation.  ``observe(kind, ratio)`` adds a clock-measured ratio,
    ``observe_bound(kind, ratio)`` an upper bound (a hidden checkpoint).
    """

    prior_weight: float = attrs.field(default=2.0, validator=non_negative)
    window: int = attrs.field(default=64, validator=positive_int)
    _kinds: dict[str, _LogMean] = attrs.field(init=False, factory=dict)

    def factor(self, kind: str | None) -> float:
        """The multiplier of ``kind``'s estimate (None: full)."""
        return math.exp(self._log_factor(kind or _FULL))

    def num_observations(self, kind: str | None) -> float:
        """The (decayed) number of checkpoints of ``kind`` measured on the clock."""
        state = self._kinds.get(kind or _FULL)
        return 0.0 if state is None else state.weight

    def observe(self, kind: str | None, ratio: float) -> None:
        """A checkpoint of ``kind`` took ``ratio`` times the estimate the rule weighed for it."""
        if ratio > 0 and math.isfinite(ratio):
            self._add(kind or _FULL, math.log(ratio))

    def observe_bound(self, kind: str | None, ratio: float) -> None:
        """A checkpoint of ``kind`` took at most ``ratio`` times its estimate (the response hid it)."""
        key = kind or _FULL
        if ratio > 0 and math.isfinite(ratio) and math.log(ratio) < self._log_factor(key):
            self._add(key, math.log(ratio))

    def _log_factor(self, key: str) -> float:
        state = self._kinds.get(key)
        if state is None:
            return 0.0
        return state.total / (state.weight + self.prior_weight)

    def _add(self, key: str, log_ratio: float) -> None:
        state = self._kinds.setdefault(key, _LogMean())
        keep = 1.0 - 1.0 / self.window
        state.total = state.total * keep + log_ratio
        state.weight = state.weight * keep + 1.0


@attrs.define
class ClockProbe:
    """One trajectory's clock: the checkpoint decided at the last step and the overhead of a step.

    ``started(obs, kind, estimate_s)`` when a checkpoint is decided after ``obs``; ``step(obs)`` with
    the next step's observation (it feeds ``calibration`` when a checkpoint was in flight over it,
    else learns the overhead: the clock's time between decisions beyond the response and the
    action); ``forget()`` after a failure or a timeout (that step's time is no measurement).
    """

    calibration: CostCalibration
    smoothing: float = 0.3
    _last_now: float | None = attrs.field(init=False, default=None)
    _last_elapsed: float = attrs.field(init=False, default=0.0)
    _overhead: float = attrs.field(init=False, default=0.0)
    _pending: tuple[str | None, float] | None = attrs.field(init=False, default=None)

    def started(self, obs: StepObservation, kind: str | None, estimate_s: float) -> None:
        """A checkpoint of ``kind``, weighed at ``estimate_s`` seconds, starts after ``obs``."""
        self._pending = (kind, estimate_s) if estimate_s > 0 else None

    def forget(self) -> None:
        """The time up to the next step measures nothing (a failure, a restore, a timeout)."""
        self._pending = None
        self._last_now = None

    def step(self, obs: StepObservation) -> None:
        """The step after the previous decision committed: measure what the clock says."""
        last, pending, elapsed = self._last_now, self._pending, self._last_elapsed
        self._last_now, self._pending, self._last_elapsed = obs.now, None, obs.response_elapsed_s
        if last is None:
            return
        # Since the last decision: the rest of its response (``elapsed`` of it had run), any wait,
        # the action and the part of the next response that runs before this decision.
        rest = max(obs.response_s - elapsed, 0.0)
        gap = obs.now - last - rest - obs.action_s - obs.response_elapsed_s
        tolerance = 1e-6 + 1e-9 * obs.now
        if gap < -tolerance - 0.01 * (obs.response_s + obs.action_s):
            return  # not a wall clock (or a step reported twice): no measurement
        if pending is None:
            self._overhead += self.smoothing * (max(gap, 0.0) - self._overhead)
            return
        kind, estimate = pending
        wait = gap - self._overhead
        ran = rest + max(wait, 0.0)
        if wait > tolerance + 0.01 * estimate:
            self.calibration.observe(kind, ran / estimate)
        elif ran > 0:
            self.calibration.observe_bound(kind, ran / estimate)
