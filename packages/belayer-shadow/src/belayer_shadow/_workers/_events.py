"""The JSON event log a slot's processes share, and the state files a supervisor polls.

Every line of the event log is one JSON object `{"time": <unix s>, "source": ..., "event": ...,
...}`, appended with a single `write` on an `O_APPEND` descriptor, so lines from the supervisor,
the main worker and the shadow never interleave. Wall-clock times are comparable across the
processes of one machine; durations are measured with the monotonic clock.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

__all__ = ["EventLog", "read_events", "read_state", "write_state"]


@attrs.define
class EventLog:
    """Appends events to a JSON-lines file (or nowhere, when `path` is None); keeps step timings."""

    path: Path | None
    source: str
    timings: dict[str, float] = attrs.field(factory=dict)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one event (with the current wall-clock time) and return it."""
        record = {"time": time.time(), "source": self.source, "event": event, **fields}
        if self.path is not None:
            line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return record

    @contextmanager
    def step(self, name: str, **fields: Any) -> Iterator[None]:
        """Time a step: emits `<name>` with `duration_s` (and `error` if it raised) when it ends."""
        start = time.monotonic()
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
            raise
        finally:
            duration = time.monotonic() - start
            self.timings[name] = duration
            extra = {} if error is None else {"error": f"{type(error).__name__}: {error}"}
            self.emit(name, duration_s=duration, **fields, **extra)

    def render_metrics(self, prefix: str = "belayer_shadow") -> str:
        """The step timings in the Prometheus text format (gauges, seconds)."""
        lines = [
            f"# HELP {prefix}_step_seconds Duration of the latest run of each timed step.",
            f"# TYPE {prefix}_step_seconds gauge",
        ]
        for name, seconds in sorted(self.timings.items()):
            lines.append(f'{prefix}_step_seconds{{source="{self.source}",step="{name}"}} {seconds:.6f}')
        return "\n".join(lines) + "\n"


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every complete event in a log, oldest first (a torn last line is skipped)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    events: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def write_state(path: Path | None, state: str, **fields: Any) -> None:
    """Publish a worker's state (`standby`, `handover`, `serving`, `failed`) atomically."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"state": state, "pid": os.getpid(), "time": time.time(), **fields}))
    os.replace(tmp, path)


def read_state(path: Path) -> dict[str, Any] | None:
    """The latest state a worker published, or None if it has published none yet."""
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data
