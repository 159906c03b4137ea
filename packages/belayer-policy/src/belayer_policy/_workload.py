"""Trajectories for the simulator: drawn from distributions or read from a JSONL trace.

Trace format (what ``belayer-grpo train`` writes for agentic runs), one trajectory per line::

    {"response_s": [12.0, 30.5, 8.1], "action_s": [0.4, 2.0, 0.3],
     "checkpoint_s": [0.5, null, 0.6], "failures": [{"step": 1, "at": 0.25}],
     "restore_s": [1.9], "task": "calc-1", "node": "host-a", "trajectory_id": "run-g0-s1",
     "meta": {"policy": "adaptive"}}

Per step ``i`` (0-based) of the committed prefix: ``response_s[i]`` the LLM response time,
``action_s[i]`` the environment action time, ``checkpoint_s[i]`` what a full checkpoint taken
after step ``i`` cost (``null`` where none was taken: filled with the trajectory's mean measured
cost; the whole key optional, default 0.5 s).  ``failures`` (optional): fail-stop failures observed
at fraction ``at`` of an attempt of step ``step``; the simulator fires each once, in addition to
its random ones.  ``restore_s`` (optional): measured restore times.  ``task``, ``node``,
``trajectory_id`` (strings) and ``meta`` (an object) are optional labels.  Round-1 keys
``response_seconds``, ``action_seconds`` and ``checkpoint_seconds`` are still read.
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
    "DEFAULT_TRACE_CHECKPOINT_S",
    "ScheduledFailure",
    "Trajectory",
    "UniformRange",
    "Workload",
    "append_trace",
    "load_trace",
    "save_trace",
]

DEFAULT_TRACE_CHECKPOINT_S = 0.5


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
    """Alternating LLM responses and environment actions, one pair per step.

    ``restore_s`` holds restore times measured when the trajectory was recorded (informative: the
    simulator charges ``SimulationConfig.restore_s``); ``task`` and ``node`` label where it ran,
    so the estimators can learn per task and per node.
    """

    response_s: tuple[float, ...] = attrs.field(converter=_floats)
    action_s: tuple[float, ...] = attrs.field(converter=_floats)
    checkpoint_s: tuple[float, ...] = attrs.field(converter=_floats)
    failures: tuple[ScheduledFailure, ...] = attrs.field(default=(), converter=_failures)
    restore_s: tuple[float, ...] = attrs.field(default=(), kw_only=True, converter=_floats)
    task: str | None = attrs.field(default=None, kw_only=True)
    node: str | None = attrs.field(default=None, kw_only=True)

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


_OLD_KEYS = {
    "response_seconds": "response_s",
    "action_seconds": "action_s",
    "checkpoint_seconds": "checkpoint_s",
}
_KEYS = {
    "response_s",
    "action_s",
    "checkpoint_s",
    "failures",
    "restore_s",
    "task",
    "node",
    "trajectory_id",
    "meta",
}


def _checkpoint_costs(raw: object, n: int, default_s: float) -> list[float]:
    if raw is None:
        return [default_s] * n
    if not isinstance(raw, list):
        raise PolicyArgumentError("checkpoint_s must be a list of seconds (null where none was measured)")
    measured = [v for v in raw if v is not None]
    fill = sum(_seconds_tuple("checkpoint_s", measured)) / len(measured) if measured else default_s
    return [fill if v is None else v for v in raw]


def _label(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise PolicyArgumentError(f"{key} must be a string")
    return value


def _parse_line(obj: object, default_checkpoint_s: float) -> Trajectory:
    if not isinstance(obj, dict):
        raise PolicyArgumentError("each line must be a JSON object")
    fields: dict[str, Any] = {_OLD_KEYS.get(str(k), str(k)): v for k, v in obj.items()}
    unknown = set(fields) - _KEYS
    if unknown:
        raise PolicyArgumentError(f"unknown keys {sorted(unknown)}; a trace line holds {sorted(_KEYS)}")
    for key in ("response_s", "action_s"):
        if not isinstance(fields.get(key), list):
            raise PolicyArgumentError(f"{key} must be a list of seconds")
    n = len(fields["response_s"])
    checkpoints = _checkpoint_costs(fields.get("checkpoint_s"), n, default_checkpoint_s)
    failures_raw = fields.get("failures", [])
    restores = fields.get("restore_s", [])
    if not isinstance(failures_raw, list) or not isinstance(restores, list):
        raise PolicyArgumentError("failures and restore_s must be lists")
    if fields.get("meta") is not None and not isinstance(fields["meta"], dict):
        raise PolicyArgumentError("meta must be an object")
    failures = []
    for f in failures_raw:
        if not isinstance(f, dict) or "step" not in f:
            raise PolicyArgumentError('each failure must be an object like {"step": 3, "at": 0.5}')
        failures.append(ScheduledFailure(step=f["step"], at=f.get("at", 0.5)))
    return Trajectory(
        fields["response_s"],
        fields["action_s"],
        checkpoints,
        failures,
        restore_s=restores,
        task=_label(fields, "task"),
        node=_label(fields, "node"),
    )


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
            trajectories.append(_parse_line(json.loads(line), DEFAULT_TRACE_CHECKPOINT_S))
        except json.JSONDecodeError as err:
            raise TraceFormatError(f"trace {str(trace)!r} line {number}: not JSON ({err.msg})") from None
        except (PolicyArgumentError, TypeError) as err:
            raise TraceFormatError(f"trace {str(trace)!r} line {number}: {err}") from None
    if not trajectories:
        raise TraceFormatError(f"trace {str(trace)!r} is empty: write one JSON object per trajectory")
    return trajectories


def save_trace(path: str | Path, trajectories: Sequence[Trajectory]) -> None:
    """Write trajectories as a JSONL trace that :func:`load_trace` reads back."""
    _write_trace(path, trajectories, "w")


def append_trace(path: str | Path, trajectories: Sequence[Trajectory]) -> None:
    """Append trajectories to a JSONL trace (created if missing), one line each."""
    _write_trace(path, trajectories, "a")


def _write_trace(path: str | Path, trajectories: Sequence[Trajectory], mode: str) -> None:
    with Path(path).open(mode) as out:
        for t in trajectories:
            record: dict[str, object] = {
                "response_s": list(t.response_s),
                "action_s": list(t.action_s),
                "checkpoint_s": list(t.checkpoint_s),
            }
            if t.failures:
                record["failures"] = [{"step": f.step, "at": f.at} for f in t.failures]
            if t.restore_s:
                record["restore_s"] = list(t.restore_s)
            for key, label in (("task", t.task), ("node", t.node)):
                if label is not None:
                    record[key] = label
            out.write(json.dumps(record) + "\n")
