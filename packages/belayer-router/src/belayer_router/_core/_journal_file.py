"""Append-only JSON-lines persistence of the journal, so preserved prefixes survive a restart.

Each line is one operation (``begin``, ``prefix``, ``finish``, ``context``, ``drop_trajectory``);
replaying the file in order rebuilds the journal.  A torn last line (the router died while
writing it) is ignored; a corrupt line elsewhere is a `JournalError`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

import attrs

from belayer_router._errors import JournalError

__all__ = ["DURABILITY_MODES", "Durability", "JournalStore"]

Durability = Literal["none", "group", "fsync"]
DURABILITY_MODES: tuple[Durability, ...] = ("none", "group", "fsync")


@attrs.define
class JournalStore:
    """An open append-only journal file.

    ``durability``: ``"none"`` (every record is flushed to the OS: survives a router crash, not a
    machine crash), ``"group"`` (group commit: a background thread fsyncs whatever was appended at
    most every ``group_commit_s``; a machine crash loses at most that window), ``"fsync"`` (every
    record is fsynced before ``append`` returns).  ``fsync=True`` is the old spelling of
    ``durability="fsync"``.
    """

    path: Path
    fsync: bool = False
    durability: Durability = attrs.field(default="none", validator=attrs.validators.in_(DURABILITY_MODES))
    group_commit_s: float = attrs.field(default=0.01, validator=attrs.validators.gt(0))
    num_fsyncs: int = 0
    _file: IO[bytes] | None = attrs.field(default=None, alias="_file")
    _dirty: threading.Event = attrs.field(factory=threading.Event, alias="_dirty")
    _lock: threading.Lock = attrs.field(factory=threading.Lock, alias="_lock")
    _syncer: threading.Thread | None = attrs.field(default=None, alias="_syncer")
    _sync_error: OSError | None = attrs.field(default=None, alias="_sync_error")

    def __attrs_post_init__(self) -> None:
        if self.fsync:
            self.durability = "fsync"

    def _sync_loop(self) -> None:
        while self._file is not None:
            if not self._dirty.wait(1.0):
                continue
            time.sleep(self.group_commit_s)  # let the group gather
            self._dirty.clear()
            self._fsync()

    def _fsync(self) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                os.fsync(self._file.fileno())
            except OSError as error:  # the background thread cannot raise: the next append or close does
                self._sync_error = error
                return
            self.num_fsyncs += 1

    def _raise_sync_error(self) -> None:
        error, self._sync_error = self._sync_error, None
        if error is not None:
            raise JournalError(
                f"group commit could not fsync journal {self.path} ({error}): records since the "
                "last good fsync may not survive a machine crash; check the disk"
            ) from error

    def read(self) -> Iterator[dict[str, Any]]:
        """Yield every complete operation already in the file, oldest first."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as error:
            raise JournalError(f"cannot read journal {self.path}: {error}") from error
        lines = data.split(b"\n")
        # The last element is b"" for a cleanly ended file, or a torn line: both are skipped.
        for number, line in enumerate(lines[:-1], start=1):
            try:
                op = json.loads(line)
            except ValueError as error:
                raise JournalError(
                    f"journal {self.path} line {number} is corrupt ({error}); move the file away "
                    "to start with an empty journal"
                ) from error
            if not isinstance(op, dict) or "op" not in op:
                raise JournalError(f"journal {self.path} line {number} is not an operation")
            yield op

    def append(self, op: dict[str, Any]) -> None:
        """Write one operation durably enough for the configured guarantee."""
        self._raise_sync_error()
        if self._file is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._drop_torn_tail()
                self._file = self.path.open("ab")
            except OSError as error:
                raise JournalError(f"cannot open journal {self.path} for appending: {error}") from error
            if self.durability == "group":
                self._syncer = threading.Thread(
                    target=self._sync_loop, name="journal-group-commit", daemon=True
                )
                self._syncer.start()
        try:
            with self._lock:
                self._file.write(json.dumps(op, separators=(",", ":")).encode() + b"\n")
                self._file.flush()
                if self.durability == "fsync":
                    os.fsync(self._file.fileno())
                    self.num_fsyncs += 1
        except OSError as error:
            raise JournalError(f"cannot append to journal {self.path}: {error}") from error
        if self.durability == "group":
            self._dirty.set()

    def _drop_torn_tail(self) -> None:
        """Cut a last line left half-written by a crash, so new lines start on a clean line."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            with self.path.open("r+b") as file:
                file.truncate(end)

    def close(self) -> None:
        """Close the file (after a last fsync in group mode); appending again reopens it."""
        if self._file is None:
            return
        if self.durability == "group":
            self._fsync()
        with self._lock:
            self._file.close()
            self._file = None
        if self._syncer is not None:
            self._dirty.set()  # wake the thread so it sees the closed file and ends
            self._syncer.join(5.0)
            self._syncer = None
        self._raise_sync_error()
