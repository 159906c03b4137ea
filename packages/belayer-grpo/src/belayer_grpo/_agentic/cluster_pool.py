"""`ClusterSandboxPool`: the agentic sandbox pool on belayer-cluster's sandbox hosts (one per Ray node).

With ``cluster.nodes`` / ``cluster.address`` every trajectory's sandbox is created by a node's
sandbox host (belayer-envckpt on that node's container engine), the nodes taken in turn; its
actions, probes and checkpoints run there, and checkpoints are published to the cluster's shared
directory, which every node reads.  The agent loop sees a `RemoteSandbox`, which answers the calls
it makes of a local `belayer_envckpt.Sandbox`.

When a node is lost, belayer-cluster restores its sandboxes on another node from their latest ready
checkpoint (`SandboxCluster.recover_node`).  The trajectory learns of it at its next call (the
container it held is gone: a sandbox failure) and recovers as from any sandbox failure: its latest
ready checkpoint is restored, here by adopting the sandbox the recovery already brought back (same
prefix, same LLM context reference), and the router's ``L_turn`` is checked against it.  belayer-grpo
never imports ray: this module uses belayer-cluster's public API only.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, cast

import anyio
import attrs

from belayer_envckpt import Checkpoint, ExecResult, Sandbox, SandboxConfig
from belayer_grpo._agentic.environment import REPO_HASH_SCRIPT, context_ref
from belayer_grpo._agentic.pool import SandboxLease, SandboxPool
from belayer_grpo._agentic.records import CheckpointRecord
from belayer_grpo._errors import SandboxCommandError

if TYPE_CHECKING:
    from belayer_cluster import SandboxCluster, SandboxInfo

__all__ = ["ClusterSandboxPool", "RemoteSandbox"]


class RemoteSandbox:
    """One trajectory's sandbox in one container on a node's sandbox host.

    The methods the agent loop calls on a `belayer_envckpt.Sandbox` (``exec``, ``probe``, ``kill``,
    ``status``, ``remove``, ...), carried out by the host.  Every call names this container: once
    the trajectory's sandbox runs elsewhere (its node lost, restored on another node) the call fails
    with `SandboxCommandError`, which the loop treats as a sandbox failure.
    """

    def __init__(self, hosts: SandboxCluster, trajectory: str, config: SandboxConfig, info: SandboxInfo):
        self.hosts, self.trajectory, self.config = hosts, trajectory, config
        self.container_id, self.node_id = info.container_id, info.node_id
        self.prefix, self.context_ref = info.prefix, info.context_ref
        self.restore_timings_ms: dict[str, float] = {}
        self._boundary = threading.RLock()

    @property
    def id(self) -> str:
        """The container's id."""
        return self.container_id

    def _failed(self, what: str, error: Exception) -> SandboxCommandError:
        return SandboxCommandError(
            f"{what} in sandbox {self.container_id[:12]} of {self.trajectory} on node {self.node_id[:12]} "
            f"failed: {error}"
        )

    def exec(self, command: str, timeout_s: float = 60.0) -> ExecResult:
        """Run one action (``prefix`` grows by one)."""
        from belayer_cluster import SandboxHostError

        with self._boundary:
            try:
                result = self.hosts.exec(self.trajectory, command, timeout_s, container_id=self.container_id)
            except SandboxHostError as error:
                raise self._failed("action", error) from error
            self.prefix += 1
        return ExecResult(
            result["stdout"], result["stderr"], int(result["exit_code"]), float(result["duration_s"]),
            bool(result["timed_out"]),
        )  # fmt: skip

    def probe(
        self, command: str | Sequence[str], timeout_s: float = 60.0, *, workdir: str | None = None
    ) -> ExecResult:
        """A read-only command that is not an action."""
        from belayer_cluster import SandboxHostError

        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        started = time.perf_counter()
        with self._boundary:
            try:
                result = self.hosts.probe(
                    self.trajectory, argv, timeout_s, workdir=workdir, container_id=self.container_id
                )
            except SandboxHostError as error:
                raise self._failed("probe", error) from error
        return ExecResult(
            result["stdout"], result["stderr"], int(result["exit_code"]), time.perf_counter() - started
        )

    def _control(self, operation: str) -> str:
        from belayer_cluster import SandboxHostError

        try:
            return self.hosts.control(self.trajectory, operation, container_id=self.container_id)
        except SandboxHostError as error:
            raise self._failed(operation, error) from error

    def kill(self) -> None:
        """SIGKILL the container's processes."""
        self._control("kill")

    def stop(self) -> None:
        """Stop the container."""
        self._control("stop")

    def pause(self) -> None:
        """Freeze the container's processes."""
        self._control("pause")

    def unpause(self) -> None:
        """Thaw the container."""
        self._control("unpause")

    def status(self) -> str:
        """The engine's word for the container; ``removed`` when it (or its node) is gone."""
        try:
            return self._control("status")
        except SandboxCommandError:
            return "removed"

    def is_running(self) -> bool:
        """Whether the container runs (False when it, or its node, is gone)."""
        return self.status() == "running"

    def remove(self) -> None:
        """Remove the container, wherever it is (quiet if it is gone)."""
        from belayer_cluster import SandboxHostError

        with contextlib.suppress(SandboxHostError):
            self.hosts.remove(self.trajectory, self.container_id)

    @contextlib.contextmanager
    def action_boundary(self) -> Iterator[None]:
        """Hold the sandbox between this process's calls (the host holds its own boundary too)."""
        with self._boundary:
            yield


