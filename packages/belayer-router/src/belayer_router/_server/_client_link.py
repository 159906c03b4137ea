"""The client link, router side: ``POST /client-link``, many generation streams on one connection.

The client's ``OPEN`` / ``CANCEL`` frames arrive in its chunked request body; the router answers
``200`` at once and streams ``TOKENS`` / ``FINISH`` / ``ERROR`` frames (and, when the client broke
the link, one ``LINK_ERROR``) in its chunked response body (`_wire._frames` has the framing).

Each ``OPEN`` runs exactly as a streamed ``POST /generate`` of its body (validation, journal,
resume from ``num_received_tokens``, fencing, stop strings, resumes on worker failure), in a task
of the link's task group.  Its emit only appends to the link's pending entries and schedules one
flush per event-loop turn; the flush packs every entry of the turn into ONE ``TOKENS`` frame,
appends the turn's ``FINISH`` / ``ERROR`` frames after it (a request's tokens always precede its
last frame) and writes the lot once: straight onto the connection through the ``belayer`` server's
synchronous ``belayer.write`` extension, else (uvicorn, back-pressure) through the link's writer
task, in order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs

from belayer_router._errors import BelayerRouterError, LinkProtocolError
from belayer_router._server._asgi import Receive, Send, Write, body_too_large, direct_writer
from belayer_router._wire._frames import (
    MAX_ENTRY_TOKENS,
    MAX_LINK_FRAME_BYTES,
    CancelFrame,
    FrameBuffer,
    decode_client_frame,
    encode_error,
    encode_finish,
    encode_link_error,
    pack_tokens,
)
from belayer_router._wire._protocol import FinishEvent, TokenEvent, TokensEvent

if TYPE_CHECKING:
    from belayer_router._core._journal import RequestRecord
    from belayer_router._server._app import RouterApp

__all__ = ["CONTENT_TYPE", "ClientLink"]

CONTENT_TYPE = b"application/x-belayer-link"
_log = logging.getLogger("belayer_router.client_link")
_Entry = tuple[int, int, Sequence[int], Sequence[float]]  # handle, first index, token ids, logprobs
# The tokens of one TOKENS frame at most (12 bytes a token, at most 12 more for its entry).
_MAX_FRAME_TOKENS = (MAX_LINK_FRAME_BYTES - 4096) // 24


class _LinkEmit:
    """One request's `Emit` on a link: ``frame`` (the dispatcher's fast path) and ``__call__``
    (events: resumed or regenerated tokens, stop strings, the finish) only append to the link's
    pending output.  ``live`` goes False once the request is cancelled: nothing more is sent for it."""

    __slots__ = ("handle", "link", "live", "run")

    def __init__(self, link: ClientLink, handle: int) -> None:
        self.link, self.handle, self.live = link, handle, True
        self.run: tuple[list[int], list[float]] | None = None  # the ids / logprobs of its last event entry

    def frame(self, start: int, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if self.live:
            link = self.link
            link.entries.append((self.handle, start, token_ids, logprobs))
            if not link.scheduled:
                link.scheduled = True
                link.loop.call_soon(link.flush)

    def __call__(self, event: TokenEvent | TokensEvent | FinishEvent) -> None:
        if not self.live:
            return
        link = self.link
        if isinstance(event, TokenEvent):
            entries, run = link.entries, self.run
            if (  # the next token of this request's last entry (a resume's replay): one entry
                run is not None
                and entries
                and entries[-1][2] is run[0]
                and entries[-1][1] + len(run[0]) == event.index
                and len(run[0]) < MAX_ENTRY_TOKENS
            ):
                run[0].append(event.token_id)
                run[1].append(event.logprob)
            else:
                self.run = run = ([event.token_id], [event.logprob])
                entries.append((self.handle, event.index, run[0], run[1]))
        elif isinstance(event, TokensEvent):
            link.entries.append((self.handle, event.index, event.token_ids, event.logprobs))
        else:
            self.live = False  # the request's last frame
            link.requests.pop(self.handle, None)
            link.frames.append(encode_finish(self.handle, attrs.asdict(event)))
        if not link.scheduled:
            link.scheduled = True
            link.loop.call_soon(link.flush)


def _pack(entries: list[_Entry]) -> bytes:
    """One TOKENS frame of ``entries`` (several, if they hold more than `_MAX_FRAME_TOKENS`)."""
    handles, firsts, ids, lps = zip(*entries, strict=True)  # transposed in C
    counts = list(map(len, ids))
    total = sum(counts)
    if total > _MAX_FRAME_TOKENS:  # a huge turn (long resumes replayed): frames under the limit
        pieces: list[bytes] = []
        start = size = 0
        for index, count in enumerate(counts):
            if size + count > _MAX_FRAME_TOKENS and index > start:
                pieces.append(_pack(entries[start:index]))
                start, size = index, 0
            size += count
        pieces.append(_pack(entries[start:]))
        return b"".join(pieces)
    if total == len(counts):  # one token an entry: the common case
        return pack_tokens(handles, firsts, counts, [t[0] for t in ids], [v[0] for v in lps])
    return pack_tokens(
        handles, firsts, counts, list(chain.from_iterable(ids)), list(chain.from_iterable(lps))
    )


class ClientLink:
    """One ``POST /client-link``: its requests, its pending output and its writer."""

    def __init__(self, app: RouterApp, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.app, self.receive, self.send = app, receive, send
        self.write: Write | None = direct_writer(scope)
        self.loop = asyncio.get_running_loop()
        self.entries: list[_Entry] = []  # token entries of this turn
        self.frames: list[bytes] = []  # FINISH / ERROR frames of this turn, in order
        self.scheduled = False  # a flush is scheduled for this turn
        self.backlog: list[bytes] = []  # what the writer task sends next, in order
        self.sending = False  # the writer task is in ``send``
        self.wakeup: asyncio.Future[None] | None = None
        self.written = anyio.Event()  # the writer task has sent its backlog and ended
        self.ending = False  # no more output: the writer ends once the backlog is sent
        self.requests: dict[int, tuple[anyio.CancelScope, _LinkEmit]] = {}  # open, by handle
        self.idle = anyio.Event()  # set when the last open request ends
        self.last_handle = -1

    # Output.

    def flush(self) -> None:
        """Pack this turn's token entries into one TOKENS frame, the FINISH / ERROR frames after it,
        and write them once."""
        self.scheduled = False
        entries, frames = self.entries, self.frames
        if not entries and not frames:
            return
        data = b""
        if entries:
            self.entries = []
            data = _pack(entries)
        if frames:
            self.frames = []
            data = b"".join([data, *frames])
        self._out(data)

    def _out(self, data: bytes) -> None:
        if self.ending:
            return
        write = self.write
        if write is not None and not self.backlog and not self.sending and write(data):
            return
        self.backlog.append(data)
        wakeup = self.wakeup
        if wakeup is not None:
            self.wakeup = None
            if not wakeup.done():
                wakeup.set_result(None)

    async def _writer(self) -> None:
        """Send what could not be written directly, in order, until the link ends."""
        while True:
            while not self.backlog:
                if self.ending:
                    self.written.set()
                    return
                self.wakeup = wakeup = self.loop.create_future()
                await wakeup
            data = b"".join(self.backlog) if len(self.backlog) > 1 else self.backlog[0]
            self.backlog.clear()
            self.sending = True
            try:
                await self.send({"type": "http.response.body", "body": data, "more_body": True})
            finally:
                self.sending = False

    async def _end(self, last: bytes = b"") -> None:
        """Flush, let the writer send its backlog, then end the response (with ``last`` before it)."""
        self.flush()
        if last:
            self._out(last)
        self.ending = True
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)
        await self.written.wait()
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    # Requests.

    def _open(self, group: anyio.abc.TaskGroup, handle: int, body: dict[str, Any], size: int) -> None:
        if handle <= self.last_handle:
            raise LinkProtocolError(
                f"OPEN of handle {handle} after handle {self.last_handle}: handles must increase on a link"
            )
        self.last_handle = handle
        emit = _LinkEmit(self, handle)
        try:
            if size > self.app.config.max_body_bytes:  # as `/generate` answers such a body
                raise body_too_large(self.app.config.max_body_bytes)
            request = self.app.parse_generate(body)
            record = self.app._begin(request)
        except BelayerRouterError as error:
            self._fail(emit, error)
            return
        scope = anyio.CancelScope()
        self.requests[handle] = (scope, emit)
        group.start_soon(self._run, scope, emit, record, request.num_received_tokens)

    async def _run(
        self, scope: anyio.CancelScope, emit: _LinkEmit, record: RequestRecord, num_received: int
    ) -> None:
        try:
            with scope:
                await self.app._run(record, emit, num_received)
        except BelayerRouterError as error:
            self._fail(emit, error)
        except Exception as error:  # a bug: that request fails alone, not every stream of the link
            _log.exception("request %r on a client link failed", record.request_id)
            self._fail(emit, BelayerRouterError(f"internal error: {error!r}"))
        finally:
            self.requests.pop(emit.handle, None)
            if not self.requests:
                self.idle.set()

    def _fail(self, emit: _LinkEmit, error: BelayerRouterError) -> None:
        if emit.live:
            emit.live = False
            self.frames.append(encode_error(emit.handle, error.status, str(error)))
            if not self.scheduled:
                self.scheduled = True
                self.loop.call_soon(self.flush)

    def _cancel(self, handle: int) -> None:
        if handle > self.last_handle:
            raise LinkProtocolError(f"CANCEL of handle {handle}, which was never opened on this link")
        opened = self.requests.pop(handle, None)
        if opened is not None:  # else finished already: a race, ignored
            scope, emit = opened
            emit.live = False
            scope.cancel()
            if not self.requests:
                self.idle.set()

    def _cancel_all(self) -> None:
        for scope, emit in self.requests.values():
            emit.live = False
            scope.cancel()

    # The link.

    async def serve(self) -> None:
        """Answer 200 at once, run the client's frames until it closes its body, then end the
        response once the open requests have finished."""
        headers = [(b"content-type", CONTENT_TYPE), (b"cache-control", b"no-cache")]
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        await self.send({"type": "http.response.body", "body": b"", "more_body": True})
        self.app.metrics.num_client_links += 1
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._writer)
                try:
                    ended = await self._read(group)
                except LinkProtocolError as error:
                    self._cancel_all()
                    await self._end(encode_link_error(400, f"{error}; the client link is closed"))
                    group.cancel_scope.cancel()
                    return
                if not ended:  # the client is gone
                    group.cancel_scope.cancel()
                    return
                group.start_soon(self._watch_disconnect, group.cancel_scope)
                if self.requests:
                    self.idle = anyio.Event()
                    await self.idle.wait()
                await self._end()
                group.cancel_scope.cancel()
        finally:
            self.app.metrics.num_client_links -= 1
            self.ending = True

    async def _read(self, group: anyio.abc.TaskGroup) -> bool:
        """The client's frames until its body ends (True) or it disconnects (False, requests
        cancelled); `LinkProtocolError` on a bad frame (nothing of it acted on)."""
        buffer = FrameBuffer()
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self._cancel_all()
                return False
            body = message.get("body", b"")
            if body:
                for kind, payload in buffer.feed(body):
                    frame = decode_client_frame(kind, payload)
                    if isinstance(frame, CancelFrame):
                        self._cancel(frame.handle)
                    else:
                        self._open(group, frame.handle, frame.body, frame.size)
            if not message.get("more_body", False):
                if buffer.pending:
                    raise LinkProtocolError(
                        f"the client's link body ended inside a frame ({buffer.pending} bytes)"
                    )
                return True

    async def _watch_disconnect(self, scope: anyio.CancelScope) -> None:
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self._cancel_all()
        self.ending = True
        scope.cancel()
