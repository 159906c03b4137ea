"""The error hierarchy of belayer-router: one root, one subclass per way a caller can go wrong."""

from __future__ import annotations

from typing import Any

__all__ = [
    "BelayerRouterError",
    "InternalRouterError",
    "InvalidRequestError",
    "JournalError",
    "LinkProtocolError",
    "NoHealthyWorkerError",
    "NotFoundError",
    "PartialWeightCommitError",
    "PayloadTooLargeError",
    "RequestConflictError",
    "RouterClientError",
    "ServerConfigError",
    "ServerStartupError",
    "StaleEpochError",
    "TokenizerError",
    "UnauthorizedError",
    "WeightLoadError",
    "WeightVersionError",
    "WorkerStreamError",
    "error_payload",
]


class BelayerRouterError(Exception):
    """Root of every error raised by belayer-router.

    ``status`` is the HTTP status the router answers with when this error reaches a client.
    """

    status = 500


class InternalRouterError(BelayerRouterError):
    """A request failed on a bug of the router, not on its input: the router logged the
    traceback; the message names the exception.  The only error a client gets as a 500."""


class ServerConfigError(BelayerRouterError):
    """An option of the HTTP serving is invalid (an unknown server, a timeout <= 0); the message
    names the option and the values to use.  A configuration error, not a request's."""


class ServerStartupError(BelayerRouterError):
    """The served ASGI app reported that its lifespan startup failed; the message carries its reason."""


class InvalidRequestError(BelayerRouterError):
    """A request body or parameter is malformed; the message names the field and what to send.

    The message is cut at `MAX_MESSAGE_CHARS`: it may quote the client's own value, and a
    megabytes-long field must not come back as an even longer error.
    """

    status = 400
    MAX_MESSAGE_CHARS = 2000

    def __init__(self, message: str) -> None:
        if len(message) > self.MAX_MESSAGE_CHARS:
            message = f"{message[: self.MAX_MESSAGE_CHARS]}... (cut; {len(message)} characters in all)"
        super().__init__(message)


class PayloadTooLargeError(InvalidRequestError):
    """A request body is larger than the router accepts; the message names the limit."""

    status = 413


class UnauthorizedError(BelayerRouterError):
    """An admin call came without the right bearer token."""

    status = 401


class NotFoundError(BelayerRouterError):
    """An unknown route, slot, request or trajectory context."""

    status = 404


class StaleEpochError(BelayerRouterError):
    """A registration, unregistration or stream from an older epoch than the slot's (fencing)."""

    status = 409


class WeightVersionError(BelayerRouterError):
    """A weight version that goes backwards (a slot's committed version, or the required one)."""

    status = 409


class WeightLoadError(InvalidRequestError):
    """A weight folder could not be loaded (missing, malformed, truncated, or not the served
    model's names, shapes and dtypes); nothing was changed: the previous weights are served."""

    status = 400


class PartialWeightCommitError(BelayerRouterError):
    """A weight update committed on some slots and then failed on another (its weight server died
    or its socket broke between load and commit): the slots in ``committed`` serve the new
    weights, the others do not. The router counts it as a new version, requires it, and so holds
    the other slots out of rotation until an update reaches them (push the weights again)."""

    status = 503

    def __init__(self, message: str, committed: tuple[str, ...]) -> None:
        super().__init__(message)
        self.committed = committed


class RequestConflictError(BelayerRouterError):
    """A request id is reused with a different prompt, or is still in flight."""

    status = 409


class NoHealthyWorkerError(BelayerRouterError):
    """No healthy worker became available within the configured wait.

    The message names why (each slot: unhealthy since when, restarting since when, held out for
    its weight version); ``retry_after_s`` is the ``Retry-After`` the router answers with.
    """

    status = 503

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class JournalError(BelayerRouterError):
    """The persisted journal cannot be read or written."""


class TokenizerError(InvalidRequestError):
    """A tokenizer cannot be loaded (missing file or library); the message says what to install."""


class WorkerStreamError(BelayerRouterError):
    """A worker's stream broke (connection error, bad event, stale epoch, retired worker).

    The router handles this internally by resuming the request; it reaches callers only through
    ``RouterClient`` when a worker-side call fails.
    """

    status = 502


class RouterClientError(BelayerRouterError):
    """The router answered a ``RouterClient`` call with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"router answered {status}: {message}")
        self.status = status
        self.message = message


class RouterUnreachableError(BelayerRouterError):
    """A `RouterAdmin` call got no answer (connection refused or reset, timeout): the router is away
    or restarting; try again later. A router that answered with an error status raises
    `RouterClientError` instead."""


class LinkProtocolError(WorkerStreamError):
    """A worker link carried a malformed, truncated or oversized frame, or an unknown request.

    The router fences the link (every request on it resumes elsewhere) and journals nothing of
    the frame.
    """


# OpenAI's error types by status (its API answers ``{"error": {"message", "type", "param", "code"}}``).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    502: "server_error",
    503: "service_unavailable_error",
}


def error_payload(error: BelayerRouterError) -> dict[str, Any]:
    """The JSON body of an error, shaped as OpenAI's API shapes its own (``status`` added)."""
    code = "".join("_" + c.lower() if c.isupper() else c for c in type(error).__name__).lstrip("_")
    return {
        "error": {
            "message": str(error),
            "type": _ERROR_TYPES.get(error.status, "server_error"),
            "param": None,
            "code": code.removesuffix("_error"),
            "status": error.status,
        }
    }
