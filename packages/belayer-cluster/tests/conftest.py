"""Fixtures of the Ray tests: one local Ray cluster for the session, a router and slots per module.

The modules that need Ray (test_cluster.py, test_weightsync.py) share one `LocalRayCluster`
(starting one takes a while on a loaded machine) while they ask for the same Ray settings: a
module sets `RAY_HEALTH_CHECK_FAILURES` to have Ray declare a removed node dead that many
health-check periods (1 s) after it went (the default: 5), and gets a cluster of its own when
that differs from the running one. Each module gets at least `NODES` live nodes (a node a module
before removed is replaced by a fresh one), its own shared folder, its own router and its own
slots "a" and "b", stopped when the module ends. A module sets `SLOT_OPTIONS` (belayer-shadow
`SlotConfig` fields) and `WITH_SANDBOXES = True` to give the slots a sandbox host per node.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_helpers import TOKEN

from belayer_cluster import DriverRouter, LocalClusterConfig, LocalRayCluster, RolloutCluster, SandboxCluster

NODES = 3  # live simulated nodes of 1 CPU each module starts with
DEFAULT_SLOT_OPTIONS = {"num_kv_blocks": 128, "stale_s": 5.0}  # stale_s: a loaded machine is no hang


class RayClusters:
    """The session's local Ray cluster (this process is connected to it), one at a time."""

    def __init__(self) -> None:
        self.current: LocalRayCluster | None = None

    def get(self, config: LocalClusterConfig) -> LocalRayCluster:
        """The running cluster if it has `config`, else a new one with it (the old one shut down)."""
        if self.current is not None and self.current.config != config:
            self.close()
        if self.current is None:
            self.current = LocalRayCluster(config).start()
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.shutdown()
            self.current = None


@pytest.fixture(scope="session")
def ray_clusters() -> Iterator[RayClusters]:
    """The session's local Ray clusters of `NODES` simulated nodes, shut down when it ends."""
    clusters = RayClusters()
    try:
        yield clusters
    finally:
        clusters.close()


@pytest.fixture(scope="module")
def local_ray(request: pytest.FixtureRequest, ray_clusters: RayClusters) -> LocalRayCluster:
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
def router(shared_dir: Path) -> Iterator[DriverRouter]:
    """The module's router, a process of this driver journaling to the shared folder."""
    with DriverRouter(shared_dir / "router.jsonl", admin_token=TOKEN) as driver_router:
        yield driver_router


@pytest.fixture(scope="module")
def sandboxes(local_ray: LocalRayCluster, shared_dir: Path) -> Iterator[SandboxCluster]:
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
    request: pytest.FixtureRequest, local_ray: LocalRayCluster, router: DriverRouter, shared_dir: Path
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
