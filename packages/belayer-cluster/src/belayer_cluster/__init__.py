"""belayer-cluster: Belayer's rollout slots on Ray, one placement-group bundle per slot.

`LocalRayCluster` starts simulated nodes on this machine; `RolloutCluster` places one `SlotHost`
actor per slot (a belayer-shadow `SlotSupervisor` with its memory servers, main and shadow, all on
the actor's node) and reports a lost node's slots to the driver's router, which resumes their
requests token-exact on the other slots. Only this package imports ray.
"""

from __future__ import annotations

from importlib.metadata import version as _version

from belayer_cluster._cli import ExitCode
from belayer_cluster._cluster import NodeLoss, RolloutCluster
from belayer_cluster._config import LocalClusterConfig
from belayer_cluster._connect import connect, disconnect
from belayer_cluster._errors import (
    BelayerClusterError,
    ClusterConfigError,
    ClusterStartError,
    SandboxHostError,
    SlotHostError,
)
from belayer_cluster._local import LocalRayCluster
from belayer_cluster._replacement import start_replacement_slot
from belayer_cluster._router import DriverRouter
from belayer_cluster._sandbox_host import SandboxHost, SandboxInfo
from belayer_cluster._sandboxes import SandboxCluster, SandboxRestore
from belayer_cluster._slot_host import SlotHost, SlotInfo, node_run_dir
from belayer_cluster._weightsync import WeightReport, WeightSync, WeightUpdateResult
from belayer_cluster._weightsync_agent import WeightAgent
from belayer_cluster._weightsync_errors import WeightSyncError, WeightSyncTimeoutError

__version__ = _version("belayer-cluster")

__all__ = [
    "BelayerClusterError",
    "ClusterConfigError",
    "ClusterStartError",
    "DriverRouter",
    "ExitCode",
    "LocalClusterConfig",
    "LocalRayCluster",
    "NodeLoss",
    "RolloutCluster",
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
    "connect",
    "disconnect",
    "node_run_dir",
    "start_replacement_slot",
]
