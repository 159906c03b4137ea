"""`belayer_cluster.testing`: helpers for tests and demos of belayer-cluster and its callers.

`RayHead` starts an existing Ray cluster's head the way an operator does (`ray start --head`),
outside the caller's Ray connection, so that code joining a cluster by address
(`belayer_cluster.connect`, belayer-grpo's `cluster.address`) is tested against a real one.
"""

from __future__ import annotations

from belayer_cluster._ray_head import RayHead

__all__ = ["RayHead"]
