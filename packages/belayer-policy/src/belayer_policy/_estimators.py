"""Online estimators: LLM response time ``T`` (and ``q``), checkpoint cost ``c_t``, regeneration ``C_t``."""

from __future__ import annotations

import bisect
import math
from collections import deque

import attrs

from belayer_policy._errors import PolicyStateError
from belayer_policy._validate import (
    non_negative,
    positive_int,
    require_non_negative,
    unit_fraction,
)

__all__ = [
    "CheckpointCostModel",
    "RegenerationCost",
    "ResponseTimeModel",
    "RestoreCostModel",
    "TrajectoryLengthModel",
]


@attrs.define
class ResponseTimeModel:
    """Empirical distribution of LLM response times over a sliding window.

    Memory is bounded by ``window`` samples; the oldest sample leaves when a new one arrives, so the
    distribution follows drift.  One observation is enough to answer queries.  Queries are
    O(log window): samples are also kept sorted.
    """

    window: int = attrs.field(default=64, validator=positive_int)
    _recent: deque[float] = attrs.field(init=False, factory=deque)
    _sorted: list[float] = attrs.field(init=False, factory=list)
    _sum: float = attrs.field(init=False, default=0.0)
    _sum_squares: float = attrs.field(init=False, default=0.0)

    @property
    def num_observations(self) -> int:
        """Samples currently in the window."""
        return len(self._recent)

    @property
    def mean(self) -> float:
        """Mean of the samples in the window (0.0 when empty)."""
        return self._sum / len(self._recent) if self._recent else 0.0

    @property
    def std(self) -> float:
        """Standard deviation of the samples in the window (0.0 with fewer than two)."""
        n = len(self._recent)
        if n < 2:
            return 0.0
        mean = self._sum / n
        return math.sqrt(max(0.0, (self._sum_squares - n * mean * mean) / (n - 1)))

    def observe(self, response_s: float) -> None:
        """Add one measured response time."""
        value = require_non_negative("response_s", response_s)
        self._recent.append(value)
        bisect.insort(self._sorted, value)
        self._sum += value
        self._sum_squares += value * value
        if len(self._recent) > self.window:
            oldest = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
            self._sum -= oldest
            self._sum_squares -= oldest * oldest

    def survival(self, at_s: float) -> float:
        """Empirical ``P(T >= at_s)``; 1.0 for ``at_s <= 0`` even without samples."""
        require_non_negative("at_s", at_s, allow_inf=True)
        if at_s <= 0:
            return 1.0
        if not self._sorted:
            return 0.0
        return (len(self._sorted) - bisect.bisect_left(self._sorted, at_s)) / len(self._sorted)

    def hidden_probability(self, elapsed_s: float, cost_s: float) -> float:
        """``q(x; c) = P(T >= x + c | T >= x)``: a checkpoint of ``cost_s`` started ``elapsed_s`` seconds
        into the current response ends before the response does.

        Without samples the answer is pessimistic (0 for any ``cost_s > 0``).  When the response has
        already outlived every sample, the tail is taken as exponential with the window's mean.
        """
        x = require_non_negative("elapsed_s", elapsed_s)
        c = require_non_negative("cost_s", cost_s)
        if c == 0:
            return 1.0
        reached = self.survival(x)
        if reached > 0:
            return self.survival(x + c) / reached
        mean = self.mean
        return math.exp(-c / mean) if mean > 0 else 0.0

    def expected_visible(self, elapsed_s: float, cost_s: float) -> float:
        """``E[max(0, c - (T - x)) | T >= x]``: seconds of a checkpoint of ``cost_s``, started
        ``elapsed_s`` into the current response, that the response does not hide.

        Without samples the whole cost is visible; past the longest sample the tail is exponential
        with the window's mean (as in :meth:`hidden_probability`).  O(window).
        """
        x = require_non_negative("elapsed_s", elapsed_s)
        c = require_non_negative("cost_s", cost_s)
        if c == 0 or not self._sorted:
            return c
        start = bisect.bisect_left(self._sorted, x)
        alive = len(self._sorted) - start
        if not alive:
            mean = self.mean
            # E[max(0, c - R)] for R exponential with this mean.
            return c - mean * -math.expm1(-c / mean) if mean > 0 else c
        # Only responses ending within the checkpoint leave part of it visible: (x + c) - t each.
        end = bisect.bisect_left(self._sorted, x + c, lo=start)
        return ((end - start) * (x + c) - math.fsum(self._sorted[start:end])) / alive


@attrs.define
class CheckpointCostModel:
    """Exponentially weighted mean of measured checkpoint costs (seconds), following current load.

    ``initial_s`` stands in until the first measurement; ``smoothing`` is the weight of each
    new measurement (1.0 keeps only the latest).  ``probes_in_flight`` counts checkpoints started
    before the first measurement, ``probe_started_at`` when the oldest of them started: until the
    first measurement the cost is at least as long as that probe has been running.
    """

    initial_s: float = attrs.field(default=1.0, validator=non_negative)
    smoothing: float = attrs.field(default=0.3, validator=unit_fraction)
    num_observations: int = attrs.field(init=False, default=0)
    probes_in_flight: int = attrs.field(init=False, default=0)
    probe_started_at: float | None = attrs.field(init=False, default=None)
    _estimate: float | None = attrs.field(init=False, default=None)

    @property
    def estimate(self) -> float:
        """Current estimate of ``c_t`` in seconds."""
        return self.initial_s if self._estimate is None else self._estimate

    def observe(self, cost_s: float) -> None:
        """Add one measured checkpoint cost."""
        value = require_non_negative("cost_s", cost_s)
        if self._estimate is None:
            self._estimate = value
        else:
            self._estimate += self.smoothing * (value - self._estimate)
        self.num_observations += 1


