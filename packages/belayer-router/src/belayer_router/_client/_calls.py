"""The client link's pieces under `ClientMux`: one call's queue (`Call`), one open link's calls and
outgoing frames (`Conn`), the link's request head and the errors a link's answer turns into."""

from __future__ import annotations

import contextlib
import math
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import attrs
import orjson

from belayer_router._errors import InvalidRequestError, LinkProtocolError, RouterClientError
from belayer_router._wire._frames import CLIENT_LINK_PATH, encode_cancel, encode_open
from belayer_router._wire._protocol import FinishEvent

__all__ = [
    "Broken",
    "Call",
    "CallTimeout",
    "Conn",
    "Fatal",
    "Item",
    "Tokens",
    "finish_event",
    "link_head",
    "status_error",
]


@attrs.frozen
class Broken:
    """The link under a call broke (retryable: the call re-OPENs on a new link)."""

    error: BaseException


class CallTimeout(TimeoutError):
    """One call got nothing for ``timeout_s`` on a link that carried other calls (re-OPENed)."""


MAX_HANDLE = 2**32 - 1  # handles are u32 and must increase on a link

Tokens = tuple[int, list[int], list[float]]  # first index, token ids, logprobs
Item = Tokens | FinishEvent | RouterClientError | Broken


@attrs.define(eq=False)
class Call:
    """One generation: its ``/generate`` body, the tokens it received, its queue of link items."""

    body: dict[str, Any]
    items: deque[Item] = attrs.field(factory=deque)
    wakeup: anyio.Event | None = None  # set when an item arrives for a caller waiting on an empty queue
    num_received: int = 0
    num_items: int = 0  # items queued so far (the link's watchdog reads it: a stuck call's stays put)
    handle: int = -1
    conn: Conn | None = None  # the link the call is open on, None between links and once done

    def put(self, item: Item) -> None:
        """Queue ``item`` (the reader task's hand-off: no await, no checkpoint)."""
        self.items.append(item)
        self.num_items += 1
        wakeup = self.wakeup
        if wakeup is not None:
            self.wakeup = None
            wakeup.set()

    async def next(self) -> Item:
        """The next item, waiting only when none is queued."""
        while not self.items:
            self.wakeup = wakeup = anyio.Event()
            await wakeup.wait()
        return self.items.popleft()


class Conn:
    """One open client link: its socket, its open calls by handle, its outgoing frames."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.calls: dict[int, Call] = {}
        self.next_handle = 0
        self.broken = False  # no new call opens here (the link failed, or is retired)
        self.retired = False  # handles used up: closed once its last call ends
        self.scope = anyio.CancelScope()
        self.opened_at = (
            -math.inf
        )  # the oldest OPEN since the last frames (the link's timeout counts from it)
        self.last_read = -math.inf  # when the router last sent frames on the link
        self.done = anyio.Event()
        self.outbox, self.outgoing = anyio.create_memory_object_stream[bytes](math.inf)

    def open(self, call: Call) -> None:
        """Send ``call`` as an OPEN with its received count (the router resumes from there).

        `ConnectionError` (the call reconnects) when the link broke or has used up its handles;
        the call is registered only once its OPEN is queued, so only sent OPENs are CANCELled."""
        handle = self.next_handle
        if handle > MAX_HANDLE:  # handles must increase: retire this link, the call takes a new one
            self.broken = self.retired = True
            self._close_if_retired()
            raise ConnectionError("the client link used up its request handles; a new link opens")
        frame = encode_open(handle, orjson.dumps({**call.body, "num_received_tokens": call.num_received}))
        self.next_handle += 1
        try:
            self.outbox.send_nowait(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as error:
            # The writer failed (a reset) a moment before the link was seen broken: reconnect.
            self.broken = True
            raise ConnectionError("the client link broke while a request was being opened") from error
        # The link's silence counts from its oldest OPEN not followed by any answer: a stream of
        # new OPENs to a hung router must not keep postponing it.
        if not self.calls or self.opened_at <= self.last_read:
            self.opened_at = anyio.current_time()
        call.handle, call.conn = handle, self
        self.calls[handle] = call

    def cancel(self, call: Call) -> None:
        """The caller left ``call``: CANCEL it (unless it ended or the link broke meanwhile)."""
        call.conn = None
        # A retired link's writer still runs: its CANCELs go out (a broken one cancels them anyway).
        if self.calls.pop(call.handle, None) is not None and (self.retired or not self.broken):
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                self.outbox.send_nowait(encode_cancel(call.handle))  # a broken link cancels it anyway
        self._close_if_retired()

    def end(self, handle: int, item: Item) -> None:
        """Hand ``item`` (a finish or an error) to the call of ``handle``: its last item here."""
        call = self.calls.pop(handle, None)
        if call is not None:
            call.conn = None
            call.put(item)
        self._close_if_retired()

    def _close_if_retired(self) -> None:
        if self.retired and not self.calls:
            self.scope.cancel()  # `ClientMux._run` closes the socket


def link_head(base_url: str, token: str | None = None) -> tuple[str, int, bytes]:
    """The client link's request head; ``token`` goes in ``Authorization: Bearer`` (a router with
    API keys answers the link 401 without it)."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or parts.hostname is None:
        raise InvalidRequestError(
            f"RouterClient(multiplex=True) needs a plain http:// router URL, got {base_url!r}; "
            "use multiplex=False for other URLs"
        )
    if token is not None and (not token.isprintable() or not token.isascii()):
        raise InvalidRequestError("the router token must be printable ASCII (it goes in a header)")
    path = (parts.path.rstrip("/") or "") + CLIENT_LINK_PATH
    authorization = "" if token is None else f"Authorization: Bearer {token}\r\n"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/x-belayer-link\r\n"
        f"Accept: application/x-belayer-link\r\n{authorization}Transfer-Encoding: chunked\r\n\r\n"
    )
    return parts.hostname, parts.port or 80, head.encode("ascii")


def status_error(url: str, status: int, body: bytes) -> RouterClientError:
    if status == 404:
        return RouterClientError(
            404,
            f"the router at {url} does not serve the client link (POST {CLIENT_LINK_PATH} answered "
            "404): upgrade belayer-router there, or use RouterClient(multiplex=False)",
        )
    try:
        message = str(orjson.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")[:2000]
    return RouterClientError(status, f"the router refused the client link: {message}")


def finish_event(payload: dict[str, Any]) -> FinishEvent:
    try:
        return FinishEvent(
            str(payload["request_id"]),
            str(payload["finish_reason"]),
            int(payload["num_prompt_tokens"]),
            int(payload["num_generated_tokens"]),
            int(payload["num_resumes"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise LinkProtocolError(
            f"a FINISH frame lacks the finish event's fields: {payload!r}"[:500]
        ) from error


class Fatal(Exception):
    """The link ended with an error every open call raises (no reconnect)."""

    def __init__(self, error: RouterClientError) -> None:
        super().__init__(str(error))
        self.error = error
