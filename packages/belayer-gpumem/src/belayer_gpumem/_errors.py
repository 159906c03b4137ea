"""The error hierarchy of belayer-gpumem: everything raised on purpose derives from `BelayerGpumemError`."""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "BelayerGpumemError",
    "CudaDriverError",
    "GpuUnhealthyError",
    "LayoutError",
    "PermissionDeniedError",
    "ProtocolError",
    "RemoteError",
    "ServerGoneError",
    "ServerStartError",
    "UpdateBusyError",
]


class BelayerGpumemError(Exception):
    """Root of every error this package raises on purpose."""


class LayoutError(BelayerGpumemError, ValueError):
    """A weight table, KV layout or safetensors file is invalid or does not fit the region."""


class ProtocolError(BelayerGpumemError):
    """A message broke the wire protocol (bad framing, bad JSON, wrong schema, too large)."""


class RemoteError(BelayerGpumemError):
    """The server answered a request with an error reply; `code` says which kind."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class UpdateBusyError(RemoteError):
    """A weight update could not begin: another writer holds it, or readers still pin the old slot."""


class ServerGoneError(BelayerGpumemError, ConnectionError):
    """The memory server is not there (never started, exited, or was killed)."""


class PermissionDeniedError(BelayerGpumemError, PermissionError):
    """The socket or the server refused us: we run as a different user than the server."""


class ServerStartError(BelayerGpumemError):
    """A memory server process did not come up (bad arguments, socket in use, backend failure)."""


class BackendUnavailableError(BelayerGpumemError):
    """The requested backend cannot run here (no CUDA, no cuda-bindings, no memfd)."""


class GpuUnhealthyError(BelayerGpumemError):
    """The GPU health check failed: wrong result, CUDA error, or no answer in time."""


class CudaDriverError(BelayerGpumemError):
    """A CUDA driver call failed; `call` names it and `code` is its CUresult."""

    def __init__(self, call: str, code: int, detail: str) -> None:
        super().__init__(f"{call} failed with CUDA error {code} ({detail})")
        self.call = call
        self.code = code