def _remote(sandbox: Sandbox) -> RemoteSandbox:
    if not isinstance(sandbox, RemoteSandbox):
        raise TypeError(
            f"a ClusterSandboxPool sandbox must be a RemoteSandbox (got {type(sandbox).__name__})"
        )
    return sandbox


@attrs.define
class ClusterSandboxPool(SandboxPool):
    """`SandboxPool` whose sandboxes live on belayer-cluster's sandbox hosts.

    ``store`` is the shared directory's checkpoint store (the one the hosts write); ``engine`` is
    this machine's, used only to check checkpoint support.  With ``reuse`` (tooluse) a done
    trajectory's sandbox that this pool created fresh is parked on its node's host, its processes
    but PID 1 killed and its working directory emptied (`SandboxCluster.park`), and the next trajectory of the same image and
    working directory takes it (`SandboxCluster.take_idle`), on whichever node it is; a restored
    sandbox is never reused, and a lost node's parked sandboxes are fenced with it.
    """

    hosts: SandboxCluster | None = attrs.field(default=None, kw_only=True)
    # Called, in the checkpointing thread, with the sandbox's node after each ready checkpoint
    # (before the trajectory's next action); chaos.kill_node_at_step holds one trajectory there.
    checkpointed: Callable[[str], None] | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.hosts is None:
            raise ValueError("ClusterSandboxPool needs hosts (a started belayer_cluster.SandboxCluster)")

    @property
    def _hosts(self) -> SandboxCluster:
        assert self.hosts is not None
        return self.hosts

    async def _create(self, config: SandboxConfig, trajectory: str) -> Sandbox:
        from belayer_cluster import SandboxHostError

        try:
            info = await anyio.to_thread.run_sync(
                lambda: self._hosts.create(
                    trajectory, None, config.image, working_dir=config.working_dir, labels=dict(config.labels)
                )
            )
        except SandboxHostError as error:
            raise SandboxCommandError(f"no sandbox for {trajectory}: {error}") from error
        # The loop calls a sandbox's methods only; RemoteSandbox answers every one it calls.
        return cast(Sandbox, RemoteSandbox(self._hosts, trajectory, config, info))

    async def _take(self, config: SandboxConfig, trajectory: str) -> Sandbox:
        if self.reuse:
            info = await anyio.to_thread.run_sync(
                lambda: self._hosts.take_idle(trajectory, config.image, config.working_dir)
            )
            if info is not None:
                self.num_reused += 1
                return cast(Sandbox, RemoteSandbox(self._hosts, trajectory, config, info))
        sandbox = await self._create(config, trajectory)
        if self.reuse:
            self._created.add(sandbox.id)
        return sandbox

    def take_checkpoint(
        self, sandbox: Sandbox, *, trajectory: str, prefix: int, turn: int, workdir: str, context_hash: str
    ) -> CheckpointRecord:
        """The repository hash and a full checkpoint, both taken by the sandbox's host under one
        action boundary; the checkpoint lands in the shared directory."""
        from belayer_cluster import SandboxHostError

        remote = _remote(sandbox)
        started = time.perf_counter()
        ref = context_ref(trajectory, turn)
        try:
            _, checkpoint, probed = self._hosts.checkpoint_at(
                trajectory, ref, prefix, probe_argv=["/bin/sh", "-c", REPO_HASH_SCRIPT], workdir=workdir,
                container_id=remote.container_id,
            )  # fmt: skip
        except SandboxHostError as error:
            raise SandboxCommandError(f"checkpoint of {trajectory} failed: {error}") from error
        repo_hash = "" if probed is None else str(probed["stdout"]).strip()
        if probed is None or probed["exit_code"] != 0 or len(repo_hash) != 64:
            raise SandboxCommandError(f"hashing the repository of {trajectory} before its checkpoint failed")
        record = CheckpointRecord(
            prefix=prefix, turn=turn, context_ref=ref, context_hash=context_hash, repo_hash=repo_hash,
            duration_s=time.perf_counter() - started, checkpoint=checkpoint,
        )  # fmt: skip
        if self.checkpointed is not None:
            self.checkpointed(remote.node_id)
        return record

    def restore(self, checkpoint: Checkpoint, current: Sandbox) -> Sandbox:
        """The trajectory's sandbox from ``checkpoint``: on its node if alive, else on another (or
        the one a lost node's recovery already restored from this checkpoint)."""
        from belayer_cluster import SandboxHostError

        remote = _remote(current)
        try:
            info = self._hosts.restore(remote.trajectory, checkpoint, replacing=remote.container_id)
        except SandboxHostError as error:
            raise SandboxCommandError(f"restore of {remote.trajectory} failed: {error}") from error
        return cast(Sandbox, RemoteSandbox(self._hosts, remote.trajectory, remote.config, info))

    def _clean(self, lease: SandboxLease) -> None:
        sandbox = lease.sandbox
        parked = self.reuse and sandbox.id in self._created and self._hosts.park(lease.trajectory, sandbox.id)
        if not parked:
            self._created.discard(sandbox.id)
            sandbox.remove()
            self._hosts.release(lease.trajectory)  # also a sandbox a node's recovery restored meanwhile
        if not self.keep_checkpoints:
            shutil.rmtree(self.store.trajectory_dir(lease.trajectory), ignore_errors=True)

    async def aclose(self) -> None:
        """Nothing to do: every lease cleans up after itself, and the cluster's `SandboxCluster.stop`
        removes whatever is left on any node (parked sandboxes too)."""
        self._idle.clear()
        self._created.clear()