@attrs.define
class RestoreCostModel(CheckpointCostModel):
    """Exponentially weighted mean of measured restore times (seconds); prior 2 s.

    Logged with every decision; in the first-order comparison of "now or later" every failure pays
    one restore whatever the plan, so it does not move the decision.
    """

    initial_s: float = attrs.field(default=2.0, validator=non_negative)


@attrs.define
class TrajectoryLengthModel:
    """Steps of finished trajectories: their mean (prior ``prior_steps``, weight 1) and the recent
    lengths (the last ``window``), for the share of trajectories at least as long as a given one.

    The mean gives the expected remaining steps when the agent loop does not give them (it knows
    its ``max_rounds``: pass ``StepObservation.remaining_steps``).  The share tells the adaptive
    rule how many trajectories of a batch compete with this one for the batch's critical path;
    so does the share that lasted at least as long (their seconds, when told:
    ``observe(num_steps, duration_s=...)``), which sees slack that the step counts miss where the
    trajectories' steps differ in length.
    """

    prior_steps: float = attrs.field(default=20.0, validator=non_negative)
    window: int = attrs.field(default=256, validator=positive_int)
    num_observations: int = attrs.field(init=False, default=0)
    _total: float = attrs.field(init=False, default=0.0)
    _recent: deque[float] = attrs.field(init=False, factory=deque)
    _sorted: list[float] = attrs.field(init=False, factory=list)
    _recent_durations: deque[float] = attrs.field(init=False, factory=deque)
    _sorted_durations: list[float] = attrs.field(init=False, factory=list)

    @property
    def mean(self) -> float:
        """Current estimate of the steps of one trajectory."""
        return (self.prior_steps + self._total) / (1 + self.num_observations)

    def remaining(self, steps_done: int) -> float:
        """Expected steps still to come after ``steps_done`` (at least one)."""
        return max(1.0, self.mean - steps_done)

    def share_at_least(self, steps: float) -> float | None:
        """Share of the recent finished trajectories with at least ``steps`` steps (rounded to whole
        steps); ``None`` before the first one finished."""
        if not self._sorted:
            return None
        return (len(self._sorted) - bisect.bisect_left(self._sorted, round(steps))) / len(self._sorted)

    def share_lasting_at_least(self, duration_s: float) -> float | None:
        """Share of the recent finished trajectories that lasted at least ``duration_s``; ``None``
        before one finished with its duration told."""
        if not self._sorted_durations:
            return None
        count = len(self._sorted_durations)
        return (count - bisect.bisect_left(self._sorted_durations, duration_s)) / count

    def observe(self, num_steps: int, duration_s: float | None = None) -> None:
        """Add the length of one finished trajectory (and how long it lasted, when known)."""
        value = require_non_negative("num_steps", num_steps)
        self._total += value
        self.num_observations += 1
        _slide(self._recent, self._sorted, value, self.window)
        if duration_s is not None:
            duration = require_non_negative("duration_s", duration_s)
            _slide(self._recent_durations, self._sorted_durations, duration, self.window)


def _slide(recent: deque[float], ordered: list[float], value: float, window: int) -> None:
    """Add ``value`` to a window kept in arrival order and sorted, dropping the oldest beyond it."""
    recent.append(value)
    bisect.insort(ordered, value)
    if len(recent) > window:
        del ordered[bisect.bisect_left(ordered, recent.popleft())]


@attrs.define
class RegenerationCost:
    """``C_t``: seconds of responses and actions since the latest ready checkpoint.

    The work is a running total along the current prefix.  A checkpoint *captures* the total when it
    is taken; only when it becomes *ready* does the ready mark move there (work done while it was in
    flight stays counted).  A restore rolls the total back to the ready mark (to 0 without one:
    the trajectory restarts from the base image).
    """

    _work: float = attrs.field(init=False, default=0.0)
    _ready_mark: float = attrs.field(init=False, default=0.0)
    _capture_mark: float | None = attrs.field(init=False, default=None)

    @property
    def cost_s(self) -> float:
        """Current ``C_t`` (0 when the difference is only rounding of the running totals)."""
        value = self._work - self._ready_mark
        return value if value > 1e-9 * self._work else 0.0

    @property
    def in_flight(self) -> bool:
        """Whether a captured checkpoint is neither ready nor abandoned yet."""
        return self._capture_mark is not None

    def add(self, work_s: float) -> None:
        """Add ``work_s`` seconds of work (a response, an action) to the prefix."""
        self._work += require_non_negative("work_s", work_s)

    def capture(self) -> None:
        """A checkpoint of the current prefix starts."""
        self._capture_mark = self._work

    def mark_ready(self) -> None:
        """The captured checkpoint is ready: it becomes the restore point."""
        if self._capture_mark is None:
            raise PolicyStateError(
                "a checkpoint became ready but none was started: call on_checkpoint_ready only after "
                "a decision with checkpoint=True"
            )
        self._ready_mark = self._capture_mark
        self._capture_mark = None

    def abandon(self) -> None:
        """The captured checkpoint failed or timed out; the previous ready one stays in effect."""
        self._capture_mark = None

    def restore(self) -> None:
        """The environment went back to the latest ready checkpoint (or to the base image)."""
        self._work = self._ready_mark
        self._capture_mark = None
