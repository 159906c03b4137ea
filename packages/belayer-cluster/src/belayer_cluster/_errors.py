"""Every error belayer-cluster raises, rooted at `BelayerClusterError`."""

from __future__ import annotations

__all__ = [
    "BelayerClusterError",
    "ClusterConfigError",
    "ClusterStartError",
    "SandboxHostError",
    "SlotHostError",
    "WeightSyncError",
    "WeightSyncTimeoutError",
]


class BelayerClusterError(Exception):
    """Base of every belayer-cluster error."""


class ClusterConfigError(BelayerClusterError, ValueError):
    """A cluster setting that cannot work (the message names the field and what to change)."""


class RouterAccessError(ClusterConfigError):
    """The router refused the cluster's read of ``GET /workers`` (a 4xx: a wrong or missing admin
    token, a wrong router URL); the message names the status and what to fix."""


class ClusterStartError(BelayerClusterError):
    """Ray could not be started or joined, or the slots could not be placed."""


class SlotHostError(BelayerClusterError):
    """A slot host failed to start its slot, or its node is gone."""


class SandboxHostError(BelayerClusterError):
    """A sandbox host could not create, run, checkpoint or restore a sandbox (the message says why)."""


class WeightSyncError(BelayerClusterError):
    """A weight update or a node's join failed; the message names the nodes and what to do."""


class WeightSyncTimeoutError(WeightSyncError):
    """Nodes did not answer within the timeout (rendezvous or transfer); `nodes` names them."""

    def __init__(self, message: str, nodes: tuple[str, ...]) -> None:
        super().__init__(message)
        self.nodes = nodes
