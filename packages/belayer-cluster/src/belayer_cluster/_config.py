"""`LocalClusterConfig`: a local Ray cluster of simulated nodes with fast node-death detection."""

from __future__ import annotations

from typing import Any

import attrs

from belayer_cluster._errors import ClusterConfigError

__all__ = ["LocalClusterConfig"]


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ClusterConfigError(f"{name} must be > 0 (got {value!r})")


@attrs.frozen
class LocalClusterConfig:
    """N simulated nodes on this machine (`ray.cluster_utils.Cluster`), for tests and demos.

    `cpus_per_node` is what each simulated node offers Ray (one slot takes `cpus_per_slot` of it);
    the health-check settings make a removed node dead within a few seconds (Ray's defaults take
    about 15 s): a check every `health_check_period_s`, each with `health_check_timeout_s`,
    `health_check_failures` misses in a row.
    """

    num_nodes: int = 2
    cpus_per_node: int = 1
    object_store_bytes: int = 80 * 1024 * 1024
    # Tight enough that a removed node is dead within about 5 s, loose enough that a live node on a
    # loaded 2-core machine (CI) is never declared dead for a slow answer.
    health_check_period_s: float = 1.0
    health_check_timeout_s: float = 2.0
    health_check_failures: int = 5

    def __attrs_post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ClusterConfigError(f"num_nodes must be >= 1 (got {self.num_nodes})")
        if self.cpus_per_node < 1:
            raise ClusterConfigError(f"cpus_per_node must be >= 1 (got {self.cpus_per_node})")
        if self.object_store_bytes < 80 * 1024 * 1024:
            raise ClusterConfigError("object_store_bytes must be >= 80 MiB (Ray's minimum is 75 MiB)")
        _positive("health_check_period_s", self.health_check_period_s)
        _positive("health_check_timeout_s", self.health_check_timeout_s)
        if self.health_check_failures < 1:
            raise ClusterConfigError(f"health_check_failures must be >= 1 (got {self.health_check_failures})")

    def system_config(self) -> dict[str, Any]:
        """Ray's `_system_config` for the head node (the GCS runs the health checks)."""
        return {
            "health_check_period_ms": int(self.health_check_period_s * 1000),
            "health_check_timeout_ms": int(self.health_check_timeout_s * 1000),
            "health_check_failure_threshold": self.health_check_failures,
            "health_check_initial_delay_ms": 0,
        }
