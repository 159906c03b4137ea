"""Trajectories for the simulator: drawn from distributions or read from a JSONL trace (`_trace`)."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import attrs

from belayer_policy._errors import PolicyArgumentError
from belayer_policy._kinds import check_kind
from belayer_policy._validate import non_negative, positive_int, require_non_negative

__all__ = ["ScheduledFailure", "Trajectory", "UniformRange", "Workload"]


def _fraction(_instance: object, attribute: Any, value: Any) -> None:
    number = require_non_negative(attribute.name, value)
    if number >= 1.0:
        raise PolicyArgumentError(f"{attribute.name} must be in [0, 1), got {value!r}")


def _step(_instance: object, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PolicyArgumentError(f"{attribute.name} must be an integer >= 0, got {value!r}")


def _seconds_tuple(name: str, values: Iterable[object]) -> tuple[float, ...]:
    return tuple(require_non_negative(f"{name}[{i}]", v) for i, v in enumerate(values))


@attrs.frozen
class ScheduledFailure:
    """A failure at fraction ``at`` of the wall time of an attempt of step ``step`` (0-based)."""

    step: int = attrs.field(validator=_step)
    at: float = attrs.field(default=0.5, validator=_fraction)


def _floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(values)


def _kinds(values: Iterable[str | None]) -> tuple[str | None, ...]:
    return tuple(values)


def _failures(values: Iterable[ScheduledFailure]) -> tuple[ScheduledFailure, ...]:
    return tuple(values)


@attrs.frozen
class Trajectory:
    """Alternating LLM responses and environment actions, one pair per step.

    ``restore_s`` holds restore times measured when the trajectory was recorded (informative: the
    simulator charges ``SimulationConfig.restore_s``); ``task`` and ``node`` label where it ran,
    so the estimators can learn per task and per node.  ``checkpoint_kind`` (empty, or one per
    step, None where unknown) is the kind of the checkpoint after each step: the simulator tells
    the policy that kind and charges ``checkpoint_s`` of that step.
    """

    response_s: tuple[float, ...] = attrs.field(converter=_floats)
    action_s: tuple[float, ...] = attrs.field(converter=_floats)
    checkpoint_s: tuple[float, ...] = attrs.field(converter=_floats)
    failures: tuple[ScheduledFailure, ...] = attrs.field(default=(), converter=_failures)
    restore_s: tuple[float, ...] = attrs.field(default=(), kw_only=True, converter=_floats)
    task: str | None = attrs.field(default=None, kw_only=True)
    node: str | None = attrs.field(default=None, kw_only=True)
    checkpoint_kind: tuple[str | None, ...] = attrs.field(default=(), kw_only=True, converter=_kinds)

    def __attrs_post_init__(self) -> None:
        n = len(self.response_s)
        if n == 0:
            raise PolicyArgumentError("response_s must hold at least one step")
        for name in ("response_s", "action_s", "checkpoint_s"):
            values = getattr(self, name)
            if len(values) != n:
                raise PolicyArgumentError(f"{name} must have {n} entries (one per step), got {len(values)}")
            _seconds_tuple(name, values)
        _seconds_tuple("restore_s", self.restore_s)
        if self.checkpoint_kind and len(self.checkpoint_kind) != n:
            raise PolicyArgumentError(
                f"checkpoint_kind must have {n} entries (one per step) or none, got {len(self.checkpoint_kind)}"
            )
        for kind in self.checkpoint_kind:
            check_kind(kind)
        for failure in self.failures:
            if failure.step >= n:
                raise PolicyArgumentError(f"failures: step {failure.step} is beyond the {n} steps")

    @property
    def num_steps(self) -> int:
        """Number of steps."""
        return len(self.response_s)

    @property
    def failure_free_s(self) -> float:
        """Rollout time with no failure and no checkpoint."""
        return sum(self.response_s) + sum(self.action_s)


@attrs.frozen
class UniformRange:
    """Seconds drawn uniformly from ``[low, high]``."""

    low: float = attrs.field(validator=non_negative)
    high: float = attrs.field(validator=non_negative)

    def __attrs_post_init__(self) -> None:
        if self.high < self.low:
            raise PolicyArgumentError(f"high must be >= low, got low={self.low!r} high={self.high!r}")

    def draw(self, rng: random.Random) -> float:
        """One sample."""
        return rng.uniform(self.low, self.high)


@attrs.frozen
class Workload:
    """SWE-like trajectories by default: 20 rounds, responses 5-60 s, actions 0.1-10 s, checkpoints
    0.3-1 s."""

    num_steps: int = attrs.field(default=20, validator=positive_int)
    response_s: UniformRange = UniformRange(5.0, 60.0)
    action_s: UniformRange = UniformRange(0.1, 10.0)
    checkpoint_s: UniformRange = UniformRange(0.3, 1.0)

    def draw(self, rng: random.Random) -> Trajectory:
        """One trajectory."""
        steps = [
            (
                self.response_s.draw(rng),
                self.action_s.draw(rng),
                self.checkpoint_s.draw(rng),
            )
            for _ in range(self.num_steps)
        ]
        return Trajectory(
            response_s=[s[0] for s in steps],
            action_s=[s[1] for s in steps],
            checkpoint_s=[s[2] for s in steps],
        )
