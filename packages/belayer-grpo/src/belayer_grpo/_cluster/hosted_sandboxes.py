"""The nodes' sandbox hosts of a rollout host's cluster, as the trainer's sandbox pool calls them.

On Ray with ``system.resume_grace_s > 0`` the rollout host is the Ray driver
(`belayer_grpo._cluster.hosted`): belayer-cluster's `SandboxCluster`, its sandbox host on every
node and every sandbox live in it, not in the trainer, so a SIGKILLed trainer ends none of them.
The trainer's `ClusterSandboxPool` gets `HostedSandboxes`, which answers the calls the pool and its
`belayer_cluster.RemoteSandbox` make (`belayer_cluster.SandboxCalls`, and create, take, park,
release, spares) by sending each through the host's control socket (one JSON line each way, a
connection per call); `answer_sandboxes` is the host's side, which makes the same call on its
`SandboxCluster` in a thread.  What travels: a `SandboxInfo` and an `ExecResult` as their fields,
a checkpoint as its folder in the cluster's shared store (read back with `Checkpoint.load`), the
probe's acceptance test by name (``repository_hash``); a `SandboxHostError` (or a
`belayer_envckpt` error, such as a corrupt checkpoint) comes back as a `SandboxHostError`, so a
`RemoteSandbox` call fails as a direct one does and the trajectory recovers as from any sandbox
failure.  Where a sandbox runs (`SandboxCluster.placed`), the parked ones and the spares stay in
the host and outlive the trainer.

A trainer that adopts the host (``--resume``) first calls ``sandboxes_open``: the sandboxes the
killed trainer's trajectories held are removed (they are mid-trajectory, and no lease holds them
now; a resumed trajectory restores its latest logged checkpoint on a node instead, as on one
machine), parked (reset) ones stay for reuse.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import attrs

from belayer_grpo._rollout_host import _call

if TYPE_CHECKING:
    from belayer_cluster import SandboxCluster, SandboxInfo
    from belayer_envckpt import Checkpoint, ExecResult
    from belayer_grpo._cluster.system import ClusterSystem

__all__ = ["SANDBOX_OPS", "HostedSandboxes", "answer_sandboxes"]

# Longer than any one call's own limit (`SandboxCluster.call_timeout_s`, 180 s; a node-loss
# chaos hold in ``sandbox_checkpointed``): a host that dies ends the connection at once anyway.
_CALL_TIMEOUT_S = 900.0
_ACCEPT = "repository_hash"  # the only acceptance test a probe before a checkpoint sends


def _info(fields: dict[str, Any]) -> SandboxInfo:
    from belayer_cluster import SandboxInfo

    return SandboxInfo(**fields)


def _result(fields: dict[str, Any]) -> ExecResult:
    from belayer_envckpt import ExecResult

    return ExecResult(**fields)


def _checkpoint(path: str) -> Checkpoint:
    from belayer_envckpt import Checkpoint

    return Checkpoint.load(Path(path))


@attrs.define
class HostedSandboxes:
    """`SandboxCluster`'s calls, carried out by the rollout host's (``socket``: its control socket)."""

    socket: Path
    store_dir: Path  # the cluster's shared checkpoint store (the host's `SandboxCluster.store_dir`)

    def _ask(self, op: str, **fields: Any) -> Any:
        from belayer_cluster import SandboxHostError

        answer = _call(self.socket, {"op": op, **fields}, timeout_s=_CALL_TIMEOUT_S)
        if "sandbox_error" in answer:
            raise SandboxHostError(str(answer["sandbox_error"]))
        return answer["value"]

    def open(self) -> int:
        """Begin this trainer's pool: the sandboxes a killed trainer's trajectories held are removed;
        how many."""
        return int(self._ask("sandboxes_open"))

    def create(
        self,
        trajectory: str,
        node_id: str | None = None,
        image: str = "belayer/busybox",
        *,
        working_dir: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> SandboxInfo:
        """`SandboxCluster.create`."""
        fields = {"trajectory": trajectory, "node_id": node_id, "image": image, "working_dir": working_dir}
        return _info(self._ask("sandbox_create", **fields, labels=labels))

    def keep_spares(self, size: int) -> None:
        """`SandboxCluster.keep_spares`."""
        self._ask("sandbox_keep_spares", size=size)

    def warm_spares(
        self,
        image: str = "belayer/busybox",
        *,
        working_dir: str | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        """`SandboxCluster.warm_spares`."""
        self._ask("sandbox_warm_spares", image=image, working_dir=working_dir, labels=labels)

    def take_idle(self, trajectory: str, image: str, working_dir: str) -> SandboxInfo | None:
        """`SandboxCluster.take_idle`."""
        found = self._ask("sandbox_take_idle", trajectory=trajectory, image=image, working_dir=working_dir)
        return None if found is None else _info(found)

    def park(self, trajectory: str, container_id: str) -> bool:
        """`SandboxCluster.park`."""
        return bool(self._ask("sandbox_park", trajectory=trajectory, container_id=container_id))

    def release(self, trajectory: str) -> None:
        """`SandboxCluster.release`."""
        self._ask("sandbox_release", trajectory=trajectory)

    def exec(
        self, trajectory: str, command: str, timeout_s: float = 60.0, *, container_id: str | None = None
    ) -> ExecResult:
        """`SandboxCluster.exec`."""
        fields = {
            "trajectory": trajectory,
            "command": command,
            "timeout_s": timeout_s,
            "container_id": container_id,
        }
        return _result(self._ask("sandbox_exec", **fields))

    def probe(
        self,
        trajectory: str,
        argv: list[str],
        timeout_s: float = 60.0,
        *,
        workdir: str | None = None,
        container_id: str | None = None,
    ) -> ExecResult:
        """`SandboxCluster.probe`."""
        fields = {"trajectory": trajectory, "argv": argv, "timeout_s": timeout_s, "workdir": workdir}
        return _result(self._ask("sandbox_probe", **fields, container_id=container_id))

    def control(self, trajectory: str, operation: str, *, container_id: str | None = None) -> str:
        """`SandboxCluster.control`."""
        fields = {"trajectory": trajectory, "operation": operation, "container_id": container_id}
        return str(self._ask("sandbox_control", **fields))

    def checkpoint_at(
        self,
        trajectory: str,
        context_ref: str,
        prefix: int,
        *,
        probe_argv: list[str] | None = None,
        workdir: str | None = None,
        container_id: str | None = None,
        accept: Callable[[ExecResult], bool] | None = None,
    ) -> tuple[SandboxInfo, Checkpoint, ExecResult | None]:
        """`SandboxCluster.checkpoint_at`; ``accept`` only `is_repository_hash` (or None): the host
        holds its own copy of the test, a function does not travel."""
        from belayer_grpo._agentic.environment import is_repository_hash

        if accept not in (None, is_repository_hash):
            raise ValueError("a hosted checkpoint_at takes accept=is_repository_hash or None")
        fields = {
            "trajectory": trajectory,
            "context_ref": context_ref,
            "prefix": prefix,
            "probe_argv": probe_argv,
        }
        answer = self._ask(
            "sandbox_checkpoint_at", **fields, workdir=workdir, container_id=container_id,
            accept=None if accept is None else _ACCEPT,
        )  # fmt: skip
        probed = answer["probed"]
        return (
            _info(answer["info"]),
            _checkpoint(answer["checkpoint"]),
            None if probed is None else _result(probed),
        )

    def next_kind(self, trajectory: str, *, container_id: str | None = None) -> str | None:
        """`SandboxCluster.next_kind`."""
        kind = self._ask("sandbox_next_kind", trajectory=trajectory, container_id=container_id)
        return None if kind is None else str(kind)

    def restore(self, trajectory: str, checkpoint: Checkpoint, *, replacing: str = "") -> SandboxInfo:
        """`SandboxCluster.restore` (the checkpoint sent as its folder in the shared store)."""
        fields = {"trajectory": trajectory, "checkpoint": str(checkpoint.path), "replacing": replacing}
        return _info(self._ask("sandbox_restore", **fields))

    def remove(self, trajectory: str, container_id: str) -> None:
        """`SandboxCluster.remove`."""
        self._ask("sandbox_remove", trajectory=trajectory, container_id=container_id)

    def checkpointed(self, node_id: str) -> None:
        """`ClusterSystem.chaos.checkpointed`: a sandbox on ``node_id`` has a ready checkpoint (the
        node-loss chaos may hold the caller here until the node is gone)."""
        self._ask("sandbox_checkpointed", node_id=node_id)


def _fields(value: Any) -> Any:
    return None if value is None else attrs.asdict(value)


def _open(system: ClusterSystem, sandboxes: SandboxCluster, _: dict[str, Any]) -> int:
    """A new trainer's pool: remove every sandbox a trajectory still holds (a killed trainer's)."""
    held = list(sandboxes.placed)
    for trajectory in held:
        sandboxes.release(trajectory)
    return len(held)


def _checkpoint_at(system: ClusterSystem, sandboxes: SandboxCluster, r: dict[str, Any]) -> dict[str, Any]:
    from belayer_grpo._agentic.environment import is_repository_hash

    info, checkpoint, probed = sandboxes.checkpoint_at(
        r["trajectory"], r["context_ref"], int(r["prefix"]), probe_argv=r["probe_argv"], workdir=r["workdir"],
        container_id=r["container_id"], accept=is_repository_hash if r["accept"] == _ACCEPT else None,
    )  # fmt: skip
    return {"info": info.to_dict(), "checkpoint": str(checkpoint.path), "probed": _fields(probed)}


_Handler = Callable[["ClusterSystem", "SandboxCluster", dict[str, Any]], Any]
_HANDLERS: dict[str, _Handler] = {
    "sandboxes_open": _open,
    "sandbox_create": lambda _, s, r: s.create(
        r["trajectory"], r["node_id"], r["image"], working_dir=r["working_dir"], labels=r["labels"]
    ).to_dict(),
    "sandbox_keep_spares": lambda _, s, r: s.keep_spares(int(r["size"])),
    "sandbox_warm_spares": lambda _, s, r: s.warm_spares(
        r["image"], working_dir=r["working_dir"], labels=r["labels"]
    ),
    "sandbox_take_idle": lambda _, s, r: _fields(s.take_idle(r["trajectory"], r["image"], r["working_dir"])),
    "sandbox_park": lambda _, s, r: s.park(r["trajectory"], r["container_id"]),
    "sandbox_release": lambda _, s, r: s.release(r["trajectory"]),
    "sandbox_exec": lambda _, s, r: _fields(
        s.exec(r["trajectory"], r["command"], float(r["timeout_s"]), container_id=r["container_id"])
    ),
    "sandbox_probe": lambda _, s, r: _fields(
        s.probe(
            r["trajectory"],
            r["argv"],
            float(r["timeout_s"]),
            workdir=r["workdir"],
            container_id=r["container_id"],
        )
    ),
    "sandbox_control": lambda _, s, r: s.control(
        r["trajectory"], r["operation"], container_id=r["container_id"]
    ),
    "sandbox_checkpoint_at": _checkpoint_at,
    "sandbox_next_kind": lambda _, s, r: s.next_kind(r["trajectory"], container_id=r["container_id"]),
    "sandbox_restore": lambda _, s, r: s.restore(
        r["trajectory"], _checkpoint(r["checkpoint"]), replacing=r["replacing"]
    ).to_dict(),
    "sandbox_remove": lambda _, s, r: s.remove(r["trajectory"], r["container_id"]),
    "sandbox_checkpointed": lambda system, _, r: system.chaos.checkpointed(r["node_id"]),
}
SANDBOX_OPS = frozenset(_HANDLERS)


async def answer_sandboxes(system: ClusterSystem, request: dict[str, Any]) -> dict[str, Any]:
    """The host's answer to one of `SANDBOX_OPS`: ``{"value": ...}``, or ``{"sandbox_error": ...}``
    when the sandbox host could not do it (the trainer raises `SandboxHostError`)."""
    from belayer_cluster import SandboxHostError
    from belayer_envckpt import BelayerEnvckptError
    from belayer_grpo._errors import SystemStartError

    sandboxes = system.sandboxes
    if sandboxes is None:
        raise SystemStartError("this cluster run has no sandbox hosts (a math workload)")
    handler = _HANDLERS[str(request["op"])]
    try:
        value = await anyio.to_thread.run_sync(handler, system, sandboxes, request)
    except (SandboxHostError, BelayerEnvckptError) as error:
        return {"sandbox_error": f"{type(error).__name__}: {error}"}
    return {"value": value}
