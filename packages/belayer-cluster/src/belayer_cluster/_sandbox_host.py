"""`SandboxHost`: the Ray actor that owns one node's belayer-envckpt sandboxes.

One host per node, pinned to it (node affinity, not soft). It creates sandboxes, runs their actions,
checkpoints them into the shared `CheckpointStore` every node reads, and restores a sandbox from
its latest ready checkpoint (for a sandbox whose node was lost). The checkpoint carries the
trajectory's prefix and LLM context reference, so the restored sandbox is tied to the same prefix.

On this machine every simulated node talks to the one Docker daemon: a host's identity is its Ray
node, not a Docker engine of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import ray

from belayer_cluster._errors import SandboxHostError

__all__ = ["CLUSTER_LABEL", "SandboxHost", "SandboxInfo"]

CLUSTER_LABEL = "belayer.cluster"  # every container a sandbox host creates carries it


@attrs.frozen
class SandboxInfo:
    """Where a trajectory's sandbox runs now: node, container, committed prefix, LLM context."""

    trajectory: str
    node_id: str
    container_id: str
    prefix: int
    context_ref: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return attrs.asdict(self)


class SandboxHost:
    """The sandboxes of one node; created by `SandboxCluster`, one per node."""

    def __init__(self, store_dir: str, cluster_id: str) -> None:
        from belayer_envckpt import CheckpointStore, Engine

        self.node_id = ray.get_runtime_context().get_node_id()
        self.cluster_id = cluster_id
        self.engine = Engine.connect()
        self.store = CheckpointStore(Path(store_dir))
        self.sandboxes: dict[str, Any] = {}  # trajectory -> belayer_envckpt.Sandbox

    def node(self) -> str:
        """This host's Ray node id (hex)."""
        return str(self.node_id)

    def create(self, trajectory: str, image: str, limits: dict[str, Any] | None = None) -> SandboxInfo:
        """A new sandbox for `trajectory` on this node."""
        from belayer_envckpt import BelayerEnvckptError, Sandbox, SandboxConfig, SandboxLimits

        if trajectory in self.sandboxes:
            raise SandboxHostError(f"trajectory {trajectory!r} already has a sandbox on this node")
        try:
            config = SandboxConfig(
                image=image,
                labels={CLUSTER_LABEL: self.cluster_id},
                limits=SandboxLimits(**limits) if limits else SandboxLimits(),
            )
            sandbox = Sandbox.create(self.engine, config, trajectory=trajectory)
        except (BelayerEnvckptError, TypeError) as exc:
            raise SandboxHostError(
                f"no sandbox for {trajectory!r} on node {self.node_id[:12]}: {exc}"
            ) from exc
        self.sandboxes[trajectory] = sandbox
        return self._info(trajectory, "")

    def exec(self, trajectory: str, command: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Run one action in the trajectory's sandbox: stdout, stderr, exit_code, timed_out, prefix."""
        from belayer_envckpt import BelayerEnvckptError

        sandbox = self._sandbox(trajectory)
        try:
            result = sandbox.exec(command, timeout_s)
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"action in {trajectory!r} failed: {exc}") from exc
        return {
            "stdout": result.stdout,
            "stderr": result.stderr,
            "exit_code": result.exit_code,
            "timed_out": result.timed_out,
            "prefix": sandbox.prefix,
        }

    def checkpoint(self, trajectory: str, context_ref: str) -> SandboxInfo:
        """Publish a full checkpoint of the sandbox, tied to its prefix and LLM context `context_ref`."""
        from belayer_envckpt import BelayerEnvckptError, full_checkpoint

        sandbox = self._sandbox(trajectory)
        try:
            ckpt = full_checkpoint(
                sandbox, trajectory, prefix=sandbox.prefix, context_ref=context_ref, store=self.store
            )
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"checkpoint of {trajectory!r} failed: {exc}") from exc
        return self._info(trajectory, ckpt.context_ref)

    def restore(self, trajectory: str) -> SandboxInfo:
        """Bring `trajectory`'s sandbox back on this node from its latest ready checkpoint."""
        from belayer_envckpt import BelayerEnvckptError, full_restore

        ckpt = self.store.latest_ready(trajectory)
        if ckpt is None:
            raise SandboxHostError(
                f"trajectory {trajectory!r} has no ready checkpoint in {self.store.root}; restart it "
                "from its base image"
            )
        try:
            sandbox = full_restore(ckpt, engine=self.engine)
        except BelayerEnvckptError as exc:
            raise SandboxHostError(
                f"restore of {trajectory!r} on node {self.node_id[:12]} failed: {exc}"
            ) from exc
        self.sandboxes[trajectory] = sandbox
        return self._info(trajectory, str(sandbox.context_ref))

    def remove_container(self, container_id: str) -> bool:
        """Remove a container by id (a lost node's sandbox, fenced); False if it was gone."""
        return bool(self.engine.remove(container_id))

    def containers(self) -> list[str]:
        """The ids of every container of this cluster (all nodes: they share one daemon here)."""
        return [c.id for c in self.engine.list_containers([f"{CLUSTER_LABEL}={self.cluster_id}"])]

    def stop(self) -> None:
        """Remove every sandbox of this host."""
        for sandbox in self.sandboxes.values():
            sandbox.remove()
        self.sandboxes.clear()

    def _info(self, trajectory: str, context_ref: str) -> SandboxInfo:
        sandbox = self.sandboxes[trajectory]
        return SandboxInfo(trajectory, self.node_id, str(sandbox.id), int(sandbox.prefix), context_ref)

    def _sandbox(self, trajectory: str) -> Any:
        try:
            return self.sandboxes[trajectory]
        except KeyError:
            raise SandboxHostError(f"no sandbox for trajectory {trajectory!r} on this node") from None
