"""`cluster.replace_lost_nodes`: a new simulated node and slot for each slot a lost node took."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

if TYPE_CHECKING:
    from belayer_cluster import IsolatedRayCluster, LocalRayCluster, RolloutCluster, WeightSync

__all__ = ["NodeReplacer"]


@attrs.define
class NodeReplacer:
    """Starts, for each slot of a lost node, a replacement slot (`<slot>-r`) on a new simulated node
    that joins the weight sync with the current version and only then serves."""

    local: LocalRayCluster | IsolatedRayCluster
    sync: WeightSync
    router_url: str
    shared_dir: Path
    admin_token: str
    slot_options: dict[str, Any]
    replacements: list[RolloutCluster]  # the replacement slots' clusters (stopped with the rest)

    def replace(self, losses: list[dict[str, Any]]) -> list[tuple[str, RolloutCluster]]:
        """Replace the slots of every loss not handled yet; returns the new (slot, its cluster).

        Each loss gets `replaced_by` (slot, node, weights version and checksum, start time) or
        `replacement_error` (a replacement that failed to start: training goes on without it).
        Called by the weight push after the update (the trainer's thread, between rollouts).
        """
        from belayer_cluster import BelayerClusterError, start_replacement_slot

        started_slots = []
        for loss in losses:
            if "replaced_by" in loss or "replacement_error" in loss:
                continue
            for slot in loss["slots"]:
                name, started = f"{slot}-r", time.monotonic()
                resource = {f"belayer-replacement-{name}": 1.0}  # only the new node offers it
                try:
                    node_id = self._add_node(resource)
                    cluster = start_replacement_slot(
                        self.sync,
                        node_id,
                        name,
                        router_url=self.router_url,
                        shared_dir=self.shared_dir,
                        admin_token=self.admin_token,
                        slot_options=self.slot_options,
                        resources=resource,
                    )
                except BelayerClusterError as error:
                    loss["replacement_error"] = str(error)
                    continue
                self.replacements.append(cluster)
                started_slots.append((name, cluster))
                loss["replaced_by"] = {
                    "slot": name,
                    "node_id": node_id,
                    "weights_version": self.sync.members[node_id].version,
                    "weights_checksum": self.sync.members[node_id].checksum,
                    "start_s": time.monotonic() - started,
                }
        return started_slots

    def _add_node(self, resource: dict[str, float]) -> str:
        """A new simulated node, one CPU more than the slot takes (Ray reschedules the lost node's
        placement-group bundle onto a free CPU). Ray starts a node only from the main thread (signal
        handlers): from the push's worker thread, through the event loop's thread."""
        local, cpus = self.local, self.local.config.cpus_per_node + 1
        if threading.current_thread() is threading.main_thread():
            return local.add_node(num_cpus=cpus, resources=resource)
        return anyio.from_thread.run_sync(lambda: local.add_node(num_cpus=cpus, resources=resource))
