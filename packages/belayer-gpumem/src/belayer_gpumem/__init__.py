"""belayer-gpumem: weight and KV-cache memory servers that outlive the workers that use them.

A memory server owns one region (host memfd or CUDA VMM memory) and hands it to workers over a
private Unix socket; workers view it as torch tensors, zero copy.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from belayer_gpumem._cli import ExitCode
    from belayer_gpumem._client import KVClient, WeightClient, WeightUpdate, ping
    from belayer_gpumem._config import READY_PREFIX, ServerConfig
    from belayer_gpumem._errors import (
        BackendUnavailableError,
        BelayerGpumemError,
        GpuUnhealthyError,
        LayoutError,
        PermissionDeniedError,
        ProtocolError,
        RemoteError,
        ServerGoneError,
        ServerStartError,
        UpdateBusyError,
    )
    from belayer_gpumem._health import HealthReport, check_gpu_health
    from belayer_gpumem._idle import IdleBuffer
    from belayer_gpumem._layout import FusedSpec, KVLayout, TensorSpec, WeightLayout
    from belayer_gpumem._process import ServerProcess

__version__ = importlib.metadata.version("belayer-gpumem")

_EXPORTS = {
    "BackendUnavailableError": "belayer_gpumem._errors",
    "BelayerGpumemError": "belayer_gpumem._errors",
    "ExitCode": "belayer_gpumem._cli",
    "FusedSpec": "belayer_gpumem._layout",
    "GpuUnhealthyError": "belayer_gpumem._errors",
    "HealthReport": "belayer_gpumem._health",
    "IdleBuffer": "belayer_gpumem._idle",
    "KVClient": "belayer_gpumem._client",
    "KVLayout": "belayer_gpumem._layout",
    "LayoutError": "belayer_gpumem._errors",
    "PermissionDeniedError": "belayer_gpumem._errors",
    "ProtocolError": "belayer_gpumem._errors",
    "READY_PREFIX": "belayer_gpumem._config",
    "RemoteError": "belayer_gpumem._errors",
    "ServerConfig": "belayer_gpumem._config",
    "ServerGoneError": "belayer_gpumem._errors",
    "ServerProcess": "belayer_gpumem._process",
    "ServerStartError": "belayer_gpumem._errors",
    "TensorSpec": "belayer_gpumem._layout",
    "UpdateBusyError": "belayer_gpumem._errors",
    "WeightClient": "belayer_gpumem._client",
    "WeightLayout": "belayer_gpumem._layout",
    "WeightUpdate": "belayer_gpumem._client",
    "check_gpu_health": "belayer_gpumem._health",
    "ping": "belayer_gpumem._client",
}

__all__ = [
    "READY_PREFIX",
    "BackendUnavailableError",
    "BelayerGpumemError",
    "ExitCode",
    "FusedSpec",
    "GpuUnhealthyError",
    "HealthReport",
    "IdleBuffer",
    "KVClient",
    "KVLayout",
    "LayoutError",
    "PermissionDeniedError",
    "ProtocolError",
    "RemoteError",
    "ServerConfig",
    "ServerGoneError",
    "ServerProcess",
    "ServerStartError",
    "TensorSpec",
    "UpdateBusyError",
    "WeightClient",
    "WeightLayout",
    "WeightUpdate",
    "__version__",
    "check_gpu_health",
    "ping",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that a host-backend server process never imports torch.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_gpumem' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
