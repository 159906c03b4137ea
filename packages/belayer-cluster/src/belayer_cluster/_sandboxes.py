"""`SandboxCluster`: one `SandboxHost` per node, a lost node's sandboxes restored on another node."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
from pathlib import Path
from typing import Any

import attrs
import ray
from ray.exceptions import RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from belayer_cluster._errors import ClusterStartError, SandboxHostError
from belayer_cluster._sandbox_host import SandboxHost, SandboxInfo

__all__ = ["SandboxCluster", "SandboxRestore"]


@attrs.frozen
class SandboxRestore:
    """A sandbox of a lost node brought back on another node from its latest ready checkpoint."""

    trajectory: str
    from_node: str
    to_node: str
    container_id: str  # the new container
    prefix: int  # the committed action boundary it resumes at
    context_ref: str  # the LLM context (prefix) it is tied to
    restore_s: float  # fence + restore, seconds

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return attrs.asdict(self)


class SandboxCluster:
    """Sandbox hosts on every node of the Ray cluster this process is connected to.

    Checkpoints go to `shared_dir/checkpoints`, a directory every node reads (an object store
    through an existing library in production). `recover_node(node_id)` fences the lost node's
    containers and restores each of its sandboxes on a surviving node from its latest ready
    checkpoint. Here every simulated node shares the one Docker daemon: a host is its Ray node.
    """

    def __init__(
        self, shared_dir: Path, *, call_timeout_s: float = 180.0, cluster_id: str | None = None
    ) -> None:
        if call_timeout_s <= 0:
            raise SandboxHostError(f"call_timeout_s must be > 0 (got {call_timeout_s!r})")
        self.store_dir = Path(shared_dir) / "checkpoints"
        self.call_timeout_s = call_timeout_s
        self.cluster_id = cluster_id or uuid.uuid4().hex[:12]
        self.hosts: dict[str, Any] = {}  # node id -> SandboxHost actor handle
        self.placed: dict[str, SandboxInfo] = {}  # trajectory -> where its sandbox runs now
        self.restores: list[SandboxRestore] = []
        self._turn = itertools.count()

    def start(self) -> list[str]:
        """Start one host on every alive node that has CPUs; returns their node ids."""
        if not ray.is_initialized():
            raise ClusterStartError("connect to Ray first (ray.init(address=...) or LocalRayCluster)")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        nodes = [
            n["NodeID"]
            for n in ray.nodes()  # type: ignore[no-untyped-call]
            if n["Alive"] and n.get("Resources", {}).get("CPU", 0) > 0
        ]
        actor = ray.remote(SandboxHost)
        for node_id in nodes:
            strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
            self.hosts[node_id] = actor.options(  # type: ignore[attr-defined]
                num_cpus=0, max_concurrency=4, scheduling_strategy=strategy, max_restarts=0
            ).remote(str(self.store_dir), self.cluster_id)
        try:
            for node_id, host in self.hosts.items():
                if self._get(host.node.remote()) != node_id:
                    raise SandboxHostError(f"the host for node {node_id[:12]} landed on another node")
        except SandboxHostError as exc:
            self.stop()
            raise ClusterStartError(f"a sandbox host did not start: {exc}") from exc
        return list(self.hosts)

    def create(self, trajectory: str, node_id: str, image: str = "belayer/busybox") -> SandboxInfo:
        """A sandbox for `trajectory` on `node_id`."""
        info: SandboxInfo = self._get(self._host(node_id).create.remote(trajectory, image))
        self.placed[trajectory] = info
        return info

    def exec(self, trajectory: str, command: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """One action in the trajectory's sandbox, wherever it runs now."""
        info = self.where(trajectory)
        result: dict[str, Any] = self._get(
            self._host(info.node_id).exec.remote(trajectory, command, timeout_s)
        )
        self.placed[trajectory] = attrs.evolve(info, prefix=int(result["prefix"]))
        return result

    def checkpoint(self, trajectory: str, context_ref: str) -> SandboxInfo:
        """Publish a checkpoint of the trajectory's sandbox, tied to its LLM context `context_ref`."""
        info: SandboxInfo = self._get(
            self._host(self.where(trajectory).node_id).checkpoint.remote(trajectory, context_ref)
        )
        self.placed[trajectory] = info
        return info

    def where(self, trajectory: str) -> SandboxInfo:
        """Where the trajectory's sandbox runs now."""
        try:
            return self.placed[trajectory]
        except KeyError:
            raise SandboxHostError(f"no sandbox for trajectory {trajectory!r}; create() it first") from None

    def recover_node(self, node_id: str) -> list[SandboxRestore]:
        """Fence a lost node's sandboxes and restore each on a surviving node (latest ready checkpoint)."""
        lost_host = self.hosts.pop(node_id, None)
        if lost_host is not None:
            with contextlib.suppress(RayError):
                ray.kill(lost_host)
        survivors = list(self.hosts)
        lost = [t for t, info in self.placed.items() if info.node_id == node_id]
        if lost and not survivors:
            raise SandboxHostError(f"node {node_id[:12]} was lost and no node is left to restore {lost} on")
        done: list[SandboxRestore] = []
        for trajectory in lost:
            began = time.monotonic()
            old = self.placed[trajectory]
            target = survivors[next(self._turn) % len(survivors)]
            host = self.hosts[target]
            # The lost machine's container would be gone with it; on the shared daemon, fence it.
            self._get(host.remove_container.remote(old.container_id))
            info: SandboxInfo = self._get(host.restore.remote(trajectory))
            self.placed[trajectory] = info
            done.append(
                SandboxRestore(
                    trajectory,
                    node_id,
                    target,
                    info.container_id,
                    info.prefix,
                    info.context_ref,
                    time.monotonic() - began,
                )
            )
        self.restores += done
        return done

    def containers(self) -> list[str]:
        """Every container of this cluster that exists (any node)."""
        for host in self.hosts.values():
            with contextlib.suppress(SandboxHostError):
                found: list[str] = self._get(host.containers.remote())
                return found
        return []

    def stop(self) -> None:
        """Remove every sandbox (also any a lost node left) and the hosts."""
        leftovers = self.containers()
        for host in self.hosts.values():
            with contextlib.suppress(SandboxHostError):
                self._get(host.stop.remote())
        for host in list(self.hosts.values())[:1]:
            for container_id in leftovers:
                with contextlib.suppress(SandboxHostError):
                    self._get(host.remove_container.remote(container_id))
        for host in self.hosts.values():
            with contextlib.suppress(RayError):
                ray.kill(host)
        self.hosts.clear()

    def _host(self, node_id: str) -> Any:
        try:
            return self.hosts[node_id]
        except KeyError:
            raise SandboxHostError(f"no sandbox host on node {node_id[:12]} (lost, or not a node)") from None

    def _get(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self.call_timeout_s)
        except SandboxHostError:
            raise
        except RayError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, SandboxHostError):
                raise cause from exc
            raise SandboxHostError(f"a sandbox host call failed: {exc}") from exc
