"""The multiplexed worker link, router side: one persistent connection per worker.

A worker that registered with ``link: true`` gets one long-lived ``POST /link`` (plain HTTP/1.1,
chunked both ways, `_wire._frames` inside).  Every request the router runs on that worker is a
``SUBMIT`` on the link; the worker answers with one ``STEP`` frame per engine step carrying every
request's new tokens and finishes.  The link's reader task checks a frame whole (epoch, handles,
indices, room left) before it journals and emits anything of it, then hands each entry to its
request synchronously: no per-request task wakes up per token, only the client's writer.  The
frame's checked entries go to the dispatcher in one call (``apply``), which journals them and
hands each request its tokens through its emit's ``frame`` (`_core._emit.Emit`).

The link breaking (connection error, malformed frame, stale epoch, retired worker, a read slower
than ``read_timeout_s`` while requests are out) breaks every request on it: each resumes through
the dispatcher's usual path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import anyio
import anyio.abc
import attrs
import httptools

from belayer_router._errors import LinkProtocolError, WorkerStreamError
from belayer_router._wire._frames import (
    LINK_PATH,
    REJECT,
    STEP,
    FrameBuffer,
    LinkStep,
    decode_step,
    encode_abort,
    encode_submit,
    send_chunked_frames,
)
from belayer_router._wire._response import ResponseBody

if TYPE_CHECKING:
    from belayer_router._core._emit import Emit
    from belayer_router._core._journal import RequestRecord
    from belayer_router._core._registry import Worker

__all__ = ["Link", "LinkAttempt", "LinkPool"]

_READ_BYTES = 262144
Check = Callable[["Worker", "RequestRecord", int, list[int]], None]
Entry = tuple["LinkAttempt", int, list[int], list[float]]  # attempt, first index, token ids, logprobs
Stop = Callable[["LinkAttempt", str], None]  # a stop string ended the attempt: end it now
Apply = Callable[["Worker", list[Entry], Stop], None]
EmitFrame = Callable[[int, Sequence[int], Sequence[float]], None]


@attrs.define(eq=False)
class LinkAttempt:
    """One request submitted on a link, until it finishes, is rejected, aborted or the link breaks."""

    handle: int
    record: RequestRecord
    emit: Emit
    num_received: int
    frame: EmitFrame  # ``emit.frame``, looked up once
    done: anyio.Event = attrs.field(factory=anyio.Event)
    finish: str | None = None
    error: WorkerStreamError | None = None


def _head(url: str) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise WorkerStreamError(f"worker URL {url!r} is not a plain http:// URL; a link needs one")
    path = (parts.path.rstrip("/") or "") + LINK_PATH
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/x-belayer-link\r\n"
        "Accept: application/x-belayer-link\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    return parts.hostname, parts.port or 80, head.encode("ascii")


class Link:
    """One open link to one worker (one `Worker`, i.e. one slot at one epoch)."""

    def __init__(
        self,
        worker: Worker,
        stream: anyio.abc.SocketStream,
        check: Check,
        apply: Apply,
        read_timeout_s: float,
        on_stale: Callable[[], None],
    ) -> None:
        self.worker, self.stream = worker, stream
        self.check, self.apply, self.on_stale = check, apply, on_stale
        self.read_timeout_s = read_timeout_s
        self.attempts: dict[int, LinkAttempt] = {}
        self.next_handle = 0
        self.broken: WorkerStreamError | None = None
        self._read_scope: anyio.CancelScope | None = None
        self.outbox, self.outgoing = anyio.create_memory_object_stream[bytes](math.inf)

    def submit(self, body: bytes, record: RequestRecord, emit: Emit, num_received: int) -> LinkAttempt:
        """Send a request on the link; wait on the returned attempt's ``done``."""
        if self.broken is not None:
            raise WorkerStreamError(f"link to {self.worker.url} is broken: {self.broken}")
        attempt = LinkAttempt(self.next_handle, record, emit, num_received, emit.frame)
        self.next_handle += 1
        was_idle = not self.attempts  # a deadline left by aborted requests is not this one's
        self.attempts[attempt.handle] = attempt
        self.outbox.send_nowait(encode_submit(attempt.handle, body))
        scope = self._read_scope
        if scope is not None and (was_idle or scope.deadline == math.inf):  # time the reader from now
            scope.deadline = anyio.current_time() + self.read_timeout_s
        return attempt

    def abort(self, attempt: LinkAttempt) -> None:
        """Stop ``attempt`` (client gone, stop string, slot cut): the worker is told, late frames dropped."""
        if self.attempts.pop(attempt.handle, None) is not None and self.broken is None:
            self.outbox.send_nowait(encode_abort(attempt.handle))

    def _close(
        self, attempt: LinkAttempt, finish: str | None, error: WorkerStreamError | None = None
    ) -> None:
        self.attempts.pop(attempt.handle, None)
        attempt.finish, attempt.error = finish, error
        attempt.done.set()

    async def run(self) -> None:
        """Read and write the link until it breaks or its worker is retired; then fail what is left.

        The cleanup also runs when the link's task is cancelled from outside (the router's links
        shutting down), so no request waits on a link that is gone.
        """
        error: BaseException | None = None
        try:
            with anyio.CancelScope() as scope:
                self.worker.links.add(scope)
                if self.worker.retired:  # retired between `LinkPool.get` and now: nobody cancels it
                    scope.cancel()
                try:
                    async with anyio.create_task_group() as group:
                        group.start_soon(self._write)
                        await self._read()
                except Exception as exc:
                    error = exc
                    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
                        error = error.exceptions[0]
                finally:
                    self.worker.links.discard(scope)
        finally:
            if error is not None:
                why = WorkerStreamError(f"link to {self.worker.url} broke: {error!r}")
            elif self.worker.retired:
                why = WorkerStreamError("worker retired")
            else:
                why = WorkerStreamError(f"link to {self.worker.url} closed: the router's links shut down")
            self.broken = why
            for attempt in list(self.attempts.values()):
                self._close(attempt, None, why)
            self.outbox.close()
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _write(self) -> None:
        await send_chunked_frames(self.outgoing, self.stream)

    async def _read(self) -> None:
        response = ResponseBody()
        parser = httptools.HttpResponseParser(response)
        frames = FrameBuffer()
        checked = False
        while True:
            deadline = anyio.current_time() + self.read_timeout_s if self.attempts else math.inf
            with anyio.CancelScope(deadline=deadline) as scope:
                self._read_scope = scope  # idle (no deadline) until a request is submitted
                try:
                    data = await self.stream.receive(_READ_BYTES)
                except anyio.EndOfStream:
                    raise WorkerStreamError(f"worker {self.worker.url} closed its link") from None
                finally:
                    self._read_scope = None
            if scope.cancelled_caught:
                raise WorkerStreamError(
                    f"worker {self.worker.url} sent nothing for {self.read_timeout_s:g} s"
                )
            try:
                parser.feed_data(data)
            except httptools.HttpParserError as error:
                raise LinkProtocolError(
                    f"worker {self.worker.url} sent a malformed HTTP answer: {error}"
                ) from error
            if response.headers_done and not checked:
                checked = True
                status = parser.get_status_code()
                if status != 200:
                    raise WorkerStreamError(f"worker {self.worker.url} answered its link with {status}")
            if response.body:
                chunk = b"".join(response.body)
                response.body.clear()
                for kind, payload in frames.feed(chunk):
                    if kind == STEP:
                        self._step(decode_step(payload))
                    elif kind == REJECT:
                        self._reject(payload)
                    else:
                        raise LinkProtocolError(
                            f"worker {self.worker.url} sent an unknown link frame kind {kind}"
                        )
            if response.done:
                raise WorkerStreamError(f"worker {self.worker.url} ended its link")

    def _known(self, handles: list[int]) -> None:
        if handles and max(handles) >= self.next_handle:
            raise LinkProtocolError(
                f"worker {self.worker.url} sent request handle {max(handles)}; the link issued "
                f"{self.next_handle} handles"
            )

    def _stop(self, attempt: LinkAttempt, reason: str) -> None:
        """A stop string ended ``attempt`` (the router ends it, the worker stops): closed at once,
        so a later entry of the same frame that fails cannot turn it into a broken stream."""
        self.abort(attempt)
        self._close(attempt, reason)

    def _reject(self, payload: memoryview) -> None:
        if len(payload) < 4:
            raise LinkProtocolError(f"worker {self.worker.url} sent a REJECT frame without a handle")
        handle = int.from_bytes(payload[:4], "little")
        self._known([handle])
        attempt = self.attempts.get(handle)
        if attempt is not None:
            message = bytes(payload[4:]).decode(errors="replace")
            self._close(
                attempt, None, WorkerStreamError(f"worker {self.worker.url} rejected the request: {message}")
            )

    def _step(self, step: LinkStep) -> None:
        worker = self.worker
        if worker.held_out and not worker.retired:
            return  # its requests are being cut (weight version): none of this reaches a client
        if worker.retired or step.epoch != worker.epoch:
            self.on_stale()
            raise WorkerStreamError(
                f"link frame of epoch {step.epoch} from {worker.url}; slot {worker.slot} expects epoch "
                f"{worker.epoch}{' (retired)' if worker.retired else ''}"
            )
        handles, counts = step.handles, step.counts
        self._known(handles)
        self._known(step.finished)
        if len(set(handles)) != len(handles):
            raise LinkProtocolError(f"worker {worker.url} sent one request twice in a STEP frame")
        attempts, token_ids, logprobs, check = self.attempts, step.token_ids, step.logprobs, self.check
        live: list[Entry] = []
        offset = 0
        for handle, first, count in zip(handles, step.firsts, counts, strict=True):
            end = offset + count  # check the whole frame before using any of it
            attempt = attempts.get(handle)
            if attempt is not None:  # else aborted by the router: late tokens, dropped
                ids = token_ids[offset:end]
                check(worker, attempt.record, first, ids)
                live.append((attempt, first, ids, logprobs[offset:end]))
            offset = end
        self.apply(worker, live, self._stop)
        for handle, reason in zip(step.finished, step.reasons, strict=True):
            attempt = attempts.get(handle)
            if attempt is not None:
                self._close(attempt, reason)


