"""Liveness between a main worker and its shadow: a heartbeat file and a handover flag.

The main worker touches the heartbeat in every scheduling-loop iteration (one `utime` call, and
its pid written once so a shadow knows whom to fence). The shadow polls the file's mtime; the
slot supervisor, which reaps the main, raises the handover flag the moment the main exits.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs

__all__ = ["HandoverFlag", "Heartbeat"]


@attrs.define
class Heartbeat:
    """The heartbeat file of one slot."""

    path: Path = attrs.field(converter=Path)
    _claimed: bool = False

    def touch(self) -> None:
        """Mark the writer alive now (the first call also records the writer's pid)."""
        if not self._claimed:
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(f"{os.getpid()}\n")
            os.replace(tmp, self.path)
            self._claimed = True
        try:
            os.utime(self.path)
        except FileNotFoundError:  # someone removed it: claim it again
            self._claimed = False
            self.touch()

    def age_s(self) -> float | None:
        """Seconds since the last touch, or None if no writer has touched it yet."""
        try:
            mtime_ns = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None
        return max(0.0, (time.time_ns() - mtime_ns) / 1e9)

    def writer_pid(self) -> int | None:
        """The pid of the process that claimed the heartbeat last, if any."""
        try:
            return int(self.path.read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return None


@attrs.define
class HandoverFlag:
    """A file whose existence tells the shadow to take over now."""

    path: Path = attrs.field(converter=Path)

    def raise_(self, reason: str, **fields: Any) -> None:
        """Raise the flag (atomically), saying why."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"reason": reason, "time": time.time(), **fields}))
        os.replace(tmp, self.path)

    def is_raised(self) -> bool:
        """Whether the flag is up."""
        return self.path.exists()

    def read(self) -> dict[str, Any] | None:
        """What the raiser wrote, or None if the flag is down."""
        try:
            data: dict[str, Any] = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None
        return data

    def clear(self) -> None:
        """Lower the flag."""
        self.path.unlink(missing_ok=True)
