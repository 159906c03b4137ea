"""Calibration of the checkpoint-cost estimates against the trainer's clock.

A measured checkpoint cost can be off by a constant factor (a timer that stops before the I/O is
done, contention that slows the concurrent response, a prior from another machine), and an online
mean of such measurements keeps the error.  What the batch pays is on the clock: the next action
waits for the checkpoint, so the step after a checkpoint took ``wait`` seconds longer than its
response and action, and the checkpoint ran ``response - x + wait`` seconds when ``wait > 0`` (``x``:
how far the response already was when it started).  A checkpoint that the response hid (no wait)
only bounds its cost from above.

:class:`CostCalibration` (shared by a batch) keeps, per checkpoint kind, a shrunk mean of
``log(clock cost / estimate the rule weighed)`` over every checkpoint measured on the clock, older
ones forgotten over ``window``, shrunk towards no error by the measurements' own noise (0.7.0): a
normal prior of spread ``prior_log_sd`` on the log factor, and a noise variance estimated from the
ratios' spread (``prior_weight`` pseudo-observations of noise as large as the prior's spread).
Consistent measurements are believed after a few; noisy ones are averaged over more.  A hidden
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
    squares: float = 0.0
    weight: float = 0.0


@attrs.define
class CostCalibration:
    """Per kind, the factor by which the cost estimates should be multiplied (1.0 until measured).

    ``factor(kind) = exp(sum(log ratios) / (n + noise_var / prior_log_sd**2))``: the posterior mean
    of a normal prior (no error, spread ``prior_log_sd``) with ``n`` measurements of variance
    ``noise_var = (spread of the log ratios + prior_weight * prior_log_sd**2) / (n + prior_weight)``;
    sums and ``n`` decayed by ``1 - 1 / window`` per observation.  (0.6.0 shrank by a fixed
    ``prior_weight``, which kept a factor measured exactly a few percent low.)  ``prior_log_sd`` 0
    keeps the factor at 1.  ``observe(kind, ratio)`` adds a clock-measured ratio,
    ``observe_bound(kind, ratio)`` an upper bound (a hidden checkpoint).
    """

    prior_weight: float = attrs.field(default=2.0, validator=non_negative)
    window: int = attrs.field(default=64, validator=positive_int)
    prior_log_sd: float = attrs.field(default=math.log(2.0), validator=non_negative)
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
        if state is None or state.weight <= 0.0 or self.prior_log_sd <= 0.0:
            return 0.0
        prior_var = self.prior_log_sd**2
        spread = max(state.squares - state.total * state.total / state.weight, 0.0)
        noise_var = (spread + self.prior_weight * prior_var) / (state.weight + self.prior_weight)
        return state.total / (state.weight + noise_var / prior_var)

    def _add(self, key: str, log_ratio: float) -> None:
        state = self._kinds.setdefault(key, _LogMean())
        keep = 1.0 - 1.0 / self.window
        state.total = state.total * keep + log_ratio
        state.squares = state.squares * keep + log_ratio * log_ratio
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
