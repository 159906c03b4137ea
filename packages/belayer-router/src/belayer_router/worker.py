"""The worker side of the router protocol, for inference engines that serve behind a router.

A worker answers ``POST /generate`` with a body made by `worker_request_body` (read it with
`read_json`), streams one `encode_worker_token` line per token (or one `encode_worker_tokens` frame per engine
step, cheaper for the router) with its epoch and a final
`encode_worker_finish` line (or `encode_worker_error`), as ``application/x-ndjson``.  The router
reads the lines with `parse_worker_event`.  The README's "Worker protocol" defines every field.
"""

from __future__ import annotations

from belayer_router._asgi import read_json
from belayer_router._protocol import (
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
    "MAX_FRAME_BYTES",
    "MAX_FRAME_TOKENS",
    "WorkerFinish",
    "WorkerToken",
    "WorkerTokens",
    "encode_worker_error",
    "encode_worker_finish",
    "encode_worker_token",
    "encode_worker_tokens",
    "parse_worker_event",
    "read_json",
    "worker_request_body",
]
