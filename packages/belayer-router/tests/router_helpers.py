"""Names shared by the router tests and their conftest fixtures."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.abc

ADMIN_TOKEN = "tok"  # the admin token of the routers the `router_process` fixture starts
StartRouter = Callable[..., Awaitable[tuple[anyio.abc.Process, str]]]  # what `router_process` yields


async def exchange(address: tuple[str, int], data: bytes, limit_s: float = 60) -> bytes:
    """Send ``data`` on a fresh connection, then read until the server closes it."""
    with anyio.fail_after(limit_s):
        async with await anyio.connect_tcp(*address) as stream:
            await stream.send(data)
            received = b""
            while True:
                try:
                    received += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return received


async def read_stderr(process: anyio.abc.Process, limit_s: float = 60) -> bytes:
    """Everything ``process`` wrote to its stderr pipe (read until it closes)."""
    assert process.stderr is not None
    stderr = b""
    with anyio.fail_after(limit_s):
        while True:
            try:
                stderr += await process.stderr.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return stderr
