"""The router's link to a worker: one streamed ``POST /generate`` over plain HTTP/1.1.

httpx parses a streamed response in Python (h11) on every chunk; at one token per chunk and
hundreds of streams that was most of the router's CPU per token (issue 15).  This link writes the
request itself and feeds the response bytes to httptools' C parser, which de-chunks the body; it
yields the body's complete lines.  One connection per attempt (``Connection: close``): the
connect costs once per request, not per token.  A read that waits longer than
``read_timeout_s`` (a hung worker) breaks the stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import anyio
import anyio.abc
import httptools

from belayer_router._errors import WorkerStreamError
from belayer_router._wire._response import ResponseBody

__all__ = ["WorkerLink", "open_link"]

_READ_BYTES = 65536


def _request_head(url: str, length: int) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise WorkerStreamError(f"worker URL {url!r} is not a plain http:// URL")
    host, port = parts.hostname, parts.port or 80
    path = (parts.path.rstrip("/") or "") + "/generate"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: application/x-ndjson\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n"
    )
    return host, port, head.encode("ascii")


@asynccontextmanager
async def open_link(
    url: str, body: bytes, *, connect_timeout_s: float, read_timeout_s: float, max_line_bytes: int
) -> AsyncIterator[WorkerLink]:
    """Connect to the worker at ``url``, send ``body`` to its ``/generate``; yield the `WorkerLink`."""
    host, port, head = _request_head(url, len(body))
    with anyio.fail_after(connect_timeout_s):
        stream = await anyio.connect_tcp(host, port)
    async with stream:
        await stream.send(head + body)
        yield WorkerLink(url, stream, read_timeout_s, max_line_bytes)


class WorkerLink:
    """The answer of one worker request, read as batches of complete NDJSON lines."""

    def __init__(
        self, url: str, stream: anyio.abc.SocketStream, read_timeout_s: float, max_line_bytes: int
    ) -> None:
        self.url, self.stream = url, stream
        self.read_timeout_s, self.max_line_bytes = read_timeout_s, max_line_bytes
        self.response = ResponseBody()
        self.parser = httptools.HttpResponseParser(self.response)
        self.pending = b""
        self.checked = False  # the status code, once the headers are in

    async def lines(self) -> list[bytes] | None:
        """The next complete lines of the body (without newlines, maybe none); None at its end.

        Raises `WorkerStreamError` for a non-200 answer, a malformed response, a line over
        ``max_line_bytes``, a read slower than ``read_timeout_s``, or a body cut before its end;
        a connection error (`OSError`) propagates as it is.
        """
        response = self.response
        while not response.body:
            if response.done:
                if self.pending:
                    last, self.pending = self.pending, b""
                    return [last]
                return None
            with anyio.move_on_after(self.read_timeout_s) as scope:
                data = await self._receive()
            if scope.cancelled_caught:
                raise WorkerStreamError(f"worker {self.url} sent nothing for {self.read_timeout_s:g} s")
            self._feed(data)
        chunk = b"".join(response.body) if len(response.body) > 1 else response.body[0]
        response.body.clear()
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        if len(self.pending) > self.max_line_bytes:
            raise WorkerStreamError(f"worker {self.url} sent a line over {self.max_line_bytes} bytes")
        return lines

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive(_READ_BYTES)
        except anyio.EndOfStream:
            if self.response.done:
                return b""
            raise WorkerStreamError(f"worker {self.url} closed the connection mid-answer") from None

    def _feed(self, data: bytes) -> None:
        if not data:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            raise WorkerStreamError(f"worker {self.url} sent a malformed HTTP answer: {error}") from error
        if self.response.headers_done and not self.checked:
            self.checked = True
            status = self.parser.get_status_code()
            if status != 200:
                raise WorkerStreamError(f"worker {self.url} answered {status} (not 200); see its log")
