"""`LocalRayCluster`: a Ray cluster of simulated nodes on this machine (`ray.cluster_utils.Cluster`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

from belayer_cluster._config import LocalClusterConfig
from belayer_cluster._errors import ClusterStartError

__all__ = ["LocalRayCluster"]


class LocalRayCluster:
    """A head node (no CPUs: nothing is placed on it) and `num_nodes` simulated worker nodes.

    Each simulated node is its own raylet with its own worker processes, so a node can be removed
    (`remove_node`) the way a machine is lost: its raylet dies and every Ray worker on it exits.
    Use as a context manager, or call `start` / `shutdown`.
    """

    def __init__(self, config: LocalClusterConfig | None = None) -> None:
        self.config = config or LocalClusterConfig()
        self._cluster: Cluster | None = None
        self._nodes: dict[str, Any] = {}  # node id (hex) -> ray's node handle, in start order
        self._removed: list[str] = []  # node ids removed by remove_node, in order
        self._session_dir: Path | None = None

    @property
    def address(self) -> str:
        """The GCS address (`ray.init(address=...)`, `belayer-cluster status --address`)."""
        return str(self._require().address)

    @property
    def node_ids(self) -> list[str]:
        """The simulated worker nodes still in the cluster, in start order (hex ids)."""
        return list(self._nodes)

    @property
    def removed_node_ids(self) -> list[str]:
        """The nodes lost through `remove_node`, in order (Ray lists them as dead)."""
        return list(self._removed)

    def start(self) -> LocalRayCluster:
        """Start the head and the nodes, wait until Ray sees them all, connect this process."""
        if self._cluster is not None:
            raise ClusterStartError("this LocalRayCluster is already started; call shutdown() first")
        if ray.is_initialized():
            raise ClusterStartError("this process is already connected to Ray; call ray.shutdown() first")
        config = self.config
        try:
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 0,
                    "include_dashboard": False,
                    "object_store_memory": config.object_store_bytes,
                    "_system_config": config.system_config(),
                },
            )
            self._cluster = cluster
            head = cluster.head_node
            assert head is not None  # initialize_head=True
            self._session_dir = Path(head.get_session_dir_path())
            for _ in range(config.num_nodes):
                node = cluster.add_node(
                    num_cpus=config.cpus_per_node, object_store_memory=config.object_store_bytes
                )
                self._nodes[node.node_id] = node
            cluster.wait_for_nodes()
            cluster.connect()  # type: ignore[no-untyped-call]
        except Exception as exc:  # ray raises plain exceptions of many kinds while starting
            self.shutdown()
            raise ClusterStartError(f"could not start a local Ray cluster: {exc}") from exc
        return self

    def add_node(self, num_cpus: float | None = None, resources: dict[str, float] | None = None) -> str:
        """Start one more simulated node (a replacement or restarted machine) and wait until Ray sees
        it; returns its node id. `num_cpus` defaults to `cpus_per_node`; `resources` are custom
        resources (place a slot on this node with `RolloutCluster(resources=...)`)."""
        cluster = self._require()
        try:
            node = cluster.add_node(
                num_cpus=self.config.cpus_per_node if num_cpus is None else num_cpus,
                resources=dict(resources or {}),
                object_store_memory=self.config.object_store_bytes,
            )
            cluster.wait_for_nodes()
        except Exception as exc:  # ray raises plain exceptions of many kinds while starting a node
            raise ClusterStartError(f"could not add a node to the local Ray cluster: {exc}") from exc
        self._nodes[node.node_id] = node
        return str(node.node_id)

    def raylet_pid(self, node_id: str) -> int:
        """The pid of a simulated node's raylet (every Ray worker of that node is its child)."""
        node = self._nodes[node_id]
        return int(node.all_processes["raylet"][0].process.pid)

    def host_pid(self, node_id: str, pid: int) -> int:
        """`pid` itself: a simulated node's processes are the host's (`IsolatedRayCluster.host_pid`
        translates a node's own pids)."""
        return pid

    def remove_node(self, node_id: str) -> None:
        """Lose a node as a machine is lost: its Ray worker processes and its raylet are SIGKILLed.

        No graceful drain. What the workers started themselves (a slot's supervisor children) is
        left to its own cleanup, as processes of a crashed worker would be; the tests check that
        belayer-shadow's death signal and guardian leave nothing behind.
        """
        raylet = self.raylet_pid(node_id)
        node = self._nodes.pop(node_id)
        self._removed.append(node_id)
        for pid in _children(raylet):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._require().remove_node(node, allow_graceful=False)

    def shutdown(self) -> None:
        """Disconnect, stop every node and remove the session's folder."""
        if ray.is_initialized():
            ray.shutdown()
        if self._cluster is not None:
            self._cluster.shutdown()  # type: ignore[no-untyped-call]
            self._cluster = None
        self._nodes.clear()
        self._removed.clear()
        if self._session_dir is not None:
            shutil.rmtree(self._session_dir, ignore_errors=True)
            self._session_dir = None

    def _require(self) -> Cluster:
        if self._cluster is None:
            raise ClusterStartError("the LocalRayCluster is not started; call start() first")
        return self._cluster

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid` (read from /proc)."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process exited meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
