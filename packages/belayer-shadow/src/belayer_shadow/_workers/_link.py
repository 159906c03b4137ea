"""The worker side of belayer-router's multiplexed link: ``POST /link`` on `EngineService`.

The router opens one link per worker and submits every request on it; the service's scheduling
loop sends ONE ``STEP`` frame per engine step and link with every request's new tokens and the
requests that step finished (`EngineService._dispatch`).  A request the service refuses (stale
epoch, malformed body, one already running) is answered with a ``REJECT`` frame; the router's
``ABORT`` (client gone) and the link closing abort the engine's requests between steps.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from belayer_router.worker import LinkAbort, encode_reject, read_link_frames

if TYPE_CHECKING:
    from belayer_shadow._workers._service import EngineService, _Job

__all__ = ["LinkConn", "serve_link"]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@attrs.define(eq=False)
class LinkConn:
    """One router link: its outgoing frames and its running requests by handle."""

    outbox: MemoryObjectSendStream[bytes]
    jobs: dict[int, _Job] = attrs.field(factory=dict)


async def _write(outgoing: MemoryObjectReceiveStream[bytes], send: Send) -> None:
    async for first in outgoing:
        batch = [first]
        while True:  # one body chunk per wake-up: whatever the loop queued meanwhile
            try:
                batch.append(outgoing.receive_nowait())
            except anyio.WouldBlock:
                break
        await send({"type": "http.response.body", "body": b"".join(batch), "more_body": True})


async def serve_link(service: EngineService, receive: Receive, send: Send) -> None:
    """Serve one router link until the router closes it (or sends a malformed frame)."""
    outbox, outgoing = anyio.create_memory_object_stream[bytes](math.inf)
    link = LinkConn(outbox)
    headers = [(b"content-type", b"application/x-belayer-link")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(_write, outgoing, send)
            async for message in read_link_frames(receive):
                if isinstance(message, LinkAbort):
                    service.abort_link(link, message.handle)
                    continue
                reason = service.submit_link(link, message.handle, message.body)
                if reason is not None:
                    outbox.send_nowait(encode_reject(message.handle, reason))
            group.cancel_scope.cancel()
    finally:
        for handle in list(link.jobs):
            service.abort_link(link, handle)
        outbox.close()
        outgoing.close()
