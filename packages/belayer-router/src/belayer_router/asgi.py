"""Hosting ASGI apps the way the router does: bound sockets, uvicorn, JSON in and out.

For code that serves an HTTP endpoint next to a router (workers, test doubles): `serving` runs
an app in the background of an async block and yields its URL (port 0 works), `serve_asgi` serves
one until cancelled, `read_json` / `send_json` / `send_text` are the bounded body reader and the
one-shot responses the router itself uses.
"""

from __future__ import annotations

from belayer_router._server._asgi import MAX_BODY_BYTES, Receive, Send, read_json, send_json, send_text
from belayer_router._server._serve import bind_socket, serve_asgi, serving

__all__ = [
    "MAX_BODY_BYTES",
    "Receive",
    "Send",
    "bind_socket",
    "read_json",
    "send_json",
    "send_text",
    "serve_asgi",
    "serving",
]
