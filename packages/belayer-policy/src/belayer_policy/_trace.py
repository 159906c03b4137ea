"""Reading and writing trajectories as a JSONL trace.

Trace format (what ``belayer-grpo train`` writes for agentic runs), one trajectory per line::

    {"response_s": [12.0, 30.5, 8.1], "action_s": [0.4, 2.0, 0.3],
     "checkpoint_s": [0.5, null, 0.6], "checkpoint_kind": ["full", null, "reference"],
     "failures": [{"step": 1, "at": 0.25}],
     "restore_s": [1.9], "task": "calc-1", "node": "host-a", "trajectory_id": "run-g0-s1",
     "meta": {"policy": "adaptive"}}

Per step ``i`` (0-based) of the committed prefix: ``response_s[i]`` the LLM response time,
``action_s[i]`` the environment action time, ``checkpoint_s[i]`` what a full checkpoint taken
after step ``i`` cost (``null`` where none was taken: filled with the trajectory's mean measured
cost of that step's kind; the whole key optional, default 0.5 s).  ``checkpoint_kind[i]``
(optional, since 0.6.0): the kind of that checkpoint (``full``, ``fresh-runtime``, ``reference``),
or the kind one would have taken (envckpt's ``next_checkpoint_kind``); ``null``: unknown, a full
one.  A cheap kind never measured in the trajectory costs its prior (``KIND_PRIORS_S``).  ``failures`` (optional): fail-stop failures observed
at fraction ``at`` of an attempt of step ``step``; the simulator fires each once, in addition to
its random ones.  ``restore_s`` (optional): measured restore times.  ``task``, ``node``,
``trajectory_id`` (strings) and ``meta`` (an object) are optional labels.  Round-1 keys
``response_seconds``, ``action_seconds`` and ``checkpoint_seconds`` are still read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from belayer_policy._errors import PolicyArgumentError, TraceFormatError
from belayer_policy._kinds import FULL, KIND_PRIORS_S, check_kind
from belayer_policy._validate import require_non_negative
from belayer_policy._workload import ScheduledFailure, Trajectory

__all__ = [
    "DEFAULT_TRACE_CHECKPOINT_S",
    "append_trace",
    "fill_checkpoint_costs",
    "load_trace",
    "save_trace",
]

DEFAULT_TRACE_CHECKPOINT_S = 0.5


def _seconds_tuple(name: str, values: Sequence[object]) -> tuple[float, ...]:
    return tuple(require_non_negative(f"{name}[{i}]", v) for i, v in enumerate(values))


_OLD_KEYS = {
    "response_seconds": "response_s",
    "action_seconds": "action_s",
    "checkpoint_seconds": "checkpoint_s",
}
_KEYS = {
    "response_s",
    "action_s",
    "checkpoint_s",
    "checkpoint_kind",
    "failures",
    "restore_s",
    "task",
    "node",
    "trajectory_id",
    "meta",
}


def _checkpoint_kinds(raw: object, n: int) -> list[str | None]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) != n:
        raise PolicyArgumentError(f"checkpoint_kind must be a list of {n} kinds (null where unknown)")
    return [check_kind(v) for v in raw]


def fill_checkpoint_costs(raw: object, n: int, default_s: float, kinds: Sequence[str | None]) -> list[float]:
    """The measured costs, a missing one filled with the mean measured cost of its step's kind (all
    steps one kind without ``kinds``), else the kind's prior (``default_s`` for a full one)."""
    step_kinds = [kind or FULL for kind in kinds] if kinds else [FULL] * n
    if raw is None:
        raw = [None] * n
    if not isinstance(raw, list):
        raise PolicyArgumentError("checkpoint_s must be a list of seconds (null where none was measured)")
    measured: dict[str, list[float]] = {}
    for kind, value in zip(step_kinds, raw, strict=False):
        if value is not None:
            measured.setdefault(kind, []).append(value)
    fill = {
        kind: sum(_seconds_tuple("checkpoint_s", values)) / len(values) for kind, values in measured.items()
    }
    if len(raw) != n:
        return list(raw)  # Trajectory names the length mismatch
    return [
        value if value is not None else fill.get(kind, KIND_PRIORS_S.get(kind, default_s))
        for kind, value in zip(step_kinds, raw, strict=True)
    ]


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
    kinds = _checkpoint_kinds(fields.get("checkpoint_kind"), n)
    checkpoints = fill_checkpoint_costs(fields.get("checkpoint_s"), n, default_checkpoint_s, kinds)
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
        checkpoint_kind=kinds,
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
            if any(kind is not None for kind in t.checkpoint_kind):
                record["checkpoint_kind"] = list(t.checkpoint_kind)
            if t.failures:
                record["failures"] = [{"step": f.step, "at": f.at} for f in t.failures]
            if t.restore_s:
                record["restore_s"] = list(t.restore_s)
            for key, label in (("task", t.task), ("node", t.node)):
                if label is not None:
                    record[key] = label
            out.write(json.dumps(record) + "\n")
