"""The little of ASGI the router needs: JSON in, JSON / text out, and streamed responses.

A streamed response is produced by a task that emits events synchronously into an unbounded
list; the handler drains whatever is queued into one body chunk per wake-up, and a
watcher cancels the producer when the client disconnects.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc

from belayer_router._errors import (
    BelayerRouterError,
    InvalidRequestError,
    PayloadTooLargeError,
    error_payload,
)

__all__ = [
    "MAX_BODY_BYTES",
    "Receive",
    "Send",
    "StreamQueue",
    "Write",
    "body_too_large",
    "direct_writer",
    "read_json",
    "run_unless_disconnected",
    "send_error",
    "send_json",
    "send_text",
    "session_header",
    "stream_response",
]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Write = Callable[[bytes], bool]
_E = TypeVar("_E")
MAX_BODY_BYTES = 64 * 1024 * 1024


def body_too_large(max_bytes: int) -> PayloadTooLargeError:
    """The 413 of a request body over the router's ``max_body_bytes``."""
    return PayloadTooLargeError(
        f"request body exceeds the limit of {max_bytes} bytes (router option max_body_bytes); "
        "send a smaller request"
    )


async def read_json(receive: Receive, max_bytes: int = MAX_BODY_BYTES, *, empty: Any = None) -> Any:
    """The request body decoded as JSON (``empty``, when given, for a body of no bytes).

    `PayloadTooLargeError` (413) past ``max_bytes``, `InvalidRequestError` (400) if not JSON.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidRequestError("client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise body_too_large(max_bytes)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    if empty is not None and size == 0:
        return empty
    try:
        return json.loads(b"".join(chunks))
    except ValueError as error:
        raise InvalidRequestError(f"request body is not valid JSON: {error}") from error
    except RecursionError:  # the decoder recurses per level: '[[[[...' is not a 500
        raise InvalidRequestError(
            "request body is not valid JSON for this router: nested too deeply; flatten it"
        ) from None


async def send_text(
    send: Send,
    status: int,
    text: str | bytes,
    content_type: str,
    extra_headers: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    """A complete response with one body."""
    body = text.encode() if isinstance(text, str) else text
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    headers += extra_headers
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, payload: Any, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """A complete JSON response."""
    body = json.dumps(payload, separators=(",", ":"))
    await send_text(send, status, body, "application/json", extra_headers)


def _retry_after(error: BelayerRouterError) -> tuple[tuple[bytes, bytes], ...]:
    seconds = getattr(error, "retry_after_s", None)
    if seconds is None:
        return ()
    return ((b"retry-after", str(max(1, math.ceil(seconds))).encode()),)


async def send_error(send: Send, error: BelayerRouterError) -> None:
    """The error as a complete JSON response (`error_payload`), with ``Retry-After`` when the
    error says when to retry (a 503 while no worker can serve)."""
    await send_json(send, error.status, error_payload(error), _retry_after(error))


async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def run_unless_disconnected(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work``, cancelled if the client disconnects first; True if it ran to its end.

    For a response sent whole: without it, a request whose client has gone (a harness's timeout)
    kept generating, and its request id stayed in flight (a retry with it got 409).
    """
    async with anyio.create_task_group() as group:
        group.start_soon(_watch_disconnect, receive, group.cancel_scope)
        await work()
        group.cancel_scope.cancel()
        return True
    return False  # cancelled by the watcher (the task group swallowed its own cancellation)


def _no_render(events: list[Any]) -> bytes:
    raise AssertionError("a direct write without a renderer")


def direct_writer(scope: dict[str, Any]) -> Write | None:
    """The server's synchronous body writer (``belayer.write`` extension), if it offers one."""
    write = scope.get("extensions", {}).get("belayer.write")
    return write if callable(write) else None


class _Rendered:
    """Bytes already rendered from one item (a direct write the server refused): renderers keep
    state (OpenAI choices), so an item is rendered exactly once and its bytes are what is queued."""

    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body


