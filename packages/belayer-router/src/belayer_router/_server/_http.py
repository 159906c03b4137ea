"""The router's own HTTP/1.1 server for ASGI apps: an asyncio Protocol and the httptools parser.

It serves any ASGI 3 app (the router's every route, error, lifespan and disconnect semantics
stay), with one extension: ``scope["extensions"]["belayer.write"]`` is a synchronous
``write(body: bytes) -> bool`` that puts one more chunk of a streamed response (after its first
``http.response.body`` went through ``send``) straight onto the connection, with no ASGI message
and no task switch.  It returns False, writing nothing, when it cannot (the transport is paused
for back-pressure, the client is gone, the response is not a chunked one in progress): the caller
then uses ``send`` as usual.  Under another server the extension is absent.

HTTP/1.1 with keep-alive and pipelining (one request at a time per connection, in order),
``Content-Length`` and chunked bodies both ways (an app's own ``transfer-encoding: chunked`` gets
chunk framing), ``Expect: 100-continue`` (no ``100`` once the response has begun).  A malformed
request gets a 400, oversized request line + headers (``MAX_HEAD_BYTES``) a 431, a request head not
complete within ``head_timeout_s`` a 408, then the connection is closed; a response the app left
unfinished closes it.  A connection idle (no request running, none begun) for ``keep_alive_s``
is closed, as uvicorn does after 5 s.  A client that disconnects gets its app a
``http.disconnect`` from ``receive``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import http
import logging
import socket
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httptools

from belayer_router._errors import ServerConfigError
from belayer_router._wire._protocol import KEEP_ALIVE_S  # an idle connection is closed

__all__ = ["HEAD_TIMEOUT_S", "KEEP_ALIVE_S", "MAX_HEAD_BYTES", "HttpServer"]

MAX_HEAD_BYTES = 64 * 1024  # request line + headers
HEAD_TIMEOUT_S = 30.0  # a request line + headers must be complete this long after their first byte
_HIGH_WATER = 256 * 1024  # body bytes buffered for the app before reading pauses
_LINGER_S = 2.0  # a connection closed on an error drains what the client still sends this long
_DISCONNECT = {"type": "http.disconnect"}
_log = logging.getLogger("belayer_router.http")
App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class _HeadTooLarge(Exception):
    pass


@functools.cache
def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode("latin-1"))


def _address(name: Any) -> tuple[str, int] | None:
    return (str(name[0]), int(name[1])) if isinstance(name, tuple) and len(name) >= 2 else None


def _plain(status: int, text: str) -> bytes:
    body = text.encode()
    return (
        _status_line(status)
        + b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        + b"content-length: %d\r\n\r\n%b" % (len(body), body)
    )


class _Cycle:
    """One request and its response on a connection."""

    def __init__(self, conn: _Connection, scope: dict[str, Any], keep_alive: bool, expect: bool) -> None:
        self.conn, self.scope, self.keep_alive, self.expect = conn, scope, keep_alive, expect
        self.body: list[bytes] = []
        self.body_size = 0
        self.more_body = True  # the request body is not complete yet
        self.delivered = False  # the app has received the last body message
        self.waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self.started = False  # http.response.start received
        self.head_written = False
        self.complete = False  # the whole response was sent
        self.chunked = False
        self.head = scope["method"] == "HEAD"
        self.status = 200
        self.headers: list[tuple[bytes, bytes]] = []
        scope["extensions"] = {"belayer.write": self.write}

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        """ASGI ``receive``: body messages, then ``http.disconnect`` once the client is gone."""
        while True:
            if self.disconnected or self.complete:
                return _DISCONNECT
            if self.body or (not self.more_body and not self.delivered):
                body = b"".join(self.body) if len(self.body) != 1 else self.body[0]
                self.body.clear()
                self.body_size = 0
                self.delivered = not self.more_body
                self.conn.resume_reading()
                return {"type": "http.request", "body": body, "more_body": self.more_body}
            if self.expect and not self.delivered and not self.head_written:
                self.expect = False
                self.conn.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if self.more_body:
                self.conn.resume_reading()
            self.waiter = self.conn.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def _write_head(self, body: bytes, more: bool) -> None:
        names = {name.lower() for name, _ in self.headers}
        extra = b""
        encoding = [v.lower() for n, v in self.headers if n.lower() == b"transfer-encoding"]
        if encoding and encoding[-1].rsplit(b",", 1)[-1].strip() == b"chunked":  # the app's own
            if self.scope["http_version"] == "1.1":
                self.chunked = True  # framed here, as the header says
            else:  # an HTTP/1.0 client reads no chunks: the body ends with the connection
                self.headers = [(n, v) for n, v in self.headers if n.lower() != b"transfer-encoding"]
                self.keep_alive = False
        elif b"content-length" not in names and b"transfer-encoding" not in names:
            if not more:
                extra = b"content-length: %d\r\n" % len(body)
            elif self.scope["http_version"] == "1.1":
                self.chunked = True
                extra = b"transfer-encoding: chunked\r\n"
            else:
                self.keep_alive = False  # an HTTP/1.0 stream ends with the connection
        if not self.keep_alive:
            extra += b"connection: close\r\n"
        lines = [b"%s: %s\r\n" % (name, value) for name, value in self.headers]
        self.conn.transport.write(b"".join([_status_line(self.status), *lines, extra, b"\r\n"]))
        self.head_written = True

    async def send(self, message: dict[str, Any]) -> None:
        """ASGI ``send``: a response start, then body messages (written as they come)."""
        kind = message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self.status = message["status"]
            self.headers = [(bytes(n), bytes(v)) for n, v in message.get("headers", ())]
            if any(n.lower() == b"connection" and v.lower() == b"close" for n, v in self.headers):
                self.keep_alive = False
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if not self.started or self.complete:
            raise RuntimeError("http.response.body before http.response.start or after the last body")
        if self.disconnected:
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        transport = self.conn.transport
        if not self.head_written:
            self._write_head(body, more)
        if body and not self.head:
            transport.write(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)
        if not more:
            if self.chunked and not self.head:
                transport.write(b"0\r\n\r\n")
            self.complete = True
            self.wake()
        if self.conn.paused:
            await self.conn.drain()

    def write(self, body: bytes) -> bool:
        """The ``belayer.write`` extension: one more chunk now, or False (use ``send``)."""
        conn = self.conn
        if not self.chunked or self.complete or self.disconnected or conn.paused or self.head:
            return False
        if body:
            conn.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


class _Connection(asyncio.Protocol):
    """One client connection: parse requests, run them one at a time in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self.cycles: collections.deque[_Cycle] = collections.deque()  # [0] runs, the rest wait
        self.task: asyncio.Task[None] | None = None
        self.paused = False  # writing, by the transport (back-pressure)
        self.reading_paused = False
        self.drained: asyncio.Future[None] | None = None
        self.closed = False
        self.bad: bytes | None = None  # an error answer to send once the requests before it are done
        self.lingering = False  # closing: what the client still sends is read and dropped
        self.upgraded = False  # the client asked for an upgrade: nothing after it is HTTP
        self.url = b""
        self.head_size = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.in_head = False  # a request head has begun and is not complete yet
        self.timer: asyncio.TimerHandle | None = None  # the idle or the head timeout

    # Timeouts

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _idle(self) -> None:
        """Wait ``keep_alive_s`` for the next request (nothing running, nothing begun)."""
        if not self.closed and not self.lingering and not self.cycles and not self.in_head:
            self._arm(self.server.keep_alive_s, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self.timer = None
        if not self.closed and not self.lingering and not self.cycles and not self.in_head:
            self.transport.close()

    def _head_timeout(self) -> None:
        self.timer = None
        if not self.closed and not self.lingering and self.in_head and self.bad is None:
            self._refuse(408, f"request line and headers not received within {self.server.head_timeout_s} s")

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        self._idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._disarm()
        self.server.connections.discard(self)
        for cycle in self.cycles:
            cycle.disconnected = True
            cycle.wake()
        self._wake_drain()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None

    async def drain(self) -> None:
        if self.paused and not self.closed:
            if self.drained is None:
                self.drained = self.loop.create_future()
            await self.drained

    def pause_reading(self) -> None:
        if not self.reading_paused and not self.closed:
            self.reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read on, unless a pipelined request waits its turn or an error answer is due."""
        if self.reading_paused and not self.closed and self.bad is None and len(self.cycles) <= 1:
            self.reading_paused = False
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        if self.bad is not None or self.lingering or self.upgraded:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # not supported: served as plain HTTP, then closed
            self.upgraded = True
            if self.cycles:
                self.cycles[-1].keep_alive = False
            else:
                self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as error:
            if isinstance(error.__context__, _HeadTooLarge):
                self._refuse(431, f"request line and headers exceed {MAX_HEAD_BYTES} bytes")
            else:
                self._refuse(400, f"malformed HTTP request: {error}")

    def _refuse(self, status: int, text: str) -> None:
        """Answer ``status`` after the requests parsed before the bad one, then close."""
        self.bad = _plain(status, text)
        self.pause_reading()
        if self.cycles and self.cycles[-1].more_body:  # the bad bytes are in this request's body
            if len(self.cycles) > 1:
                self.cycles.pop()  # not started yet: dropped
            else:  # running: its app sees the client gone; the answer is the error
                cycle = self.cycles[0]
                cycle.disconnected = True
                cycle.wake()
                if not cycle.started:
                    self._answer_bad()
                else:
                    self.linger()
                return
        if not self.cycles:
            self._answer_bad()

    def _answer_bad(self) -> None:
        if self.bad is not None and not self.closed:
            self.transport.write(self.bad)
            self.linger()

    def linger(self) -> None:
        """Close after what was written, reading (and dropping) what the client still sends for a
        while: closing with unread bytes would reset the connection and lose the answer."""
        if self.closed or self.lingering:
            return
        self.lingering = True
        self._disarm()
        try:
            if not self.transport.can_write_eof():
                raise OSError("no half-close on this transport")
            self.transport.write_eof()
        except OSError:  # e.g. the peer is already gone (ENOTCONN): nothing to drain
            self.transport.close()
            return
        self.reading_paused = False
        self.transport.resume_reading()
        self.loop.call_later(_LINGER_S, self.transport.close)

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.url, self.head_size, self.headers = b"", 0, []
        self.in_head = True
        self._arm(self.server.head_timeout_s, self._head_timeout)

    def _grow(self, size: int) -> None:
        self.head_size += size
        if self.head_size > MAX_HEAD_BYTES:
            raise _HeadTooLarge

    def on_url(self, url: bytes) -> None:
        self._grow(len(url))
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._grow(len(name) + len(value) + 4)
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._disarm()
        parsed = httptools.parse_url(self.url)
        raw_path = parsed.path
        path = raw_path.decode("latin-1")
        if "%" in path:
            path = urllib.parse.unquote(path)
        version = self.parser.get_http_version()
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": _address(self.transport.get_extra_info("sockname")),
            "client": _address(self.transport.get_extra_info("peername")),
            "scheme": "http",
            "method": self.parser.get_method().decode("ascii"),
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "headers": self.headers,
        }
        expect = any(n == b"expect" and v.lower() == b"100-continue" for n, v in self.headers)
        keep_alive = version == "1.1" and self.parser.should_keep_alive()
        self.cycles.append(_Cycle(self, scope, keep_alive, expect))
        if len(self.cycles) == 1:
            self._start()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycles[-1]
        cycle.body.append(body)
        cycle.body_size += len(body)
        if cycle.body_size > _HIGH_WATER:
            self.pause_reading()
        cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self.cycles[-1]
        cycle.more_body = False
        cycle.wake()
        if len(self.cycles) > 1:
            self.pause_reading()  # pipelined: read on when the requests before it are answered

    # Running the app

    def _start(self) -> None:
        self.task = self.loop.create_task(self._run(self.cycles[0]))
        self.server.tasks.add(self.task)
        self.task.add_done_callback(self.server.tasks.discard)

    async def _run(self, cycle: _Cycle) -> None:
        try:
            await self.server.app(cycle.scope, cycle.receive, cycle.send)
        except Exception:
            _log.exception("the ASGI app failed on %s %s", cycle.scope["method"], cycle.scope["path"])
        finally:
            self._done(cycle)

    def _done(self, cycle: _Cycle) -> None:
        if self.closed or cycle.disconnected:  # gone, or refused mid-body (its answer is written)
            self.linger()
            return
        if not cycle.complete:
            if not cycle.started:
                self.transport.write(_plain(500, "internal server error"))
            self.linger()  # a response cut short: the client must see the end
            return
        if not cycle.keep_alive or cycle.more_body:  # a body the app did not read: cannot go on
            self.linger()
            return
        self.cycles.popleft()
        if self.cycles:
            self._start()
        elif self.bad is not None:
            self._answer_bad()
        else:
            self._idle()
        self.resume_reading()


class HttpServer:
    """Serves an ASGI app on listening sockets; see the module docstring."""

    def __init__(
        self, app: App, keep_alive_s: float = KEEP_ALIVE_S, head_timeout_s: float = HEAD_TIMEOUT_S
    ) -> None:
        """``keep_alive_s``: an idle connection is closed after it; ``head_timeout_s``: a request
        head not complete this long after its first byte gets a 408 and the connection closes."""
        if keep_alive_s <= 0 or head_timeout_s <= 0:
            raise ServerConfigError(
                f"keep_alive_s ({keep_alive_s}) and head_timeout_s ({head_timeout_s}) must be > 0 seconds"
            )
        self.app = app
        self.keep_alive_s, self.head_timeout_s = keep_alive_s, head_timeout_s
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.servers: list[asyncio.Server] = []

    async def listen(self, sock: socket.socket) -> None:
        """Start accepting connections on ``sock`` (already bound and listening)."""
        loop = asyncio.get_running_loop()
        self.servers.append(await loop.create_server(lambda: _Connection(self), sock=sock, backlog=4096))

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop accepting; let running requests end for ``grace_s`` s, then cut them."""
        for server in self.servers:
            server.close()
        for conn in list(self.connections):
            if conn.task is None or conn.task.done():
                conn.transport.close()
        if self.tasks and grace_s > 0:
            await asyncio.wait(list(self.tasks), timeout=grace_s)
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=grace_s + 5)
        for conn in list(self.connections):
            conn.transport.close()