@attrs.define(eq=False)
class LinkPool:
    """The router's open links, one per worker; their tasks run in ``group`` (the app's lifetime)."""

    check: Check
    apply: Apply
    on_stale: Callable[[], None]
    group: anyio.abc.TaskGroup | None = None
    links: dict[Worker, Link] = attrs.field(factory=dict)
    _opening: dict[Worker, anyio.Event] = attrs.field(factory=dict, alias="_opening")

    async def get(self, worker: Worker, connect_timeout_s: float, read_timeout_s: float) -> Link:
        """The worker's open link, connecting it if needed (one connect at a time per worker)."""
        while True:
            link = self.links.get(worker)
            if link is not None and link.broken is None:
                return link
            opening = self._opening.get(worker)
            if opening is None:
                break
            await opening.wait()
        if self.group is None:
            raise WorkerStreamError("the router's links are shut down (RouterApp.serving_links has ended)")
        self._opening[worker] = opening = anyio.Event()
        try:
            host, port, head = _head(worker.url)
            with anyio.fail_after(connect_timeout_s):
                stream = await anyio.connect_tcp(host, port)
            try:
                await stream.send(head)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
                raise
            link = Link(worker, stream, self.check, self.apply, read_timeout_s, self.on_stale)
            self.links[worker] = link
            self.group.start_soon(self._run, link)
            return link
        finally:
            del self._opening[worker]
            opening.set()

    async def _run(self, link: Link) -> None:
        try:
            await link.run()
        finally:
            if self.links.get(link.worker) is link:
                del self.links[link.worker]
