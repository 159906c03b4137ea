"""Running an ASGI app's lifespan protocol around a block (for the router's own HTTP server)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio

from belayer_router._errors import ServerStartupError

__all__ = ["lifespan"]

_log = logging.getLogger("belayer_router.http")
App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@asynccontextmanager
async def lifespan(app: App) -> AsyncIterator[None]:
    """Run ``app``'s ASGI lifespan around the block (startup before, shutdown after).

    An app that does not speak lifespan (raises on it) is served without; one that reports
    ``lifespan.startup.failed`` raises `ServerStartupError`.
    """
    started, stopped, shutdown = anyio.Event(), anyio.Event(), anyio.Event()
    failure: list[str] = []
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "lifespan.startup"}
        await shutdown.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "lifespan.startup.failed":
            failure.append(str(message.get("message", "")))
        if message["type"].startswith("lifespan.startup."):
            started.set()
        elif message["type"].startswith("lifespan.shutdown."):
            stopped.set()

    async def run() -> None:
        try:
            await app({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}, receive, send)
        except Exception:
            if not started.is_set():
                _log.debug("the ASGI app does not support lifespan; serving it without", exc_info=True)
            else:
                _log.exception("the ASGI app's lifespan failed")
        finally:
            started.set()
            stopped.set()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        await started.wait()
        if failure:  # raised below, outside the task group (not wrapped in an exception group)
            group.cancel_scope.cancel()
        else:
            try:
                yield
            finally:
                shutdown.set()
                with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                    await stopped.wait()
    if failure:
        raise ServerStartupError(
            f"the ASGI app's lifespan startup failed: {failure[0]}; fix what it names and start again"
        )
