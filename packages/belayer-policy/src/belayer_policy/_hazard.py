"""Failure probability of the next step: ``p_t`` from a hazard rate or a fixed per-step value."""

from __future__ import annotations

import math
from typing import Protocol

import attrs

from belayer_policy._validate import non_negative, positive, probability, require_non_negative

__all__ = ["ConstantHazard", "FailureModel", "FixedStepProbability", "OnlineHazard"]


class FailureModel(Protocol):
    """Gives ``p_t``, the probability that the next step of ``duration`` seconds sees a failure."""

    def failure_probability(self, duration_s: float) -> float:
        """Probability of a fail-stop failure during the next ``duration_s`` seconds."""
        ...

    def observe_exposure(self, exposure_s: float) -> None:
        """Record ``exposure_s`` seconds of container lifetime that passed (with or without a failure)."""
        ...

    def observe_failure(self) -> None:
        """Record one observed fail-stop failure."""
        ...


def _hazard_probability(rate: float, duration_s: float) -> float:
    # -expm1(-x) == 1 - exp(-x), without the cancellation for small x.
    return -math.expm1(-rate * require_non_negative("duration_s", duration_s))


@attrs.frozen
class ConstantHazard:
    """Constant hazard ``rate`` (failures per second): ``p_t = 1 - exp(-rate * d_t)``."""

    rate: float = attrs.field(validator=non_negative)

    def failure_probability(self, duration_s: float) -> float:
        """``1 - exp(-rate * duration_s)``."""
        return _hazard_probability(self.rate, duration_s)

    def observe_exposure(self, exposure_s: float) -> None:
        """The rate is given, not learned: nothing to record."""

    def observe_failure(self) -> None:
        """The rate is given, not learned: nothing to record."""


@attrs.frozen
class FixedStepProbability:
    """The same ``probability`` for every step, whatever its duration (fault-injection experiments)."""

    probability: float = attrs.field(validator=probability)

    def failure_probability(self, duration_s: float) -> float:
        """``probability``; ``duration_s`` is only checked."""
        require_non_negative("duration_s", duration_s)
        return self.probability

    def observe_exposure(self, exposure_s: float) -> None:
        """The probability is given, not learned: nothing to record."""

    def observe_failure(self) -> None:
        """The probability is given, not learned: nothing to record."""


@attrs.define
class OnlineHazard:
    """Constant hazard whose rate is estimated online from failures over exposure time.

    ``rate = (prior_failures + failures) / (prior_exposure_s + exposure_s)``: the prior
    acts as pseudo-observations, so the estimate is usable (not zero) before the first failure and
    converges to the observed rate as exposure accumulates.  Default prior: one failure per hour of
    container time.
    """

    prior_failures: float = attrs.field(default=1.0, validator=non_negative)
    prior_exposure_s: float = attrs.field(default=3600.0, validator=positive)
    failures: int = attrs.field(default=0, init=False)
    exposure_s: float = attrs.field(default=0.0, init=False)

    @property
    def rate(self) -> float:
        """Current estimate of the hazard rate, failures per second."""
        return (self.prior_failures + self.failures) / (self.prior_exposure_s + self.exposure_s)

    def failure_probability(self, duration_s: float) -> float:
        """``1 - exp(-rate * duration_s)`` with the current rate estimate."""
        return _hazard_probability(self.rate, duration_s)

    def observe_exposure(self, exposure_s: float) -> None:
        """Add ``exposure_s`` seconds of container lifetime to the exposure."""
        self.exposure_s += require_non_negative("exposure_s", exposure_s)

    def observe_failure(self) -> None:
        """Count one failure."""
        self.failures += 1
