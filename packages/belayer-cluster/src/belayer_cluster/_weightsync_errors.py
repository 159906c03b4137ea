"""The errors of weight sync (issue 22), rooted at `BelayerClusterError` like every cluster error.

Kept beside the weight-sync modules so that the cluster's `_errors.py` (another engineer's file)
needs no edit; both are re-exported from `belayer_cluster`.
"""

from __future__ import annotations

from belayer_cluster._errors import BelayerClusterError

__all__ = ["WeightSyncError", "WeightSyncTimeoutError"]


class WeightSyncError(BelayerClusterError):
    """A weight update or a node's join failed; the message names the nodes and what to do."""


class WeightSyncTimeoutError(WeightSyncError):
    """Nodes did not answer within the timeout (rendezvous or transfer); `nodes` names them."""

    def __init__(self, message: str, nodes: tuple[str, ...]) -> None:
        super().__init__(message)
        self.nodes = nodes
