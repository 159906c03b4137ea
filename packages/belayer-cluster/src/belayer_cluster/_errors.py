"""Every error belayer-cluster raises, rooted at `BelayerClusterError`."""

from __future__ import annotations

__all__ = [
    "BelayerClusterError",
    "ClusterConfigError",
    "ClusterStartError",
    "SandboxHostError",
    "SlotHostError",
]


class BelayerClusterError(Exception):
    """Base of every belayer-cluster error."""


class ClusterConfigError(BelayerClusterError, ValueError):
    """A cluster setting that cannot work (the message names the field and what to change)."""


class ClusterStartError(BelayerClusterError):
    """Ray could not be started or joined, or the slots could not be placed."""


class SlotHostError(BelayerClusterError):
    """A slot host failed to start its slot, or its node is gone."""


class SandboxHostError(BelayerClusterError):
    """A sandbox host could not create, run, checkpoint or restore a sandbox (the message says why)."""
