"""The renewal view of "checkpoint now or later" over the rest of a trajectory.

A checkpoint protects every later step until the next one, so its value is what it saves over the
whole remaining trajectory, not over the next step.  First-order model (failures rare enough that
one failure's cost is paid once): with ``h`` the per-step failure probability, ``d`` the step
duration and ``u`` steps of unprotected work, the next step loses ``h * d * (u + 1/2)`` seconds in
expectation.  A stretch of ``L`` steps that starts protected loses ``a * L**2 / 2`` with
``a = h * d``; splitting ``m`` steps into ``k`` equal stretches costs ``(k - 1) * v + a * m**2 / (2 k)``
with ``v`` the visible cost of one future checkpoint.  Checkpoint now iff the best plan that starts
with a checkpoint now beats every plan that takes the next one ``s >= 1`` steps later (or never).

The batch waits for its slowest trajectory, so what one failure costs the batch is not its mean:
:func:`batch_step_hazard` turns the per-step probability of one trajectory into the per-step
weight of the batch's critical path (the expected largest loss among ``n`` trajectories).  Where
trajectories' durations spread (heavy-tailed responses), a loss on one that would have finished
early is absorbed by its slack: only :func:`critical_share` of the largest loss lengthens the batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from statistics import NormalDist

import attrs

__all__ = ["HorizonVerdict", "batch_step_hazard", "compare_now_and_later", "critical_share", "protected_cost"]


@functools.cache
def _expected_max_normal(n: int) -> float:
    """Expected largest of ``n`` standard normal samples (Blom's approximation)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GRID = 240  # points of the numerical integration of the batch's largest finish


def _phi(t: float) -> float:
    return _INV_SQRT_2PI * math.exp(-0.5 * t * t)


def _cdf(t: float) -> float:
    return 0.5 * (1.0 + math.erf(t / _SQRT2))


def _loss_terms(mu: float) -> list[tuple[float, int]]:
    """Poisson(mu) weights of 0, 1, 2, ... failures, the tail folded into the last term."""
    terms, weight, n, left = [], math.exp(-mu), 0, 1.0
    while True:
        if n >= mu + 6.0 * math.sqrt(mu) + 3 or left - weight < 1e-7:
            terms.append((left, n))
            return terms
        terms.append((weight, n))
        left -= weight
        n += 1
        weight *= mu / n


def _finish_cdf(x: float, spread: float, terms: list[tuple[float, int]]) -> float:
    """``P(B + L <= x)``: ``B`` normal (sd ``spread``), ``L`` the sum of a Poisson number of
    uniform losses on [0, 1] (one exactly, two or more as a normal: Irwin-Hall)."""
    total = 0.0
    for weight, n in terms:
        if n == 0:
            part = _cdf(x / spread) if spread > 0 else float(x >= 0)
        elif n == 1:
            if spread > 0:

                def g(t: float) -> float:
                    return t * _cdf(t) + _phi(t)

                part = spread * (g(x / spread) - g((x - 1.0) / spread))
            else:
                part = min(1.0, max(0.0, x))
        else:
            part = _cdf((x - n / 2.0) / math.sqrt(n / 12.0 + spread * spread))
        total += weight * part
    return total


def _expected_largest(spread: float, terms: list[tuple[float, int]], n: int, high: float) -> float:
    """``E[max of n]`` of ``B + L`` by the trapezoid rule over [-6 spread, high]."""
    low = -6.0 * spread
    step = (high - low) / _GRID
    total = 0.0
    for i in range(_GRID + 1):
        x = low + i * step
        f = _finish_cdf(x, spread, terms) ** n
        value = (1.0 - f) if x >= 0 else -f
        total += value * (0.5 if i in (0, _GRID) else 1.0)
    return total * step


@functools.lru_cache(maxsize=4096)
def _critical_share_cached(mu: float, spread: float, n: int) -> float:
    terms = _loss_terms(mu)
    last = terms[-1][1]
    high = 6.0 * spread + max(1.0, last / 2.0 + 4.0 * math.sqrt(last / 12.0 + 1e-12))
    largest_loss = _expected_largest(0.0, terms, n, high)
    if largest_loss <= 0.0:
        return 1.0
    with_spread = _expected_largest(spread, terms, n, high)
    without_loss = _expected_largest(spread, [(1.0, 0)], n, high)
    return min(1.0, max(0.0, (with_spread - without_loss) / largest_loss))


def _round(value: float, digits: int = 2) -> float:
    """``value`` to ``digits`` significant digits (a cache key: the share varies smoothly)."""
    if value <= 0.0:
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(value)))


