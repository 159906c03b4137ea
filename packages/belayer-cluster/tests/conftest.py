"""Fixtures of the Ray tests: one local Ray cluster for the session, a router and slots per module.

The modules that need Ray (test_cluster.py, test_weightsync.py) share one `LocalRayCluster`
(starting one takes a while on a loaded machine) while they ask for the same Ray settings: a
module sets `RAY_HEALTH_CHECK_FAILURES` to have Ray declare a removed node dead that many
health-check periods (1 s) after it went (the default: 5), and gets a cluster of its own when
that differs from the running one. Each module gets at least `NODES` live nodes (a node a module
before removed is replaced by a fresh one), its own shared folder, its own router and its own
slots "a" and "b", stopped when the module ends. A module sets `SLOT_OPTIONS` (belayer-shadow
`SlotConfig` fields) and `WITH_SANDBOXES = True` to give the slots a sandbox host per node.

The nodes share nothing (`IsolatedRayCluster`: each its own network, PID, IPC and mount namespaces,
its own /tmp and /dev/shm; the session's temporary folder is the one shared volume) where this
process may make namespaces (root, iproute2); `BELAYER_TEST_NODES=processes` (or no root) falls
back to `LocalRayCluster`'s simulated nodes on the host.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_helpers import TOKEN

from belayer_cluster import (
    DriverRouter,
    IsolatedRayCluster,
    LocalClusterConfig,
    LocalRayCluster,
    RolloutCluster,
    SandboxCluster,
)

NODES = 3  # live simulated nodes of 1 CPU each module starts with
DEFAULT_SLOT_OPTIONS = {"num_kv_blocks": 128, "stale_s": 5.0}  # stale_s: a loaded machine is no hang


ISOLATED = (
    os.environ.get("BELAYER_TEST_NODES", "isolated") != "processes"
    and os.geteuid() == 0
    and shutil.which("ip") is not None
    and shutil.which("unshare") is not None
)


class RayClusters:
    """The session's local Ray cluster (this process is connected to it), one at a time."""

    def __init__(self, shared: Path) -> None:
        self.shared = shared
        self.current: Any = None  # a LocalRayCluster or an IsolatedRayCluster

    def get(self, config: LocalClusterConfig) -> Any:
        """The running cluster if it has `config`, else a new one with it (the old one shut down)."""
        if self.current is not None and self.current.config != config:
            self.close()
        if self.current is None:
            if ISOLATED:
                self.current = IsolatedRayCluster(config, shared_dir=self.shared).start()
                print(f"isolated cluster started in {self.current.startup_s}")
            else:
                self.current = LocalRayCluster(config).start()
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.shutdown()
            self.current = None


@pytest.fixture(scope="session")
def ray_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayClusters]:
    """The session's local Ray clusters of `NODES` nodes, shut down when it ends; the session's
    temporary folder is what the nodes share (every module's `shared_dir` is in it)."""
    clusters = RayClusters(tmp_path_factory.getbasetemp())
    try:
        yield clusters
    finally:
        clusters.close()


@pytest.fixture(scope="module")
def local_ray(request: pytest.FixtureRequest, ray_clusters: RayClusters) -> Any:
    """The session's cluster, with the module's Ray settings and at least `NODES` live nodes."""
    failures = getattr(request.module, "RAY_HEALTH_CHECK_FAILURES", 5)
    config = LocalClusterConfig(num_nodes=NODES, cpus_per_node=1, health_check_failures=failures)
    cluster = ray_clusters.get(config)
    while len(cluster.node_ids) < NODES:
        cluster.add_node()
    return cluster


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's folder every node reads (router journal, slot run folders, checkpoints)."""
    return tmp_path_factory.mktemp("shared")


@pytest.fixture(scope="module")
def router(local_ray: Any, shared_dir: Path) -> Iterator[DriverRouter]:
    """The module's router, a process of this driver journaling to the shared folder; on the
    isolated cluster it listens on the bridge (the nodes' only way to the driver's machine)."""
    host = local_ray.head_ip if isinstance(local_ray, IsolatedRayCluster) else "127.0.0.1"
    with DriverRouter(shared_dir / "router.jsonl", admin_token=TOKEN, host=host) as driver_router:
        yield driver_router


@pytest.fixture(scope="module")
def sandboxes(local_ray: Any, shared_dir: Path) -> Iterator[SandboxCluster]:
    """A sandbox host on every live node; every sandbox is gone when the module ends."""
    hosts = SandboxCluster(shared_dir)
    hosts.start()
    try:
        yield hosts
    finally:
        hosts.stop()
        assert hosts.containers() == []


@pytest.fixture(scope="module")
def slots(
    request: pytest.FixtureRequest, local_ray: Any, router: DriverRouter, shared_dir: Path
) -> Iterator[RolloutCluster]:
    """Slots "a" and "b" on two nodes, with the module's `SLOT_OPTIONS` (and sandbox hosts if asked)."""
    with_sandboxes = getattr(request.module, "WITH_SANDBOXES", False)
    cluster = RolloutCluster(
        ["a", "b"],
        router_url=router.url,
        shared_dir=shared_dir,
        admin_token=TOKEN,
        slot_options=getattr(request.module, "SLOT_OPTIONS", DEFAULT_SLOT_OPTIONS),
        sandboxes=request.getfixturevalue("sandboxes") if with_sandboxes else None,
    )
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
