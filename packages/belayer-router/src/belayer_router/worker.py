"""The worker side of the router protocol, for inference engines that serve behind a router.

A worker answers ``POST /generate`` with a body made by `worker_request_body` (read it with
`read_json`), streams one `encode_worker_token` line per token (or one `encode_worker_tokens` frame per engine
step, cheaper for the router) with its epoch and a final
`encode_worker_finish` line (or `encode_worker_error`), as ``application/x-ndjson``.  The router
reads the lines with `parse_worker_event`.  The README's "Worker protocol" defines every field.

A worker may also serve the multiplexed link (``POST /link``, README "Worker link"): one
connection for all its requests, `read_link_frames` for the router's submissions and aborts, one
`encode_step` frame per engine step for every request's new tokens and finishes.  It says so when
it registers (``RouterClient.register(..., link=True)``).
"""

from __future__ import annotations

from belayer_router._errors import LinkProtocolError
from belayer_router._server._asgi import read_json
from belayer_router._wire._frames import (
    LINK_PATH,
    MAX_LINK_FRAME_BYTES,
    LinkAbort,
    LinkStep,
    LinkSubmit,
    decode_step,
    encode_abort,
    encode_reject,
    encode_step,
    encode_submit,
    read_link_frames,
)
from belayer_router._wire._protocol import (
    FINISH_REASONS,
    MAX_FRAME_BYTES,
    MAX_FRAME_TOKENS,
    WorkerFinish,
    WorkerToken,
    WorkerTokens,
    encode_worker_error,
    encode_worker_finish,
    encode_worker_token,
    encode_worker_tokens,
    parse_worker_event,
    worker_request_body,
)

__all__ = [
    "FINISH_REASONS",
    "LINK_PATH",
    "MAX_FRAME_BYTES",
    "MAX_FRAME_TOKENS",
    "MAX_LINK_FRAME_BYTES",
    "LinkAbort",
    "LinkProtocolError",
    "LinkStep",
    "LinkSubmit",
    "WorkerFinish",
    "WorkerToken",
    "WorkerTokens",
    "decode_step",
    "encode_abort",
    "encode_reject",
    "encode_step",
    "encode_submit",
    "encode_worker_error",
    "encode_worker_finish",
    "encode_worker_token",
    "encode_worker_tokens",
    "parse_worker_event",
    "read_json",
    "read_link_frames",
    "worker_request_body",
]
