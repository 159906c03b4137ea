"""`SandboxHost`: the Ray actor that owns one node's belayer-envckpt sandboxes.

One host per node, pinned to it (node affinity, not soft). It creates sandboxes, runs their actions,
checkpoints them into the shared `CheckpointStore` every node reads, and restores a sandbox from
its latest ready checkpoint (for a sandbox whose node was lost). The checkpoint carries the
trajectory's prefix and LLM context reference, so the restored sandbox is tied to the same prefix.
With spares (`keep_spares`, `want_spares`: `HostSpares`) a restore of a ``fresh-runtime``
checkpoint goes into a started spare container of this node instead of a new one.

On this machine every simulated node talks to the one Docker daemon: a host's identity is its Ray
node, not a Docker engine of its own.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import ray

from belayer_cluster._errors import SandboxHostError
from belayer_cluster._host_spares import HostSpares, SpareSpec, sandbox_config

if TYPE_CHECKING:
    from belayer_envckpt import Checkpoint, ExecResult

__all__ = ["CLUSTER_LABEL", "HOST_NODE_LABEL", "NODE_ENV", "NODE_LABEL", "SandboxHost", "SandboxInfo"]

CLUSTER_LABEL = "belayer.cluster"  # every container a sandbox host creates carries it
# A node of an `IsolatedRayCluster` has its name in the environment: its sandbox host labels every
# container with it, so that the node owns them (the Docker daemon is the host's, shared) and they
# are removed when the node ends.
NODE_ENV = "BELAYER_NODE"
NODE_LABEL = "belayer.node"
# Every container a sandbox host creates (sandboxes, spares) carries its Ray node id: a lost node's
# containers on a daemon it shared (`LocalRayCluster`'s simulated nodes) are removed by a survivor.
HOST_NODE_LABEL = "belayer.ray-node"


@attrs.frozen
class SandboxInfo:
    """Where a trajectory's sandbox runs now: node, container, committed prefix, LLM context; after a
    restore its `belayer_envckpt.Sandbox.restore_timings_ms` (``spare_ms`` in them: into a spare)."""

    trajectory: str
    node_id: str
    container_id: str
    prefix: int
    context_ref: str
    restore_timings_ms: dict[str, float] = attrs.field(factory=dict, hash=False)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return attrs.asdict(self)


_PROBE_TRIES = 3


def _accepted_probe(
    sandbox: Any,
    trajectory: str,
    argv: list[str],
    workdir: str | None,
    accept: Callable[[ExecResult], bool] | None,
) -> ExecResult:
    """The probe's first answer `accept` takes (None: exit 0), `_PROBE_TRIES` tries with a pause
    growing by 0.5 s; `SandboxHostError` when none is taken (a pipeline on a loaded machine can
    answer exit 0 and nothing)."""
    for attempt in range(_PROBE_TRIES):
        result: ExecResult = sandbox.probe(argv, 60.0, workdir=workdir)
        if result.ok if accept is None else accept(result):
            return result
        if attempt + 1 < _PROBE_TRIES:
            time.sleep(0.5 * (attempt + 1))
    raise SandboxHostError(
        f"the probe before checkpointing {trajectory!r} gave no accepted answer in {_PROBE_TRIES} "
        f"tries (last: exit {result.exit_code}, {(result.stdout + result.stderr)[-200:]!r}); nothing "
        "was checkpointed"
    )


class SandboxHost:
    """The sandboxes of one node; created by `SandboxCluster`, one per node."""

    def __init__(self, store_dir: str, cluster_id: str) -> None:
        from belayer_envckpt import CheckpointStore, Engine

        self.node_id = ray.get_runtime_context().get_node_id()
        self.cluster_id = cluster_id
        node_name = os.environ.get(NODE_ENV, "")
        self.node_labels = {NODE_LABEL: node_name} if node_name else {}
        # On an isolated node runc and CRIU cannot run here (the containers are in the host's PID
        # namespace, not the node's): the daemon takes the dump (its checkpoint API).
        self.engine = Engine.connect(dump_method="engine" if node_name else "runc")
        self.store = CheckpointStore(Path(store_dir))
        self.sandboxes: dict[str, Any] = {}  # trajectory -> belayer_envckpt.Sandbox
        self.idle: dict[str, Any] = {}  # container id -> a parked belayer_envckpt.Sandbox (reuse)
        host_labels = {**self.node_labels, HOST_NODE_LABEL: str(self.node_id), CLUSTER_LABEL: cluster_id}
        self.spares = HostSpares(self.engine, host_labels)

    def node(self) -> str:
        """This host's Ray node id (hex)."""
        return str(self.node_id)

    def create(
        self,
        trajectory: str,
        image: str,
        limits: dict[str, Any] | None = None,
        working_dir: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> SandboxInfo:
        """A new sandbox for `trajectory` on this node (`working_dir` and `labels` as the caller's pool
        sets them; a sandbox of the trajectory already here must not be running any more)."""
        from belayer_envckpt import BelayerEnvckptError, Sandbox

        old = self.sandboxes.get(trajectory)
        if old is not None and old.is_running():
            raise SandboxHostError(f"trajectory {trajectory!r} already has a sandbox on this node")
        if old is not None:  # stopped or exited: replaced below, so its container goes now
            with contextlib.suppress(BelayerEnvckptError):
                old.remove()
        try:
            config = sandbox_config(image, working_dir, labels, limits, self.spares.host_labels)
            sandbox = Sandbox.create(self.engine, config, trajectory=trajectory)
        except (BelayerEnvckptError, TypeError) as exc:
            raise SandboxHostError(
                f"no sandbox for {trajectory!r} on node {self.node_id[:12]}: {exc}"
            ) from exc
        self.sandboxes[trajectory] = sandbox
        return self._info(trajectory, "")

    def exec(
        self, trajectory: str, command: str, timeout_s: float = 60.0, container_id: str | None = None
    ) -> tuple[ExecResult, int]:
        """Run one action in the trajectory's sandbox: its `belayer_envckpt.ExecResult` and the
        sandbox's prefix after it. With `container_id`, only in that container (else
        `SandboxHostError`)."""
        from belayer_envckpt import BelayerEnvckptError

        sandbox = self._sandbox(trajectory, container_id)
        try:
            result = sandbox.exec(command, timeout_s)
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"action in {trajectory!r} failed: {exc}") from exc
        return result, int(sandbox.prefix)

    def probe(
        self,
        trajectory: str,
        argv: list[str],
        timeout_s: float = 60.0,
        workdir: str | None = None,
        container_id: str | None = None,
    ) -> ExecResult:
        """A read-only command that is not an action (the prefix stays)."""
        from belayer_envckpt import BelayerEnvckptError

        sandbox = self._sandbox(trajectory, container_id)
        try:
            result: ExecResult = sandbox.probe(argv, timeout_s, workdir=workdir)
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"probe in {trajectory!r} failed: {exc}") from exc
        return result

    def control(self, trajectory: str, operation: str, container_id: str | None = None) -> str:
        """`kill`, `stop`, `pause`, `unpause` the sandbox, or read its `status` (the engine's word)."""
        from belayer_envckpt import BelayerEnvckptError

        if operation not in ("kill", "stop", "pause", "unpause", "status"):
            raise SandboxHostError(f"unknown sandbox operation {operation!r}")
        sandbox = self._sandbox(trajectory, container_id)
        try:
            if operation == "status":
                return str(sandbox.status())
            getattr(sandbox, operation)()
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"{operation} of {trajectory!r} failed: {exc}") from exc
        return operation

    def checkpoint(self, trajectory: str, context_ref: str) -> SandboxInfo:
        """Publish a checkpoint of the sandbox (the cheapest kind that captures it:
        `belayer_envckpt.checkpoint`), tied to its prefix and LLM context `context_ref`."""
        from belayer_envckpt import BelayerEnvckptError, checkpoint

        sandbox = self._sandbox(trajectory)
        try:
            ckpt = checkpoint(sandbox, trajectory, sandbox.prefix, context_ref, store=self.store)
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"checkpoint of {trajectory!r} failed: {exc}") from exc
        return self._info(trajectory, ckpt.context_ref)

    def next_kind(self, trajectory: str, container_id: str | None = None) -> str | None:
        """The kind a checkpoint of the sandbox would take now (`belayer_envckpt.next_checkpoint_kind`:
        ``full``, ``fresh-runtime`` or ``reference``), or None when it cannot be told (it is gone)."""
        from belayer_envckpt import BelayerEnvckptError, next_checkpoint_kind

        try:
            sandbox = self._sandbox(trajectory, container_id)
            return str(next_checkpoint_kind(sandbox, self.store, trajectory))
        except (BelayerEnvckptError, SandboxHostError, OSError):
            return None

    def checkpoint_at(
        self,
        trajectory: str,
        context_ref: str,
        prefix: int,
        probe_argv: list[str] | None = None,
        workdir: str | None = None,
        container_id: str | None = None,
        accept: Callable[[ExecResult], bool] | None = None,
    ) -> tuple[SandboxInfo, Checkpoint, ExecResult | None]:
        """Publish a checkpoint at the caller's `prefix` tied to `context_ref`, of the cheapest kind
        that captures the sandbox (`belayer_envckpt.checkpoint`: its ``kind`` says which); with
        `probe_argv`, first a read-only probe of the same state, under the same action boundary (no
        action runs in between), asked again while `accept` (by default exit 0) refuses its answer,
        3 tries, nothing checkpointed without an accepted one (`SandboxHostError`). Returns where
        the sandbox is, the `belayer_envckpt.Checkpoint` and the accepted probe answer (None
        without)."""
        from belayer_envckpt import BelayerEnvckptError, checkpoint

        sandbox = self._sandbox(trajectory, container_id)
        probed = None
        try:
            with sandbox.action_boundary():
                if probe_argv:
                    probed = _accepted_probe(sandbox, trajectory, probe_argv, workdir, accept)
                ckpt = checkpoint(sandbox, trajectory, prefix, context_ref, store=self.store)
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"checkpoint of {trajectory!r} failed: {exc}") from exc
        return self._info(trajectory, ckpt.context_ref, prefix), ckpt, probed

    def restore(self, trajectory: str, checkpoint: Checkpoint | None = None) -> SandboxInfo:
        """Bring `trajectory`'s sandbox back on this node from `checkpoint` (a
        `belayer_envckpt.Checkpoint` in the shared store), by default its latest ready one; into a
        spare of this node when one fits (its timings then hold ``spare_ms``)."""
        from belayer_envckpt import BelayerEnvckptError, full_restore

        ckpt = checkpoint if checkpoint is not None else self.store.latest_ready(trajectory)
        if ckpt is None:
            raise SandboxHostError(
                f"trajectory {trajectory!r} has no ready checkpoint in {self.store.root}; restart it "
                "from its base image"
            )
        try:
            # This node's and cluster's labels over the checkpoint's (a lost node's, another run's):
            # the container is this node's, and a spare of this node fits it.
            sandbox = full_restore(
                ckpt, engine=self.engine, labels=self.spares.host_labels, spares=self.spares.pool
            )
        except BelayerEnvckptError as exc:
            raise SandboxHostError(
                f"restore of {trajectory!r} on node {self.node_id[:12]} failed: {exc}"
            ) from exc
        self.sandboxes[trajectory] = sandbox
        return attrs.evolve(
            self._info(trajectory, str(sandbox.context_ref)),
            restore_timings_ms=dict(sandbox.restore_timings_ms),
        )

    def keep_spares(self, size: int) -> None:
        """Keep up to `size` started spare containers per sandbox configuration in use (`want_spares`)
        from now on, for restores on this node (0: none); the spares kept so far are removed."""
        self.spares.keep(size)

    def want_spares(self, specs: list[SpareSpec], wait: bool = False, generation: int | None = None) -> int:
        """Spares for the configurations `specs` (made in the background; with `wait`, ready on
        return), none for others (removed: how many is returned). An ask whose `generation` is older
        than one applied already changes nothing (it arrived late)."""
        from belayer_envckpt import BelayerEnvckptError

        try:
            return self.spares.want(specs, wait, generation)
        except BelayerEnvckptError as exc:
            raise SandboxHostError(f"no spares on node {self.node_id[:12]}: {exc}") from exc

    def remove(self, trajectory: str, container_id: str) -> bool:
        """Remove the trajectory's container `container_id` (and forget it if it is the current one)."""
        current = self.sandboxes.get(trajectory)
        if current is not None and current.id == container_id:
            del self.sandboxes[trajectory]
        return bool(self.engine.remove(container_id))

    def park(self, trajectory: str, container_id: str) -> tuple[str, str] | None:
        """Reset the trajectory's sandbox (container `container_id`) and keep it idle for another
        trajectory (`adopt`): returns its (image, working folder), or None when it cannot be reused
        (not that container, not running, a working folder of "/", the reset failed); then it is
        removed. The reset is `belayer_envckpt.Sandbox.reset_for_reuse`: every process but PID 1 killed, the working folder
        emptied; files outside the working folder are not reset."""
        from belayer_envckpt import BelayerEnvckptError

        sandbox = self.sandboxes.get(trajectory)
        if sandbox is None or sandbox.id != container_id:
            return None
        del self.sandboxes[trajectory]
        working_dir = str(sandbox.config.working_dir)
        try:
            with sandbox.action_boundary():
                reset = sandbox.reset_for_reuse(30.0)  # False for a working folder of "/"
            if reset:
                self.idle[container_id] = sandbox
                return str(sandbox.config.image), working_dir
        except BelayerEnvckptError:
            pass
        with contextlib.suppress(BelayerEnvckptError):
            sandbox.remove()
        return None

    def adopt(self, container_id: str, trajectory: str) -> SandboxInfo:
        """Hand the idle sandbox `container_id` to `trajectory` (prefix 0, no LLM context); one that
        stopped running while idle is removed (and `SandboxHostError` raised)."""
        from belayer_envckpt import BelayerEnvckptError

        current = self.sandboxes.get(trajectory)
        if current is not None and current.is_running():
            raise SandboxHostError(f"trajectory {trajectory!r} already has a sandbox on this node")
        sandbox = self.idle.pop(container_id, None)
        if sandbox is None:
            raise SandboxHostError(f"container {container_id[:12]} is not an idle sandbox of this node")
        if not sandbox.is_running():  # exited or OOM-killed while idle: nobody else removes it
            with contextlib.suppress(BelayerEnvckptError):
                sandbox.remove()
            raise SandboxHostError(f"idle sandbox {container_id[:12]} stopped running; removed")
        sandbox.trajectory, sandbox.prefix, sandbox.context_ref = trajectory, 0, ""
        self.sandboxes[trajectory] = sandbox
        return self._info(trajectory, "")

    def remove_container(self, container_id: str) -> bool:
        """Remove a container by id (a lost node's sandbox, fenced); False if it was gone."""
        return bool(self.engine.remove(container_id))

    def remove_node_containers(self, node_id: str) -> int:
        """Remove every container of this cluster that node `node_id`'s host created (its spares,
        what is left of its sandboxes), once that node is lost; how many. Only on a daemon the nodes
        share (simulated nodes): a lost machine's own daemon went with it."""
        labels = [f"{CLUSTER_LABEL}={self.cluster_id}", f"{HOST_NODE_LABEL}={node_id}"]
        return sum(bool(self.engine.remove(c.id)) for c in self.engine.list_containers(labels))

    def containers(self) -> list[str]:
        """The ids of every container of this cluster (all nodes: they share one daemon here)."""
        return [c.id for c in self.engine.list_containers([f"{CLUSTER_LABEL}={self.cluster_id}"])]

    def stop(self) -> None:
        """Remove every sandbox of this host, its spares too."""
        self.spares.close()
        for sandbox in [*self.sandboxes.values(), *self.idle.values()]:
            sandbox.remove()
        self.sandboxes.clear()
        self.idle.clear()

    def _info(self, trajectory: str, context_ref: str, prefix: int | None = None) -> SandboxInfo:
        sandbox = self.sandboxes[trajectory]
        at = int(sandbox.prefix) if prefix is None else prefix
        return SandboxInfo(trajectory, self.node_id, str(sandbox.id), at, context_ref)

    def _sandbox(self, trajectory: str, container_id: str | None = None) -> Any:
        sandbox = self.sandboxes.get(trajectory)
        if sandbox is None:
            raise SandboxHostError(f"no sandbox for trajectory {trajectory!r} on this node")
        if container_id is not None and sandbox.id != container_id:
            raise SandboxHostError(
                f"trajectory {trajectory!r} runs in container {sandbox.id[:12]} now, not {container_id[:12]} "
                "(restored or replaced since)"
            )
        return sandbox
