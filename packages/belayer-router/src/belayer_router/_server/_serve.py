"""Serving an ASGI app (uvicorn, or the router's own `HttpServer`) on a socket we bind, so port 0
works and the URL is known."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
import uvicorn

from belayer_router._errors import ServerConfigError
from belayer_router._server._app import RouterApp, RouterConfig
from belayer_router._server._control import WeightLoader
from belayer_router._server._http import KEEP_ALIVE_S, HttpServer
from belayer_router._server._lifespan import lifespan

__all__ = ["SERVERS", "bind_socket", "choose_server", "running_router", "serve_asgi", "serving"]


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; ``port=0`` picks a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


SERVERS = ("uvicorn", "belayer")
Server = Literal["uvicorn", "belayer"]


def choose_server(server: str | None = None) -> Server:
    """``server``, else ``$BELAYER_ROUTER_SERVER``, else ``"uvicorn"``; checked."""
    choice = server if server is not None else os.environ.get("BELAYER_ROUTER_SERVER") or "uvicorn"
    if choice == "uvicorn":
        return "uvicorn"
    if choice == "belayer":
        return "belayer"
    raise ServerConfigError(
        f"unknown HTTP server {choice!r} (argument or $BELAYER_ROUTER_SERVER); use one of {SERVERS}"
    )


def _uvicorn(
    app: Any, log_level: str, keep_alive_s: float, lifespan: Literal["on", "off"] = "on"
) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        lifespan=lifespan,
        log_level=log_level,
        http="httptools",
        access_log=False,
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # seconds for call_later: a float works
        timeout_graceful_shutdown=1,
        backlog=4096,
    )
    return uvicorn.Server(config)


async def serve_asgi(
    app: Any,
    sock: socket.socket,
    log_level: str = "warning",
    server: str | None = None,
    keep_alive_s: float = KEEP_ALIVE_S,
) -> None:
    """Serve ``app`` on ``sock`` until cancelled (or a signal, when run as the main program).

    ``server``: ``"uvicorn"`` or ``"belayer"`` (the router's own HTTP/1.1 server, `HttpServer`);
    default ``$BELAYER_ROUTER_SERVER`` or uvicorn.  Both run the app's ASGI lifespan.  Both close a
    keep-alive connection idle for ``keep_alive_s`` (default 5 s); the belayer server also answers
    a request head not complete within `HEAD_TIMEOUT_S` (30 s) with a 408.
    """
    if choose_server(server) == "uvicorn":
        cutter = _Cutter(app)
        uvicorn_server = _uvicorn(cutter, log_level, keep_alive_s)
        # Our own signal handling: uvicorn's re-raises a captured SIGTERM once it has shut down,
        # and the process would end by it instead of returning (exit code 130, the CLI contract).
        uvicorn_server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
        async with anyio.create_task_group() as group:

            async def stop_on_signal() -> None:
                await _until_signal()
                uvicorn_server.should_exit = True
                await anyio.sleep(CUT_AFTER_S)
                cutter.cut()

            group.start_soon(stop_on_signal)
            await uvicorn_server.serve(sockets=[sock])
            group.cancel_scope.cancel()
        return
    logging.getLogger("belayer_router.http").setLevel(log_level.upper())
    http_server = HttpServer(app, keep_alive_s)
    async with lifespan(app):
        await http_server.listen(sock)
        try:
            await _until_signal()
        finally:
            with anyio.CancelScope(shield=True):
                await http_server.close(grace_s=1.0)


CUT_AFTER_S = 0.7  # uvicorn cancels what still runs 1 s into its shutdown (timeout_graceful_shutdown)
CUT_SEND_S = 0.1  # how long a cut response's last chunk may wait for a client that does not read


class _Cutter:
    """uvicorn's side of a clean shutdown: the requests still running shortly before uvicorn's
    grace period ends are cut here, each through its own cancel scope, and their responses ended
    (a started stream gets its last, empty chunk: the client sees the stream end without a finish
    event and resumes, as after any break; one not started gets a 503).  uvicorn itself would
    cancel their tasks and log each one's CancelledError as an "Exception in ASGI application"
    traceback.  The belayer server cuts its requests itself (`HttpServer.close`)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.running: set[anyio.CancelScope] = set()

    def cut(self) -> None:
        for scope in list(self.running):
            scope.cancel()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = [False, False]  # response started, response complete

        async def tracked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                state[0] = True
            elif not message.get("more_body", False):
                state[1] = True
            await send(message)

        with anyio.CancelScope() as cancel:
            self.running.add(cancel)
            try:
                await self.app(scope, receive, tracked)
            finally:
                self.running.discard(cancel)
        if cancel.cancelled_caught and not state[1]:
            # The connection may be gone already, or its client may not read (the last chunk would
            # wait for room until uvicorn cancels it): give up after a moment, uvicorn closes it.
            with contextlib.suppress(Exception), anyio.move_on_after(CUT_SEND_S):
                if state[0]:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                else:
                    body = b'{"error": {"message": "the router is shutting down; retry", "status": 503}}'
                    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
                    await send({"type": "http.response.start", "status": 503, "headers": headers})
                    await send({"type": "http.response.body", "body": body})


async def _until_signal() -> None:
    """Return at SIGINT or SIGTERM (on the main thread; elsewhere wait to be cancelled)."""
    if threading.current_thread() is threading.main_thread():
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                return
    await anyio.sleep_forever()


@asynccontextmanager
async def serving(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    server: str | None = None,
    keep_alive_s: float = KEEP_ALIVE_S,
    sock: socket.socket | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` in the background for the block; yields its base URL.

    ``server`` and ``keep_alive_s`` as in `serve_asgi`; ``sock``: a listening socket bound
    already (a keeper's, which outlives this server), used instead of binding ``host:port``; it
    is closed at the end like one bound here (the keeper holds its own descriptor).  Without ASGI lifespan events: the block ends with a forced
    exit (open streams must not hold it back); under uvicorn the lifespan shutdown is skipped
    then, leaving its task pending ("Task was destroyed but it is pending!" at exit). Whoever
    owns the app releases its resources (`running_router` closes the router).
    """
    choice = choose_server(server)
    if sock is None:
        sock = bind_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    if choice == "belayer":
        http_server = HttpServer(app, keep_alive_s)
        try:
            await http_server.listen(sock)
            yield f"http://{bound_host}:{bound_port}"
        finally:
            with anyio.CancelScope(shield=True):
                await http_server.close(grace_s=0)
            sock.close()
        return
    uvicorn_server = _uvicorn(app, log_level, keep_alive_s, lifespan="off")
    uvicorn_server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]  # signals are not ours
    async with anyio.create_task_group() as group:
        group.start_soon(uvicorn_server.serve, [sock])
        while not uvicorn_server.started:  # noqa: ASYNC110  (uvicorn offers no started event)
            await anyio.sleep(0.005)
        try:
            yield f"http://{bound_host}:{bound_port}"
        finally:
            uvicorn_server.should_exit = True
            uvicorn_server.force_exit = True
    sock.close()


@asynccontextmanager
async def running_router(
    config: RouterConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    server: str | None = None,
    weight_loader: WeightLoader | None = None,
    sock: socket.socket | None = None,
) -> AsyncIterator[tuple[str, RouterApp]]:
    """A router served in this process for the block: ``(base_url, app)``; ``server`` as in
    `serve_asgi`; ``weight_loader`` as in `RouterApp` (the control plane's weight updates);
    ``sock`` as in `serving` (a socket bound already, instead of ``host:port``)."""
    app = RouterApp(config or RouterConfig(), weight_loader=weight_loader)
    try:
        async with app.serving_links(), serving(app, host, port, server=server, sock=sock) as url:
            yield url, app
    finally:
        with anyio.CancelScope(shield=True):
            await app.aclose()