def critical_share(mu: float, duration_cv: float, batch_size: int) -> float:
    """Share of the batch's expected largest loss that lengthens its critical path.

    ``mu``: expected failures of one trajectory; ``duration_cv``: the spread (standard deviation
    over mean) of the trajectories' failure-free durations; ``batch_size`` trajectories.  A
    trajectory's loss is the sum of a Poisson number of uniform fractions of its work; the batch
    ends at the largest failure-free duration plus loss, so the share is
    ``(E[max(B + L)] - E[max B]) / E[max L]`` (between 0 and 1; ``max(B + L) <= max B + max L``),
    computed numerically with ``B`` normal.  1 for one trajectory or no spread.
    """
    if batch_size <= 1 or duration_cv <= 0.0 or mu <= 0.0:
        return 1.0
    return _critical_share_cached(_round(mu), _round(duration_cv), batch_size)


def batch_step_hazard(
    step_probability: float, total_steps: float, batch_size: int, duration_cv: float = 0.0
) -> float:
    """Per-step failure weight of the batch's critical path.

    One trajectory of ``total_steps`` steps sees ``mu = total_steps * -log(1 - p)`` failures in
    expectation; a failure costs a uniform fraction of the stretch it hits.  The batch pays the
    largest such loss among ``batch_size`` trajectories: at most ``mu / 2`` stretches for one
    trajectory, ``g(n mu) = 1 - (1 - e^{-n mu}) / (n mu)`` stretches when failures are rare (the largest
    of a Poisson number of uniforms), ``mu / 2 + z_n * sqrt(mu / 3)`` when each trajectory fails
    several times (the largest of ``n`` compound sums, ``z_n`` the expected largest of ``n`` normals).
    The result is spread back over the steps, ``2 * E[largest] / total_steps``, so that a single
    trajectory (``batch_size == 1``) gets its own rate ``-log(1 - p)`` back.  With
    ``duration_cv > 0`` (the trajectories' durations spread) the batch's part is scaled by
    :func:`critical_share`: a loss on a trajectory with slack does not lengthen the batch, never
    below the trajectory's own rate.
    """
    if step_probability <= 0.0 or total_steps <= 0.0:
        return 0.0
    rate = -math.log1p(-min(step_probability, 1.0 - 1e-12))
    mu = rate * total_steps
    largest = mu / 2.0
    if batch_size > 1:
        batch_mu = batch_size * mu
        rare = 1.0 - (-math.expm1(-batch_mu)) / batch_mu
        frequent = mu / 2.0 + _expected_max_normal(batch_size) * math.sqrt(mu / 3.0)
        batch = max(rare, frequent) * critical_share(mu, duration_cv, batch_size)
        largest = max(largest, batch)
    return 2.0 * largest / total_steps


StretchLoss = Callable[[float, float], float]
"""Expected seconds lost over ``steps`` steps that follow ``unprotected_steps`` since the ready
checkpoint: ``loss(unprotected_steps, steps)`` (increasing in both, convex in ``steps``)."""


def _first_order(loss_rate: float) -> StretchLoss:
    return lambda u, steps: loss_rate * (steps * u + steps * steps / 2.0)


