"""belayer-router: the token-level resume router with worker epochs.

Clients stream tokens through the router; workers register per slot with an epoch; a broken
worker stream is resumed on the slot's replacement (or another healthy slot) from prompt + every
token already streamed, so the client sees one stream with no token lost or repeated.
"""

from __future__ import annotations

from belayer_router._app import RouterApp, RouterConfig
from belayer_router._asgi import read_json
from belayer_router._client import Completion, RouterClient
from belayer_router._errors import (
    BelayerRouterError,
    InvalidRequestError,
    JournalError,
    NoHealthyWorkerError,
    NotFoundError,
    RequestConflictError,
    RouterClientError,
    StaleEpochError,
    UnauthorizedError,
    WorkerStreamError,
)
from belayer_router._journal import Journal, RequestRecord
from belayer_router._protocol import (
    FinishEvent,
    GenerateRequest,
    TokenEvent,
    WorkerFinish,
    WorkerToken,
    parse_generate_request,
    parse_worker_event,
    worker_request_body,
)
from belayer_router._registry import Registry, Slot, Worker
from belayer_router._server import bind_socket, running_router, serve_asgi, serving
from belayer_router._store import JournalStore
from belayer_router._tokenizer import ByteTokenizer, HuggingFaceTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BelayerRouterError",
    "ByteTokenizer",
    "Completion",
    "FinishEvent",
    "GenerateRequest",
    "HuggingFaceTokenizer",
    "InvalidRequestError",
    "Journal",
    "JournalError",
    "JournalStore",
    "NoHealthyWorkerError",
    "NotFoundError",
    "Registry",
    "RequestConflictError",
    "RequestRecord",
    "RouterApp",
    "RouterClient",
    "RouterClientError",
    "RouterConfig",
    "Slot",
    "StaleEpochError",
    "TokenEvent",
    "Tokenizer",
    "UnauthorizedError",
    "Worker",
    "WorkerFinish",
    "WorkerStreamError",
    "WorkerToken",
    "bind_socket",
    "load_tokenizer",
    "parse_generate_request",
    "parse_worker_event",
    "read_json",
    "running_router",
    "serve_asgi",
    "serving",
    "worker_request_body",
]
