"""belayer-router: the token-level resume router with worker epochs.

Clients stream tokens through the router; workers register per slot with an epoch; a broken
worker stream is resumed on the slot's replacement (or another healthy slot) from prompt + every
token already streamed, so the client sees one stream with no token lost or repeated.

Public sub-namespaces for distinct audiences: `belayer_router.worker` (the worker side of the
protocol), `belayer_router.asgi` (serving ASGI apps as the router does) and
`belayer_router.testing` (a fake worker and a chat tokenizer folder for tests).
"""

from __future__ import annotations

from importlib.metadata import version as _version

from belayer_router._cli import ExitCode
from belayer_router._client._admin import RouterAdmin, RouterCounters, RouterWorkers, SlotState
from belayer_router._client._client import Completion, RouterClient
from belayer_router._client._fleet import RouterFleet, owner_index
from belayer_router._core._config import api_keys_from
from belayer_router._core._journal import Journal, RequestRecord
from belayer_router._core._journal_file import JournalStore
from belayer_router._core._registry import Registry, Slot, Worker
from belayer_router._core._tokenizer import (
    ByteTokenizer,
    ChatTemplateTokenizer,
    ChatTokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    load_tokenizer,
)
from belayer_router._errors import (
    BelayerRouterError,
    InvalidRequestError,
    JournalError,
    LinkProtocolError,
    NoHealthyWorkerError,
    NotFoundError,
    PartialWeightCommitError,
    PayloadTooLargeError,
    RequestConflictError,
    RouterClientError,
    RouterUnreachableError,
    ServerConfigError,
    ServerStartupError,
    StaleEpochError,
    TokenizerError,
    UnauthorizedError,
    WeightLoadError,
    WeightVersionError,
    WorkerStreamError,
)
from belayer_router._keeper import (
    add_keeper_flags,
    check_keeper_flags,
    health_check,
    keep_running,
    keeper_child_argv,
)
from belayer_router._server._app import RouterApp, RouterConfig
from belayer_router._server._asgi import read_json
from belayer_router._server._control import PAUSE_MODES, WeightLoader, WeightTransferLoader
from belayer_router._server._serve import bind_socket, running_router, serve_asgi, serving
from belayer_router._wire._protocol import (
    FinishEvent,
    GenerateRequest,
    TokenEvent,
    TokensEvent,
    WorkerFinish,
    WorkerToken,
    parse_generate_request,
    parse_worker_event,
    worker_request_body,
)

__version__ = _version("belayer-router")

__all__ = [
    "PAUSE_MODES",
    "BelayerRouterError",
    "ByteTokenizer",
    "ChatTemplateTokenizer",
    "ChatTokenizer",
    "Completion",
    "ExitCode",
    "FinishEvent",
    "GenerateRequest",
    "HuggingFaceTokenizer",
    "InvalidRequestError",
    "Journal",
    "JournalError",
    "JournalStore",
    "LinkProtocolError",
    "NoHealthyWorkerError",
    "NotFoundError",
    "PartialWeightCommitError",
    "PayloadTooLargeError",
    "Registry",
    "RequestConflictError",
    "RequestRecord",
    "RouterAdmin",
    "RouterApp",
    "RouterClient",
    "RouterClientError",
    "RouterConfig",
    "RouterCounters",
    "RouterFleet",
    "RouterUnreachableError",
    "RouterWorkers",
    "ServerConfigError",
    "ServerStartupError",
    "Slot",
    "SlotState",
    "StaleEpochError",
    "TokenEvent",
    "Tokenizer",
    "TokenizerError",
    "TokensEvent",
    "UnauthorizedError",
    "WeightLoadError",
    "WeightLoader",
    "WeightTransferLoader",
    "WeightVersionError",
    "Worker",
    "WorkerFinish",
    "WorkerStreamError",
    "WorkerToken",
    "__version__",
    "add_keeper_flags",
    "api_keys_from",
    "bind_socket",
    "check_keeper_flags",
    "health_check",
    "keep_running",
    "keeper_child_argv",
    "load_tokenizer",
    "owner_index",
    "parse_generate_request",
    "parse_worker_event",
    "read_json",
    "running_router",
    "serve_asgi",
    "serving",
    "worker_request_body",
]