def _stretches_cost(steps: int, k: int, loss: StretchLoss, visible_s: float) -> float:
    # k stretches as equal as whole steps allow: r of length q + 1, k - r of length q.
    q, r = divmod(steps, k)
    return (k - 1) * visible_s + (k - r) * loss(0.0, q) + r * loss(0.0, q + 1)


def protected_cost(steps: int, loss_rate: float, visible_s: float, loss: StretchLoss | None = None) -> float:
    """Least expected cost (seconds) of ``steps`` whole steps that start right after a ready checkpoint.

    ``loss_rate`` is ``a = h * d``; future checkpoints cost ``visible_s`` each and fall on step
    boundaries: ``min over k in 1..steps`` of ``(k - 1) * visible_s`` plus ``a * L**2 / 2`` over the
    ``k`` stretches of whole steps (as equal as possible).  That cost is convex in ``k`` (the sum of
    squares of a balanced partition is), so a binary search on its slope finds the exact minimum in
    O(log steps).  (The continuous optimum ``steps * sqrt(a / 2v)`` is not enough: once stretches are
    one or two steps long the whole-step cost falls linearly, with slope ``v - a``, to ``k = steps``.)
    ``loss``, when given, prices a stretch instead of ``a * L**2 / 2`` (:class:`RenewalLoss`:
    the exact loss under restarts; convex in ``L``, so the balanced split and the search hold).
    """
    if steps <= 0 or (loss is None and loss_rate <= 0.0):
        return 0.0
    stretch = _first_order(loss_rate) if loss is None else loss
    if visible_s <= 0.0:
        return _stretches_cost(steps, steps, stretch, 0.0)
    low, high = 1, steps
    while low < high:
        middle = (low + high) // 2
        if _stretches_cost(steps, middle + 1, stretch, visible_s) < _stretches_cost(
            steps, middle, stretch, visible_s
        ):
            low = middle + 1
        else:
            high = middle
    return _stretches_cost(steps, low, stretch, visible_s)


@attrs.frozen
class HorizonVerdict:
    """Expected seconds of the best plan starting now (without this checkpoint's visible cost)
    and of the best plan that waits; ``delay_steps`` is how long that plan waits (``0``: none)."""

    now_s: float
    later_s: float
    delay_steps: int

    @property
    def saving_s(self) -> float:
        """What checkpointing now saves over waiting, before paying its visible cost."""
        return self.later_s - self.now_s


def compare_now_and_later(
    unprotected_steps: float,
    remaining_steps: float,
    loss_rate: float,
    future_visible_s: float,
    loss: StretchLoss | None = None,
) -> HorizonVerdict:
    """Compare checkpointing now with waiting ``s = 1, 2, ...`` steps (or to the end).

    ``unprotected_steps`` is ``C_t / d``; ``remaining_steps`` the steps still to run (rounded to
    whole steps).  Waiting ``s``
    steps costs ``a * (s * u + s**2 / 2)`` plus, unless it reaches the end, a checkpoint and the
    protected rest.  O(sqrt of the cost) iterations: a plan whose own exposure already exceeds the
    best found cannot win.  ``loss``, when given, prices the stretches instead of the first-order
    ``a * (s * u + s**2 / 2)`` (``loss_rate`` then unused).
    """
    m = round(remaining_steps)
    now = protected_cost(m, loss_rate, future_visible_s, loss)
    if m <= 0 or (loss is None and loss_rate <= 0.0):
        return HorizonVerdict(now, now, 0)
    stretch = _first_order(loss_rate) if loss is None else loss
    u = unprotected_steps
    best, best_delay = math.inf, 0
    for s in range(1, m + 1):
        exposure = stretch(u, s)
        if exposure >= best:
            break
        total = exposure + (
            future_visible_s + protected_cost(m - s, loss_rate, future_visible_s, loss) if s < m else 0.0
        )
        if total < best:
            best, best_delay = total, (s if s < m else 0)
    return HorizonVerdict(now, best, best_delay)
