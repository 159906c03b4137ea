"""`RouterClient(multiplex=True)`: every generation stream of one client on ONE client link.

The link is one long-lived ``POST /client-link`` (plain HTTP/1.1, chunked both ways, `_wire._frames`
frames inside): each generation is an ``OPEN`` on it, the router answers with ``TOKENS`` frames
that carry the new tokens of every stream of the link at once, and one ``FINISH`` or ``ERROR``
per stream.  The link is opened on first use (one connect at a time) and read by one task in the
client's task group, which hands each entry to its call's queue; the call yields the same
`TokenEvent` / `FinishEvent` sequence as a ``POST /generate`` stream.

Reconnects follow the HTTP path's contract: when the link breaks (the router gone, EOF, a reset),
every open call keeps its request id and the number of tokens it received, and re-``OPEN``s on a
new link with ``num_received_tokens`` set, for up to ``reconnect_timeout_s`` from the break: no
token lost or repeated.  A ``LINK_ERROR`` (the router says the client broke the link: a bug) fails
every open call, with no reconnect.

``timeout_s`` holds per link and per call, as the HTTP path's read timeout does per stream: a link
the router keeps silent for ``timeout_s`` while calls are open breaks (and they reconnect); a call
that gets nothing for about ``timeout_s`` while the link carries other calls' tokens is CANCELled
and re-OPENed on the same link, and raises `RouterClientError` 504 once that has gone on for
``reconnect_timeout_s``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import httptools
import orjson

from belayer_router._client._calls import (
    Broken,
    Call,
    CallTimeout,
    Conn,
    Fatal,
    Item,
    finish_event,
    link_head,
    status_error,
)
from belayer_router._errors import InvalidRequestError, LinkProtocolError, RouterClientError
from belayer_router._wire._frames import (
    MAX_LINK_FRAME_BYTES,
    ErrorFrame,
    FinishFrame,
    FrameBuffer,
    LinkErrorFrame,
    TokensFrame,
    decode_router_frame,
    send_chunked_frames,
)
from belayer_router._wire._protocol import FinishEvent, TokenEvent
from belayer_router._wire._response import ResponseBody

__all__ = ["CLOSED_STATUS", "ClientMux"]

CLOSED_STATUS = 499  # the status of the error open calls get when their RouterClient closes
_READ_BYTES = 262144
_RETRY_S = 0.05
_OPEN_SLACK = 64  # an OPEN frame's bytes beyond its body's JSON: header, handle, num_received_tokens


class ClientMux:
    """The client link of one `RouterClient`: connected lazily, read by one task of its own group.

    Enter it (``async with``) around its use: its reader task runs in the task group it holds.
    """

    def __init__(
        self, base_url: str, connect_timeout_s: float, read_timeout_s: float, token: str | None = None
    ) -> None:
        self.url = base_url.rstrip("/")
        self.host, self.port, self.head = link_head(self.url, token)
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.conn: Conn | None = None  # the link new calls open on
        self._conns: set[Conn] = set()  # every link still running (a retired one finishes its calls)
        self.num_connects = 0  # links opened (tests and metrics read it)
        self._group: anyio.abc.TaskGroup | None = None
        self._lock = anyio.Lock()
        self._last_error: OSError | None = None  # of the last connect, if it failed
        self._failed_at = -math.inf
        self._closed = False

    async def __aenter__(self) -> ClientMux:
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()  # the link's tasks end here, so the group has nothing left to cancel
        group, self._group = self._group, None
        if group is not None:  # the block's own exception is not the group's: not wrapped in a group
            await group.__aexit__(None, None, None)

    def _closed_error(self) -> RouterClientError:
        return RouterClientError(
            CLOSED_STATUS, f"the RouterClient of {self.url} was closed while this generation was open"
        )

    async def aclose(self) -> None:
        """Close the link; every open call raises `RouterClientError` (status `CLOSED_STATUS`)."""
        self._closed = True
        for conn in list(self._conns):  # the current link and any retired one still carrying calls
            conn.scope.cancel()
            with anyio.CancelScope(shield=True):
                await conn.done.wait()

    async def _connection(self) -> Conn:
        """The open link, connecting one if there is none (one connect at a time)."""
        conn = self.conn
        if conn is not None and not conn.broken:
            return conn
        if self._closed:
            raise self._closed_error()
        if self._group is None:
            raise InvalidRequestError(
                "RouterClient(multiplex=True) must be entered before use: "
                "`async with RouterClient(url, multiplex=True) as client:` (its link reader runs there)",
            )
        async with self._lock:
            conn = self.conn
            if conn is not None and not conn.broken:
                return conn
            if self._closed:
                raise self._closed_error()
            error = self._last_error
            if error is not None and anyio.current_time() - self._failed_at < _RETRY_S:
                # Every open call retries: one connect per retry interval for all of them.
                raise ConnectionError(f"connecting to the router at {self.url} failed: {error!r}")
            try:
                with anyio.fail_after(self.connect_timeout_s):
                    stream = await anyio.connect_tcp(self.host, self.port)
                try:
                    await stream.send(self.head)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await stream.aclose()
                    raise
            except OSError as exc:  # TimeoutError is one
                self._last_error, self._failed_at = exc, anyio.current_time()
                raise
            except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                dropped = ConnectionError(f"the router at {self.url} dropped the connection: {exc!r}")
                self._last_error, self._failed_at = dropped, anyio.current_time()
                raise dropped from exc
            self._last_error = None
            if self._closed:  # closed while connecting
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                raise self._closed_error()
            self.conn = conn = Conn(stream)
            self._conns.add(conn)
            self.num_connects += 1
            self._group.start_soon(self._run, conn)
            return conn

    async def _run(self, conn: Conn) -> None:
        """Write and read ``conn`` until it ends; then hand every open call its way out."""
        failure: Item | None = None
        try:
            with conn.scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._write, conn)
                    group.start_soon(self._watch, conn)
                    try:
                        await self._read(conn)
                    finally:
                        conn.broken = True  # no new call opens here from now on
                    group.cancel_scope.cancel()  # the router ended the link: stop the writer too
        except Exception as exc:
            error: BaseException = exc
            while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
                error = error.exceptions[0]
            if isinstance(error, Fatal):
                failure = error.error
            elif isinstance(error, LinkProtocolError):
                failure = RouterClientError(
                    502, f"the router at {self.url} sent a malformed client link: {error}"
                )
            else:  # the link broke: the calls reconnect
                failure = Broken(error)
        finally:
            conn.broken = True
            conn.outbox.close()
            if self._closed:
                failure = self._closed_error()
            elif failure is None:
                failure = Broken(ConnectionError(f"the router at {self.url} ended the client link"))
            for handle in list(conn.calls):
                conn.end(handle, failure)
            with anyio.CancelScope(shield=True):
                await conn.stream.aclose()
            self._conns.discard(conn)
            conn.done.set()

    async def _write(self, conn: Conn) -> None:
        try:
            await send_chunked_frames(conn.outgoing, conn.stream)
        finally:
            conn.broken = True  # at once: a call opening in this same turn takes a new link

    async def _watch(self, conn: Conn) -> None:
        """The link's timeouts, both checked by one scan every quarter of ``read_timeout_s`` (and
        at least once a second), so nothing is done per token; each fires between
        ``read_timeout_s`` and a quarter more after its start.

        - The link: calls open and no frame since the later of the last frame and the oldest
          unanswered OPEN: a hung router; `TimeoutError` breaks the link and the calls reconnect.
        - One call: its item count unchanged while the link carries other calls' frames: it is
          CANCELled here and told to re-OPEN.
        """
        timeout_s = self.read_timeout_s
        period = min(max(timeout_s / 4, 0.005), 1.0)
        seen: dict[int, tuple[int, float]] = {}  # handle -> (item count, when it was first seen)
        while True:
            await anyio.sleep(period)
            now = anyio.current_time()
            if now - conn.last_read >= timeout_s:
                seen.clear()
                if conn.calls and now - max(conn.last_read, conn.opened_at) >= timeout_s:
                    raise TimeoutError(
                        f"the router at {self.url} sent nothing on the client link for "
                        f"{timeout_s:g} s (timeout_s) while requests were open"
                    )
                continue
            for handle in [handle for handle in seen if handle not in conn.calls]:
                del seen[handle]
            for handle, call in list(conn.calls.items()):
                count, since = seen.get(handle, (-1, now))
                if count != call.num_items:
                    seen[handle] = (call.num_items, now)
                elif now - since >= timeout_s:
                    del seen[handle]
                    conn.cancel(call)
                    call.put(
                        Broken(
                            CallTimeout(
                                f"request {call.body['request_id']!r} got nothing from the router "
                                f"at {self.url} for {timeout_s:g} s (timeout_s) while its client "
                                "link carried other requests"
                            )
                        )
                    )

    async def _read(self, conn: Conn) -> None:
        response = ResponseBody()
        parser = httptools.HttpResponseParser(response)
        frames = FrameBuffer()
        status: int | None = None
        while True:
            try:
                data = await conn.stream.receive(_READ_BYTES)  # `_watch` times a silent link out
            except anyio.EndOfStream:
                if status is not None and status != 200:
                    raise Fatal(status_error(self.url, status, b"".join(response.body))) from None
                raise ConnectionError(f"the router at {self.url} closed the client link") from None
            try:
                parser.feed_data(data)
            except httptools.HttpParserError as error:
                raise LinkProtocolError(f"a malformed HTTP answer: {error}") from error
            if status is None and response.headers_done:
                status = parser.get_status_code()
            if status is not None and status != 200:
                if response.done:
                    raise Fatal(status_error(self.url, status, b"".join(response.body)))
                continue
            if response.body:  # frames: an answer (the response head alone is not one)
                conn.last_read = anyio.current_time()
                chunk = b"".join(response.body) if len(response.body) > 1 else response.body[0]
                response.body.clear()
                for kind, payload in frames.feed(chunk):
                    self._frame(conn, kind, payload)
            if response.done:
                return  # the router ended the link: open calls reconnect

    def _frame(self, conn: Conn, kind: int, payload: memoryview) -> None:
        frame = decode_router_frame(kind, payload)
        if isinstance(frame, TokensFrame):
            calls, token_ids, logprobs = conn.calls, frame.token_ids, frame.logprobs
            offset = 0
            for handle, first, count in zip(frame.handles, frame.firsts, frame.counts, strict=True):
                end = offset + count
                call = calls.get(handle)
                if call is not None:  # else cancelled by its caller: late tokens, dropped
                    call.put((first, token_ids[offset:end], logprobs[offset:end]))
                offset = end
        elif isinstance(frame, FinishFrame):
            conn.end(frame.handle, finish_event(frame.payload))
        elif isinstance(frame, ErrorFrame):
            conn.end(frame.handle, RouterClientError(frame.status, frame.message))
        elif isinstance(frame, LinkErrorFrame):
            raise Fatal(
                RouterClientError(
                    frame.status, f"the router closed the client link (a client bug): {frame.message}"
                )
            )

    async def stream(
        self, body: dict[str, Any], reconnect_timeout_s: float
    ) -> AsyncGenerator[TokenEvent | FinishEvent]:
        """One generation over the link: its `TokenEvent`s, then its `FinishEvent`."""
        try:
            size = len(orjson.dumps(body))
        except TypeError as error:  # e.g. numpy integers among the token ids
            raise InvalidRequestError(
                f"request {body['request_id']!r} cannot be sent as JSON ({error}); pass token ids as "
                "Python ints (for example array.tolist())"
            ) from error
        if size + _OPEN_SLACK > MAX_LINK_FRAME_BYTES:
            raise RouterClientError(
                413,
                f"request {body['request_id']!r} is {size} bytes as JSON: over the client link's frame "
                f"limit of {MAX_LINK_FRAME_BYTES} bytes; send a shorter prompt",
            )
        call = Call(body)
        broken_since: float | None = None  # the reconnect window starts at a break
        try:
            while True:
                item: Item | None = None
                try:
                    (await self._connection()).open(call)
                except OSError as exc:
                    item = Broken(exc)
                while item is None:
                    item = await call.next()
                    if isinstance(item, tuple):
                        first, token_ids, logprobs = item
                        if first != call.num_received:
                            raise RouterClientError(
                                502,
                                f"the router sent token index {first} of request {body['request_id']!r}; "
                                f"the client expected {call.num_received}",
                            )
                        broken_since = None
                        for offset, token_id in enumerate(token_ids):
                            call.num_received += 1
                            yield TokenEvent(first + offset, token_id, logprobs[offset])
                        item = None
                if isinstance(item, FinishEvent):
                    yield item
                    return
                now = anyio.current_time()
                if isinstance(item, RouterClientError):
                    # A resumed call may find its old attempt still being released (409): retry.
                    if (
                        broken_since is None
                        or item.status != 409
                        or now - broken_since >= reconnect_timeout_s
                    ):
                        raise item
                    cause: BaseException = item
                else:
                    cause = item.error if isinstance(item, Broken) else ConnectionError("the link broke")
                if broken_since is None:
                    broken_since = now
                if now - broken_since >= reconnect_timeout_s:
                    if isinstance(cause, CallTimeout):
                        raise RouterClientError(
                            504,
                            f"{cause}; re-OPENing it did not help within reconnect_timeout_s="
                            f"{reconnect_timeout_s:g} s",
                        ) from cause
                    raise RouterClientError(
                        503,
                        f"the client link to {self.url} broke and did not come back within "
                        f"reconnect_timeout_s={reconnect_timeout_s:g} s: {cause!r}",
                    ) from cause
                await anyio.sleep(_RETRY_S)
        finally:
            conn = call.conn
            if conn is not None:
                conn.cancel(call)
