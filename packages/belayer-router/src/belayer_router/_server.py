"""Serving an ASGI app with uvicorn on a socket we bind, so port 0 works and the URL is known."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
import uvicorn

from belayer_router._app import RouterApp, RouterConfig

__all__ = ["bind_socket", "running_router", "serve_asgi", "serving"]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ``port=0`` picks a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def _server(app: Any, log_level: str, lifespan: Literal["on", "off"] = "on") -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        lifespan=lifespan,
        log_level=log_level,
        http="httptools",
        access_log=False,
        timeout_graceful_shutdown=1,
        backlog=4096,
    )
    return uvicorn.Server(config)


async def serve_asgi(app: Any, sock: socket.socket, log_level: str = "warning") -> None:
    """Serve ``app`` on ``sock`` until cancelled (or a signal, when run as the main program)."""
    await _server(app, log_level).serve(sockets=[sock])


@asynccontextmanager
async def serving(
    app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> AsyncIterator[str]:
    """Serve ``app`` in the background for the block; yields its base URL.

    Without ASGI lifespan events: the block ends with a forced exit (open streams must not hold it
    back), and uvicorn skips the lifespan shutdown then, leaving its task pending ("Task was
    destroyed but it is pending!" at exit). Whoever owns the app releases its resources
    (`running_router` closes the router).
    """
    sock = bind_socket(host, port)
    server = _server(app, log_level, lifespan="off")
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # signals are not ours
    bound_host, bound_port = sock.getsockname()[:2]
    async with anyio.create_task_group() as group:
        group.start_soon(server.serve, [sock])
        while not server.started:  # noqa: ASYNC110  (uvicorn offers no started event)
            await anyio.sleep(0.005)
        try:
            yield f"http://{bound_host}:{bound_port}"
        finally:
            server.should_exit = True
            server.force_exit = True
    sock.close()


@asynccontextmanager
async def running_router(
    config: RouterConfig | None = None, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[tuple[str, RouterApp]]:
    """A router served in this process for the block: ``(base_url, app)``."""
    app = RouterApp(config or RouterConfig())
    try:
        async with app.serving_links(), serving(app, host, port) as url:
            yield url, app
    finally:
        with anyio.CancelScope(shield=True):
            await app.aclose()
