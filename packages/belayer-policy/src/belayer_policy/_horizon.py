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
weight of the batch's critical path (the expected largest loss among ``n`` trajectories).
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import attrs

__all__ = ["HorizonVerdict", "batch_step_hazard", "compare_now_and_later", "protected_cost"]


@functools.cache
def _expected_max_normal(n: int) -> float:
    """Expected largest of ``n`` standard normal samples (Blom's approximation)."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def batch_step_hazard(step_probability: float, total_steps: float, batch_size: int) -> float:
    """Per-step failure weight of the batch's critical path.

    One trajectory of ``total_steps`` steps sees ``mu = total_steps * -log(1 - p)`` failures in
    expectation; a failure costs a uniform fraction of the stretch it hits.  The batch pays the
    largest such loss among ``batch_size`` trajectories: at most ``mu / 2`` stretches for one
    trajectory, ``g(n mu) = 1 - (1 - e^{-n mu}) / (n mu)`` stretches when failures are rare (the largest
    of a Poisson number of uniforms), ``mu / 2 + z_n * sqrt(mu / 3)`` when each trajectory fails
    several times (the largest of ``n`` compound sums, ``z_n`` the expected largest of ``n`` normals).
    The result is spread back over the steps, ``2 * E[largest] / total_steps``, so that a single
    trajectory (``batch_size == 1``) gets its own rate ``-log(1 - p)`` back.
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
        largest = max(largest, rare, frequent)
    return 2.0 * largest / total_steps


def _stretches_cost(steps: int, k: int, loss_rate: float, visible_s: float) -> float:
    # k stretches as equal as whole steps allow: r of length q + 1, k - r of length q.
    q, r = divmod(steps, k)
    return (k - 1) * visible_s + loss_rate * ((k - r) * q * q + r * (q + 1) * (q + 1)) / 2.0


def protected_cost(steps: int, loss_rate: float, visible_s: float) -> float:
    """Least expected cost (seconds) of ``steps`` whole steps that start right after a ready checkpoint.

    ``loss_rate`` is ``a = h * d``; future checkpoints cost ``visible_s`` each and fall on step
    boundaries: ``min over k in 1..steps`` of ``(k - 1) * visible_s`` plus ``a * L**2 / 2`` over the
    ``k`` stretches of whole steps (as equal as possible).  That cost is convex in ``k`` (the sum of
    squares of a balanced partition is), so a binary search on its slope finds the exact minimum in
    O(log steps).  (The continuous optimum ``steps * sqrt(a / 2v)`` is not enough: once stretches are
    one or two steps long the whole-step cost falls linearly, with slope ``v - a``, to ``k = steps``.)
    """
    if steps <= 0 or loss_rate <= 0.0:
        return 0.0
    if visible_s <= 0.0:
        return _stretches_cost(steps, steps, loss_rate, 0.0)
    low, high = 1, steps
    while low < high:
        middle = (low + high) // 2
        if _stretches_cost(steps, middle + 1, loss_rate, visible_s) < _stretches_cost(
            steps, middle, loss_rate, visible_s
        ):
            low = middle + 1
        else:
            high = middle
    return _stretches_cost(steps, low, loss_rate, visible_s)


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
    unprotected_steps: float, remaining_steps: float, loss_rate: float, future_visible_s: float
) -> HorizonVerdict:
    """Compare checkpointing now with waiting ``s = 1, 2, ...`` steps (or to the end).

    ``unprotected_steps`` is ``C_t / d``; ``remaining_steps`` the steps still to run (rounded to
    whole steps).  Waiting ``s``
    steps costs ``a * (s * u + s**2 / 2)`` plus, unless it reaches the end, a checkpoint and the
    protected rest.  O(sqrt of the cost) iterations: a plan whose own exposure already exceeds the
    best found cannot win.
    """
    m = round(remaining_steps)
    now = protected_cost(m, loss_rate, future_visible_s)
    if m <= 0 or loss_rate <= 0.0:
        return HorizonVerdict(now, now, 0)
    u = unprotected_steps
    best, best_delay = math.inf, 0
    for s in range(1, m + 1):
        exposure = loss_rate * (s * u + s * s / 2.0)
        if exposure >= best:
            break
        total = exposure + (
            future_visible_s + protected_cost(m - s, loss_rate, future_visible_s) if s < m else 0.0
        )
        if total < best:
            best, best_delay = total, (s if s < m else 0)
    return HorizonVerdict(now, best, best_delay)
