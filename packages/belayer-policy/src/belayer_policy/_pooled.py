"""Per-task and per-node estimates pooled with the batch-wide ones.

A task that runs out of memory or a node with a flaky disk fails more often, or checkpoints more
slowly, than the rest.  Each label (``task:calc-1``, ``node:host-a``) keeps a *relative* factor
against the shared estimate, shrunk towards 1 by a prior of a few pseudo-observations, so a label
seen once hardly moves and a label seen often gets its own value.  Factors of several labels
multiply (a log-linear model: task effect times node effect).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import attrs

from belayer_policy._estimators import CheckpointCostModel
from belayer_policy._hazard import FailureModel
from belayer_policy._validate import require_non_negative

__all__ = ["CostModel", "HazardView", "KeyTable", "PooledCost"]


class CostModel(Protocol):
    """An online estimate of a cost in seconds."""

    @property
    def estimate(self) -> float:
        """Current estimate in seconds."""
        ...

    def observe(self, cost_s: float) -> None:
        """Add one measured cost."""
        ...

    @property
    def num_observations(self) -> int:
        """Measurements so far."""
        ...

    @property
    def probes_in_flight(self) -> int:
        """Checkpoints started before the first measurement and not finished yet."""
        ...

    @probes_in_flight.setter
    def probes_in_flight(self, value: int) -> None: ...

    @property
    def probe_started_at(self) -> float | None:
        """When the oldest probe in flight started (the trainer's clock)."""
        ...

    @probe_started_at.setter
    def probe_started_at(self, value: float | None) -> None: ...


@attrs.define
class KeyTable:
    """Observed and expected counts per label; ``factor`` is ``(observed + prior) / (expected + prior)``."""

    prior: float = 2.0
    _observed: dict[str, float] = attrs.field(init=False, factory=dict)
    _expected: dict[str, float] = attrs.field(init=False, factory=dict)

    def factor(self, keys: Sequence[str]) -> float:
        """Product of the shrunk factors of ``keys`` (1.0 for labels never seen)."""
        result = 1.0
        for key in keys:
            observed, expected = self._observed.get(key, 0.0), self._expected.get(key, 0.0)
            result *= (observed + self.prior) / (expected + self.prior)
        return result

    def add(self, keys: Sequence[str], *, observed: float = 0.0, expected: float = 0.0) -> None:
        """Count ``observed`` against ``expected`` for every label in ``keys``."""
        for key in keys:
            self._observed[key] = self._observed.get(key, 0.0) + observed
            self._expected[key] = self._expected.get(key, 0.0) + expected


@attrs.define
class HazardView:
    """The shared failure model, scaled by the relative risk of this trajectory's labels.

    Exposure adds, for every label, the failures the shared model expected over it; a failure adds
    one observed.  ``p' = 1 - (1 - p) ** risk``: the hazard rate times the relative risk.
    """

    base: FailureModel
    table: KeyTable
    keys: tuple[str, ...]

    def failure_probability(self, duration_s: float) -> float:
        """The shared ``p`` for ``duration_s`` seconds, scaled by the labels' relative risk."""
        p = self.base.failure_probability(duration_s)
        if p >= 1.0:
            return 1.0
        return -math.expm1(self.table.factor(self.keys) * math.log1p(-p))

    def observe_exposure(self, exposure_s: float) -> None:
        """Record exposure in the shared model and the failures it expected for each label."""
        p = self.base.failure_probability(require_non_negative("exposure_s", exposure_s))
        expected = -math.log1p(-min(p, 1.0 - 1e-12))
        self.base.observe_exposure(exposure_s)
        self.table.add(self.keys, expected=expected)

    def observe_failure(self) -> None:
        """Record one failure in the shared model and for each label."""
        self.base.observe_failure()
        self.table.add(self.keys, observed=1.0)


@attrs.define
class PooledCost:
    """The shared cost estimate times the labels' relative cost (measured over shared estimate)."""

    base: CheckpointCostModel
    table: KeyTable
    keys: tuple[str, ...]

    @property
    def estimate(self) -> float:
        """Shared estimate times the labels' factor."""
        return self.base.estimate * self.table.factor(self.keys)

    @property
    def num_observations(self) -> int:
        """Measurements of the shared estimate."""
        return self.base.num_observations

    @property
    def probes_in_flight(self) -> int:
        """The shared estimate's probes."""
        return self.base.probes_in_flight

    @probes_in_flight.setter
    def probes_in_flight(self, value: int) -> None:
        self.base.probes_in_flight = value

    @property
    def probe_started_at(self) -> float | None:
        """The shared estimate's oldest probe start."""
        return self.base.probe_started_at

    @probe_started_at.setter
    def probe_started_at(self, value: float | None) -> None:
        self.base.probe_started_at = value

    def observe(self, cost_s: float) -> None:
        """Add one measured cost to the shared estimate and its ratio to every label."""
        cost = require_non_negative("cost_s", cost_s)
        shared = self.base.estimate
        self.table.add(self.keys, observed=cost / shared if shared > 0 else 1.0, expected=1.0)
        self.base.observe(cost)
