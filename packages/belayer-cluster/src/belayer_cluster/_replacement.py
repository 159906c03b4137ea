"""`start_replacement_slot`: a slot on a new or restarted node that serves only the trainer's version.

A node that joins (a replacement machine, or a lost one restarted) first joins the `WeightSync`
through a fresh rendezvous and commits the current version in full on its agent's own weight
server. Its new slot then starts from that committed version (written on the node, checksum equal
to the trainer's), so the slot's engine never loads another version. Once the sync has required a
version, the router holds the registered slot out of rotation until `attach` has checked its weight
server's live checksum against the trainer's and reported its version; a slot that does not hold
it is taken out of the router's rotation for good (`WeightSyncError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from belayer_cluster._cluster import RolloutCluster
from belayer_cluster._weightsync import WeightSync

__all__ = ["start_replacement_slot"]


def start_replacement_slot(
    sync: WeightSync,
    node_id: str,
    slot: str,
    *,
    router_url: str,
    shared_dir: Path,
    admin_token: str | None = None,
    slot_options: Mapping[str, Any] | None = None,
    resources: Mapping[str, float] | None = None,
    start_timeout_s: float = 180.0,
) -> RolloutCluster:
    """Start slot `slot` on node `node_id` (placed there by `resources`, custom resources only that
    node offers) holding the sync's current version; returns its `RolloutCluster` (stop it when done).

    The node joins `sync` first if it is not a member (its agent serves a weight server of its own
    under `shared_dir`). Raises WeightSyncError when the node cannot join or the slot does not hold
    the trainer's version (the slot is then stopped and fenced), ClusterStartError when the slot
    does not start or lands on another node.
    """
    from belayer_cluster._errors import ClusterStartError

    agents = Path(shared_dir) / "agents"
    if node_id not in sync.members:
        sync.add_node(node_id, serve_dir=agents / node_id[:12])  # fresh rendezvous, current version in full
    weights = agents / f"{node_id[:12]}-{slot}-v{sync.version}.safetensors"
    sync.write_weights_file(node_id, weights)  # the node's committed version; checksum checked
    cluster = RolloutCluster(
        [slot],
        router_url=router_url,
        shared_dir=shared_dir,
        admin_token=admin_token,
        slot_options={**dict(slot_options or {}), "weights": weights},
        resources=resources,
        start_timeout_s=start_timeout_s,
    )
    info = cluster.start()[slot]
    try:
        if info.node_id != node_id:
            raise ClusterStartError(
                f"slot {slot!r} landed on node {info.node_id[:12]}, not {node_id[:12]}: give resources= "
                "that only the new node offers"
            )
        sync.attach(node_id, [info.run_dir / "mem" / "weights.sock"], [slot])  # stale: fenced, raises
    except BaseException:
        cluster.stop()
        raise
    return cluster
