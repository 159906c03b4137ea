"""belayer-gpumem: weight and KV-cache memory servers that outlive the workers that use them.

A memory server owns one region (host memfd or CUDA VMM memory) and hands it to workers over a
private Unix socket; workers view it as torch tensors, zero copy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from belayer_gpumem.client import KVClient, WeightClient, WeightUpdate, ping
    from belayer_gpumem.config import READY_PREFIX, ServerConfig
    from belayer_gpumem.errors import (
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
    from belayer_gpumem.health import HealthReport, check_gpu_health
    from belayer_gpumem.idle import IdleBuffer
    from belayer_gpumem.layout import KVLayout, TensorSpec, WeightLayout
    from belayer_gpumem.process import ServerProcess

_EXPORTS = {
    "BackendUnavailableError": "belayer_gpumem.errors",
    "BelayerGpumemError": "belayer_gpumem.errors",
    "GpuUnhealthyError": "belayer_gpumem.errors",
    "HealthReport": "belayer_gpumem.health",
    "IdleBuffer": "belayer_gpumem.idle",
    "KVClient": "belayer_gpumem.client",
    "KVLayout": "belayer_gpumem.layout",
    "LayoutError": "belayer_gpumem.errors",
    "PermissionDeniedError": "belayer_gpumem.errors",
    "ProtocolError": "belayer_gpumem.errors",
    "READY_PREFIX": "belayer_gpumem.config",
    "RemoteError": "belayer_gpumem.errors",
    "ServerConfig": "belayer_gpumem.config",
    "ServerGoneError": "belayer_gpumem.errors",
    "ServerProcess": "belayer_gpumem.process",
    "ServerStartError": "belayer_gpumem.errors",
    "TensorSpec": "belayer_gpumem.layout",
    "UpdateBusyError": "belayer_gpumem.errors",
    "WeightClient": "belayer_gpumem.client",
    "WeightLayout": "belayer_gpumem.layout",
    "WeightUpdate": "belayer_gpumem.client",
    "check_gpu_health": "belayer_gpumem.health",
    "ping": "belayer_gpumem.client",
}

__all__ = [
    "READY_PREFIX",
    "BackendUnavailableError",
    "BelayerGpumemError",
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
    "check_gpu_health",
    "ping",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that a host-backend server process never imports torch.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_gpumem' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
