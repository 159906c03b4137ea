"""Liveness between a main worker and its shadow: a heartbeat file and a handover flag.

The main worker's stepping thread touches the heartbeat in every iteration in which its event loop
has run too (one `utime` call, and its pid written once so a shadow knows whom to fence): a stuck
step or a stuck event loop both let it go stale. The shadow polls the file's mtime; the
slot supervisor, which reaps the main, raises the handover flag the moment the main exits.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs

__all__ = ["HandoverFlag", "HangDetector", "Heartbeat"]


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
class HangDetector:
    """Decides from successive heartbeat ages whether the main worker hangs.

    Two guards keep a loaded machine from passing for a hang: a heartbeat counts as stale only
    after it has been seen fresh since standby began (a main that was just promoted and is busy
    re-filling its KV cache is not hung), unless it stays stale past ``hard_factor`` times the
    threshold; and a poll that itself came late by half the threshold or more (the shadow was
    starved of CPU, so the main probably was too) never decides, it only waits for the next one.
    """

    stale_s: float
    poll_s: float
    hard_factor: float = 10.0
    _seen_fresh: bool = False
    _last_poll: float | None = None

    def is_hung(self, age_s: float | None, now: float) -> bool:
        """Feed one poll (`age_s` from `Heartbeat.age_s`, `now` monotonic); True means hang."""
        late = 0.0 if self._last_poll is None else now - self._last_poll - self.poll_s
        self._last_poll = now
        if age_s is None:
            return False
        if age_s <= self.stale_s:
            self._seen_fresh = True
            return False
        if late >= self.stale_s / 2:
            return False
        return self._seen_fresh or age_s > self.stale_s * self.hard_factor


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