class StreamQueue(Generic[_E]):
    """The producer -> writer hand-off of a streamed response: ``put`` is synchronous, and the
    writer takes everything queued at once; one wake-up per writer wait, none per item (anyio's
    memory streams checkpoint and allocate per ``receive``: measurable per token).  On asyncio
    the writer waits on a bare future (an ``anyio.Event`` costs a few microseconds more per
    wake-up: an asyncio.Event, its waiter deque and a future); on other backends on an
    ``anyio.Event``.  Cancellation is the same either way (the waiting task is cancelled)."""

    def __init__(self) -> None:
        self.items: list[_E | BelayerRouterError | _Rendered] = []
        self.closed = False
        self.failed = False  # an error was queued (the producer's last item)
        self.future: asyncio.Future[None] | None = None
        self.write: Write | None = None
        self.render: Callable[[list[_E]], bytes] = _no_render
        self.event: anyio.Event | None = None
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (trio)
            self.loop = None

    def _wake(self) -> None:
        future, event = self.future, self.event
        if future is not None:
            self.future = None
            if not future.done():  # done: the writer was cancelled while waiting
                future.set_result(None)
        if event is not None:
            self.event = None
            event.set()

    def __call__(self, item: _E) -> None:
        """The producer's ``emit`` (`put`); `put_rendered` is its pre-rendered sibling."""
        self.put(item)

    def put_rendered(self, body: bytes) -> None:
        """Queue (or write straight away, when the writer is idle) bytes the producer rendered
        itself, in order with the items around them: no event object, no renderer call."""
        if not body:  # nothing to send: must not start the response (as `put` does not)
            return
        write = self.write
        if write is not None and not self.items and write(body):
            return
        self.items.append(_Rendered(body))
        if self.future is not None or self.event is not None:
            self._wake()

    def put(self, item: _E | BelayerRouterError) -> None:
        write = self.write
        if write is not None and not self.items:  # the writer is idle: nothing queued to pass
            body = self.render([item])  # type: ignore[list-item]  # errors go through `fail`
            if not body or write(body):
                return
            self.items.append(_Rendered(body))  # rendered once: never again by the writer
        else:
            self.items.append(item)
        if self.future is not None or self.event is not None:
            self._wake()

    def direct(self, write: Write, render: Callable[[list[_E]], bytes]) -> None:
        """From now on, ``put`` writes an item straight to the connection when nothing is queued
        (``write`` is the server's ``belayer.write`` extension; False: queue it as usual)."""
        self.write, self.render = write, render

    def fail(self, error: BelayerRouterError) -> None:
        self.failed = True
        self.write = None  # the error (and anything after it) goes through the writer
        self.put(error)

    def close(self) -> None:
        self.closed = True
        self._wake()

    async def batch(self) -> list[_E | BelayerRouterError | _Rendered]:
        """Everything queued (waiting for at least one item); empty once closed and drained."""
        while not self.items and not self.closed:
            if self.loop is not None:
                self.future = future = self.loop.create_future()
                await future
            else:
                self.event = event = anyio.Event()
                await event.wait()
        batch, self.items = self.items, []
        return batch


def _render_batch(
    batch: list[_E | BelayerRouterError | _Rendered], render: Callable[[list[_E]], bytes]
) -> bytes:
    """The body for a batch in order: events rendered (in runs), refused direct writes as they
    were rendered, errors left out (the caller renders the error last)."""
    if not any(isinstance(item, (_Rendered, BelayerRouterError)) for item in batch):
        return render(batch)  # type: ignore[arg-type]  # only events
    pieces: list[bytes] = []
    run: list[_E] = []
    for item in batch:
        if isinstance(item, _Rendered):
            if run:
                pieces.append(render(run))
                run = []
            pieces.append(item.body)
        elif not isinstance(item, BelayerRouterError):
            run.append(item)
    if run:
        pieces.append(render(run))
    return b"".join(pieces)


async def stream_response(
    receive: Receive,
    send: Send,
    produce: Callable[[StreamQueue[_E]], Awaitable[None]],
    render: Callable[[list[_E]], bytes],
    render_error: Callable[[BelayerRouterError], bytes],
    content_type: str,
    write: Write | None = None,
) -> None:
    """Stream what ``produce`` emits; an error before the first event becomes an error status.

    ``write``: the server's ``belayer.write`` extension (`direct_writer`): once the response has
    started, an event emitted while nothing is queued is rendered and written by the producer
    itself, synchronously; the writer task wakes only for what it could not write (back-pressure)
    and for the end of the stream.  ``produce`` gets the `StreamQueue`: called with an event, or
    ``put_rendered(body)`` with bytes the producer rendered itself, kept in order with the events.
    """
    queue: StreamQueue[_E] = StreamQueue()

    async def run_producer() -> None:
        try:
            await produce(queue)
        except BelayerRouterError as error:
            queue.fail(error)
        finally:
            queue.close()

    started = False
    async with anyio.create_task_group() as group:
        group.start_soon(run_producer)
        group.start_soon(_watch_disconnect, receive, group.cancel_scope)
        while batch := await queue.batch():
            error = (
                next((e for e in batch if isinstance(e, BelayerRouterError)), None) if queue.failed else None
            )
            if not started and error is not None and len(batch) == 1:
                await send_error(send, error)
                group.cancel_scope.cancel()
                return
            if not started:
                headers = [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                started = True
            body = _render_batch(batch, render) + (b"" if error is None else render_error(error))
            await send({"type": "http.response.body", "body": body, "more_body": True})
            if write is not None and queue.write is None and not queue.failed:
                queue.direct(write, render)
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        group.cancel_scope.cancel()


def session_header(scope: dict[str, Any]) -> str | None:
    """The request's ``X-Session-ID`` (sticky routing of a multi-turn session), if any."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"x-session-id" and value:
            return str(value.decode(errors="replace"))[:256]
    return None
