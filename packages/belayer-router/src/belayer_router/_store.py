"""Append-only JSON-lines persistence of the journal, so preserved prefixes survive a restart.

Each line is one operation (``begin``, ``prefix``, ``finish``, ``context``, ``drop_trajectory``);
replaying the file in order rebuilds the journal.  A torn last line (the router died while
writing it) is ignored; a corrupt line elsewhere is a `JournalError`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from belayer_router._errors import JournalError

__all__ = ["JournalStore"]


@attrs.define
class JournalStore:
    """An open append-only journal file; ``fsync=True`` also survives a machine crash."""

    path: Path
    fsync: bool = False
    _file: IO[bytes] | None = attrs.field(default=None, alias="_file")

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
        if self._file is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._drop_torn_tail()
                self._file = self.path.open("ab")
            except OSError as error:
                raise JournalError(f"cannot open journal {self.path} for appending: {error}") from error
        try:
            self._file.write(json.dumps(op, separators=(",", ":")).encode() + b"\n")
            self._file.flush()
            if self.fsync:
                os.fsync(self._file.fileno())
        except OSError as error:
            raise JournalError(f"cannot append to journal {self.path}: {error}") from error

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
        """Close the file (appending again reopens it)."""
        if self._file is not None:
            self._file.close()
            self._file = None
