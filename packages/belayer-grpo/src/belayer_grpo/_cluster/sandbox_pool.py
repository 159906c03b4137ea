"""The run's sandbox pool on the nodes' sandbox hosts (agentic workloads on Ray)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from belayer_grpo._config import Config

if TYPE_CHECKING:
    from belayer_cluster import SandboxCluster
    from belayer_grpo._agentic.pool import SandboxPool
    from belayer_grpo._cluster.hosted_sandboxes import HostedSandboxes

__all__ = ["open_cluster_pool"]


def open_cluster_pool(
    config: Config,
    run_dir: Path,
    hosts: SandboxCluster | HostedSandboxes,
    checkpointed: Callable[[str], None],
) -> SandboxPool:
    """A `ClusterSandboxPool` on `hosts` (or on a rollout host's, `HostedSandboxes`), checkpoints in the shared directory; `checkpointed` is
    called with a sandbox's node after each of its ready checkpoints (the node-loss chaos)."""
    from belayer_envckpt import CheckpointStore
    from belayer_grpo._agentic.cluster_pool import ClusterSandboxPool
    from belayer_grpo._guardian import RUN_LABEL, run_marker
    from belayer_grpo._rollout_agentic import connect_checkpoint_engine, prepare_images

    engine = connect_checkpoint_engine()
    prepare_images(config, engine)  # one Docker daemon serves every simulated node here
    return ClusterSandboxPool(
        engine, CheckpointStore(hosts.store_dir), capacity=config.rollout.max_sandboxes,
        labels={RUN_LABEL: run_marker(run_dir)}, reuse=config.data.workload == "tooluse",
        spares=config.rollout.spare_sandboxes, hosts=hosts, checkpointed=checkpointed,
    )  # fmt: skip
