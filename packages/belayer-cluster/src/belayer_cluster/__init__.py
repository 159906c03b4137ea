"""belayer-cluster: Belayer's rollout slots on Ray, one placement-group bundle per slot.

`LocalRayCluster` starts simulated nodes on this machine, `IsolatedRayCluster` nodes that share
nothing but the network and one folder (namespaces of their own; root); `RolloutCluster` places one `SlotHost`
actor per slot (a belayer-shadow `SlotSupervisor` with its memory servers, main and shadow, all on
the actor's node) and reports a lost node's slots to the driver's router, which resumes their
requests token-exact on the other slots. Only this package imports ray.

The names that need ray (or torch) are imported on first use (PEP 562), so that the errors, the
config, `connect` and `belayer-cluster scale` start without importing ray.
"""

from __future__ import annotations

import importlib
from importlib.metadata import version as _version
from typing import TYPE_CHECKING, Any

from belayer_cluster._cli import ExitCode
from belayer_cluster._config import LocalClusterConfig
from belayer_cluster._connect import connect, disconnect
from belayer_cluster._errors import (
    BelayerClusterError,
    ClusterConfigError,
    ClusterStartError,
    RouterAccessError,
    SandboxHostError,
    SlotHostError,
    WeightSyncError,
    WeightSyncTimeoutError,
)

if TYPE_CHECKING:
    from belayer_cluster._cluster import NodeLoss, RolloutCluster
    from belayer_cluster._isolated import IsolatedNode, IsolatedRayCluster, clean_stale_clusters
    from belayer_cluster._local import LocalRayCluster
    from belayer_cluster._remote_sandbox import RemoteSandbox, RemoteSandboxError, SandboxCalls
    from belayer_cluster._replacement import start_replacement_slot
    from belayer_cluster._router import DriverRouter
    from belayer_cluster._sandbox_host import SandboxHost, SandboxInfo
    from belayer_cluster._sandboxes import SandboxCluster, SandboxRestore
    from belayer_cluster._serve import ClusterService, RemoteSlotWeights
    from belayer_cluster._slot_host import SlotHost, SlotInfo, node_run_dir
    from belayer_cluster._weightsync import WeightReport, WeightSync, WeightUpdateResult
    from belayer_cluster._weightsync_agent import WeightAgent

__version__ = _version("belayer-cluster")

_LAZY = {
    "ClusterService": "_serve",
    "DriverRouter": "_router",
    "IsolatedNode": "_isolated",
    "IsolatedRayCluster": "_isolated",
    "LocalRayCluster": "_local",
    "NodeLoss": "_cluster",
    "RemoteSandbox": "_remote_sandbox",
    "RemoteSandboxError": "_remote_sandbox",
    "SandboxCalls": "_remote_sandbox",
    "RemoteSlotWeights": "_serve",
    "RolloutCluster": "_cluster",
    "SandboxCluster": "_sandboxes",
    "SandboxHost": "_sandbox_host",
    "SandboxInfo": "_sandbox_host",
    "SandboxRestore": "_sandboxes",
    "SlotHost": "_slot_host",
    "SlotInfo": "_slot_host",
    "WeightAgent": "_weightsync_agent",
    "WeightReport": "_weightsync",
    "WeightSync": "_weightsync",
    "WeightUpdateResult": "_weightsync",
    "clean_stale_clusters": "_isolated",
    "node_run_dir": "_slot_host",
    "start_replacement_slot": "_replacement",
}


def __getattr__(name: str) -> Any:
    """Import a name that needs ray on first use (PEP 562) and keep it in the package."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'belayer_cluster' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"belayer_cluster.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "BelayerClusterError",
    "ClusterConfigError",
    "ClusterService",
    "ClusterStartError",
    "DriverRouter",
    "ExitCode",
    "IsolatedNode",
    "IsolatedRayCluster",
    "LocalClusterConfig",
    "LocalRayCluster",
    "NodeLoss",
    "RemoteSandbox",
    "RemoteSandboxError",
    "RemoteSlotWeights",
    "RolloutCluster",
    "RouterAccessError",
    "SandboxCalls",
    "SandboxCluster",
    "SandboxHost",
    "SandboxHostError",
    "SandboxInfo",
    "SandboxRestore",
    "SlotHost",
    "SlotHostError",
    "SlotInfo",
    "WeightAgent",
    "WeightReport",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncTimeoutError",
    "WeightUpdateResult",
    "__version__",
    "clean_stale_clusters",
    "connect",
    "disconnect",
    "node_run_dir",
    "start_replacement_slot",
]
