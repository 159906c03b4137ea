"""An HTTP/1.1 response read by httptools' C parser: the callbacks that collect its de-chunked body.

The router reads its two long-lived links itself rather than through httpx (whose h11 parser,
run in Python on every chunk, was most of the router's CPU per token; issue 15): a worker link
and, on the client side, a client link.
"""

from __future__ import annotations

__all__ = ["ResponseBody"]


class ResponseBody:
    """httptools callbacks: the body arrives de-chunked in ``body``; ``done`` at its end."""

    def __init__(self) -> None:
        self.headers_done = False
        self.body: list[bytes] = []
        self.done = False

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.done = True
