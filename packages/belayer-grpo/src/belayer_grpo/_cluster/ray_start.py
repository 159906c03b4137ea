"""Starting and stopping what a run needs on Ray: the cluster (or joining one), the driver's
router, the sandbox hosts, the slots and the weight sync; stopped in reverse, also after a
failed start. Ray sets signal handlers: it is started and stopped from the main thread."""

from __future__ import annotations

import contextlib
import math
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from belayer_grpo._cluster.weights import SYNC_TIMEOUT_S, LiveSockets
from belayer_grpo._config import Config

if TYPE_CHECKING:
    from belayer_cluster import (
        DriverRouter,
        IsolatedRayCluster,
        LocalRayCluster,
        NodeLoss,
        RolloutCluster,
        SandboxCluster,
        WeightSync,
    )

__all__ = ["Parts", "start_ray", "start_services", "stop_all"]


@attrs.define
class Parts:
    """What has been started so far, stopped in reverse (also after a failed start)."""

    admin_token: str = attrs.field(factory=lambda: secrets.token_hex(16))
    sockets: LiveSockets = attrs.field(factory=LiveSockets)  # the live slots' weight sockets
    slot_options: dict[str, Any] = attrs.field(factory=dict)
    router: DriverRouter | None = None
    local: LocalRayCluster | IsolatedRayCluster | None = None
    rollout: RolloutCluster | None = None
    sync: WeightSync | None = None
    sandboxes: SandboxCluster | None = None
    replacements: list[RolloutCluster] = attrs.field(factory=list)


def start_ray(config: Config, parts: Parts, shared: Path) -> None:
    """Join `cluster.address`, or start a local cluster of `cluster.nodes` nodes: simulated ones,
    or with `cluster.isolated` nodes that share nothing but the network and `shared`."""
    from belayer_cluster import IsolatedRayCluster, LocalClusterConfig, LocalRayCluster, connect

    if config.cluster.address:
        connect(config.cluster.address)  # a ClusterStartError names the address
    else:
        per_node = max(1, math.ceil(config.system.num_slots / config.cluster.nodes))
        local_config = LocalClusterConfig(num_nodes=config.cluster.nodes, cpus_per_node=per_node)
        if config.cluster.isolated:
            parts.local = IsolatedRayCluster(local_config, shared_dir=shared)
        else:
            parts.local = LocalRayCluster(local_config)
        parts.local.start()


def start_services(config: Config, shared: Path, model_file: Path, weights_file: Path, parts: Parts) -> None:
    """The router (journal in `shared`), the sandbox hosts (agentic workloads), `system.num_slots`
    slots and one weight-sync agent per node beside its slots' weight servers."""
    from belayer_cluster import DriverRouter, RolloutCluster, SandboxCluster, WeightSync

    # On isolated nodes the router listens on the cluster's bridge: the nodes' way to this machine.
    host = getattr(parts.local, "head_ip", "") or "127.0.0.1"
    parts.router = router = DriverRouter(
        shared / "router.jsonl", admin_token=parts.admin_token, resume_wait_s=30.0, host=host
    )
    router.start()
    names = [f"slot{index}" for index in range(config.system.num_slots)]
    sockets = parts.sockets
    parts.slot_options = options = {
        "model": model_file,
        "weights": weights_file,
        "seed": config.model.seed,
        "recovery": config.system.recovery,
        "num_kv_blocks": config.system.kv_num_blocks,
        "block_size": config.system.kv_block_size,
        "max_num_seqs": min(config.rollout.concurrency, 256),
        "start_timeout_s": config.system.start_timeout_s,
        "stale_s": config.system.hang_threshold_s,
        "engine": config.system.engine,
    }

    def on_loss(loss: NodeLoss) -> None:
        for slot in loss.slots:
            gone = rollout.infos[slot].run_dir / "mem" / "weights.sock"
            if gone in sockets.paths:
                sockets.paths.remove(gone)

    if config.data.workload != "math":  # agentic: one sandbox host per node, checkpoints shared
        parts.sandboxes = SandboxCluster(shared, cluster_id=secrets.token_hex(6))
        parts.sandboxes.start()
    parts.rollout = rollout = RolloutCluster(
        names,
        router_url=router.url,
        shared_dir=shared,
        admin_token=parts.admin_token,
        slot_options=options,
        start_timeout_s=config.system.start_timeout_s,
        on_node_loss=on_loss,
        sandboxes=parts.sandboxes,
    )
    infos = rollout.start()
    sockets.paths.extend(infos[name].run_dir / "mem" / "weights.sock" for name in names)
    parts.sync = sync = WeightSync(
        timeout_s=SYNC_TIMEOUT_S, router_url=router.url, admin_token=parts.admin_token
    )
    by_node: dict[str, list[str]] = {}
    for name in names:
        by_node.setdefault(infos[name].node_id, []).append(name)
    for node_id, on_node in by_node.items():  # one agent per node, beside its slots' weight servers
        sync.add_node(
            node_id, sockets=[infos[name].run_dir / "mem" / "weights.sock" for name in on_node], slots=on_node
        )


def stop_all(parts: Parts) -> None:
    """Stop everything started, in reverse (blocking; from the main thread)."""
    from belayer_cluster import BelayerClusterError, disconnect

    if parts.sync is not None:
        with contextlib.suppress(BelayerClusterError):
            parts.sync.close()
    if parts.sandboxes is not None:
        parts.sandboxes.stop()  # every sandbox left on any node
    for replacement in parts.replacements:
        replacement.stop()
    if parts.rollout is not None:
        parts.rollout.stop()
    if parts.router is not None:
        parts.router.stop()
    if parts.local is not None:
        parts.local.shutdown()
    disconnect()
