"""Trajectories for the simulator: drawn from distributions or read from a JSONL trace.

Trace format, one trajectory per line::

    {"response_seconds": [12.0, 30.5], "action_seconds": [0.4, 2.0],
     "checkpoint_seconds": [0.5, 0.6], "failures": [{"step": 1, "at": 0.25}]}

``checkpoint_seconds[i]`` is what a checkpoint taken after step ``i`` costs (optional: default 0.5 s);
``failures`` (optional) are fail-stop failures at fraction ``at`` of an attempt of step ``step``
(0-based), each fired once, in addition to the random ones of the simulator.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from belayer_policy._errors import PolicyArgumentError, TraceFormatError
from belayer_policy._validate import non_negative, positive_int, require_non_negative

__all__ = [
    "DEFAULT_TRACE_CHECKPOINT_SECONDS",
    "ScheduledFailure",
    "Trajectory",
    "UniformRange",
    "Workload",
    "load_trace",
    "save_trace",
]

DEFAULT_TRACE_CHECKPOINT_SECONDS = 0.5


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


def _failures(values: Iterable[ScheduledFailure]) -> tuple[ScheduledFailure, ...]:
    return tuple(values)


@attrs.frozen
class Trajectory:
    """Alternating LLM responses and environment actions, one pair per step."""

    response_seconds: tuple[float, ...] = attrs.field(converter=_floats)
    action_seconds: tuple[float, ...] = attrs.field(converter=_floats)
    checkpoint_seconds: tuple[float, ...] = attrs.field(converter=_floats)
    failures: tuple[ScheduledFailure, ...] = attrs.field(default=(), converter=_failures)

    def __attrs_post_init__(self) -> None:
        n = len(self.response_seconds)
        if n == 0:
            raise PolicyArgumentError("response_seconds must hold at least one step")
        for name in ("response_seconds", "action_seconds", "checkpoint_seconds"):
            values = getattr(self, name)
            if len(values) != n:
                raise PolicyArgumentError(f"{name} must have {n} entries (one per step), got {len(values)}")
            _seconds_tuple(name, values)
        for failure in self.failures:
            if failure.step >= n:
                raise PolicyArgumentError(f"failures: step {failure.step} is beyond the {n} steps")

    @property
    def num_steps(self) -> int:
        """Number of steps."""
        return len(self.response_seconds)

    @property
    def failure_free_seconds(self) -> float:
        """Rollout time with no failure and no checkpoint."""
        return sum(self.response_seconds) + sum(self.action_seconds)


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
    response_seconds: UniformRange = UniformRange(5.0, 60.0)
    action_seconds: UniformRange = UniformRange(0.1, 10.0)
    checkpoint_seconds: UniformRange = UniformRange(0.3, 1.0)

    def draw(self, rng: random.Random) -> Trajectory:
        """One trajectory."""
        steps = [
            (
                self.response_seconds.draw(rng),
                self.action_seconds.draw(rng),
                self.checkpoint_seconds.draw(rng),
            )
            for _ in range(self.num_steps)
        ]
        return Trajectory(
            response_seconds=[s[0] for s in steps],
            action_seconds=[s[1] for s in steps],
            checkpoint_seconds=[s[2] for s in steps],
        )


def _parse_line(obj: object, n_default_ckpt: float) -> Trajectory:
    if not isinstance(obj, dict):
        raise PolicyArgumentError("each line must be a JSON object")
    unknown = set(obj) - {"response_seconds", "action_seconds", "checkpoint_seconds", "failures"}
    if unknown:
        raise PolicyArgumentError(f"unknown keys {sorted(unknown)}")
    for key in ("response_seconds", "action_seconds"):
        if not isinstance(obj.get(key), list):
            raise PolicyArgumentError(f"{key} must be a list of seconds")
    n = len(obj["response_seconds"])
    checkpoints = obj.get("checkpoint_seconds", [n_default_ckpt] * n)
    failures_raw = obj.get("failures", [])
    if not isinstance(checkpoints, list) or not isinstance(failures_raw, list):
        raise PolicyArgumentError("checkpoint_seconds and failures must be lists")
    failures = []
    for f in failures_raw:
        if not isinstance(f, dict) or "step" not in f:
            raise PolicyArgumentError('each failure must be an object like {"step": 3, "at": 0.5}')
        failures.append(ScheduledFailure(step=f["step"], at=f.get("at", 0.5)))
    return Trajectory(obj["response_seconds"], obj["action_seconds"], checkpoints, failures)


def load_trace(path: str | Path) -> list[Trajectory]:
    """Read trajectories from a JSONL trace; blank lines are skipped.

    Raises :class:`TraceFormatError` (a ``ValueError``) naming the file and line for a missing,
    empty or malformed trace.
    """
    trace = Path(path)
    try:
        lines = trace.read_text().splitlines()
    except OSError as err:
        raise TraceFormatError(f"trace {str(trace)!r} cannot be read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise TraceFormatError(
            f"trace {str(trace)!r} is not UTF-8 text (byte {err.start}): write JSONL"
        ) from None
    trajectories = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            trajectories.append(_parse_line(json.loads(line), DEFAULT_TRACE_CHECKPOINT_SECONDS))
        except json.JSONDecodeError as err:
            raise TraceFormatError(f"trace {str(trace)!r} line {number}: not JSON ({err.msg})") from None
        except (PolicyArgumentError, TypeError) as err:
            raise TraceFormatError(f"trace {str(trace)!r} line {number}: {err}") from None
    if not trajectories:
        raise TraceFormatError(f"trace {str(trace)!r} is empty: write one JSON object per trajectory")
    return trajectories


def save_trace(path: str | Path, trajectories: Sequence[Trajectory]) -> None:
    """Write trajectories as a JSONL trace that :func:`load_trace` reads back."""
    with Path(path).open("w") as out:
        for t in trajectories:
            record: dict[str, object] = {
                "response_seconds": list(t.response_seconds),
                "action_seconds": list(t.action_seconds),
                "checkpoint_seconds": list(t.checkpoint_seconds),
            }
            if t.failures:
                record["failures"] = [{"step": f.step, "at": f.at} for f in t.failures]
            out.write(json.dumps(record) + "\n")
