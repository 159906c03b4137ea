"""Helpers of tests that run servers as real processes: the JSON lines a command prints at each
start (one per child of a keeper), and whether a process is gone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

__all__ = ["JsonLines", "process_gone"]


class JsonLines:
    """The JSON documents a process prints on its stdout, one per line, read as they come."""

    def __init__(self, process: anyio.abc.Process) -> None:
        if process.stdout is None:
            raise ValueError("the process was started without a stdout pipe")
        self.stream = process.stdout
        self.buffer = b""

    async def next(self, limit_s: float = 120) -> dict[str, Any]:
        """The next document; `TimeoutError` when none comes within `limit_s`."""
        with anyio.fail_after(limit_s):
            while b"\n" not in self.buffer:
                self.buffer += await self.stream.receive()
        line, self.buffer = self.buffer.split(b"\n", 1)
        document: dict[str, Any] = json.loads(line)
        return document


def process_gone(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True
