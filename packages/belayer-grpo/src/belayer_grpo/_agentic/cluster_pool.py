"""`ClusterSandboxPool`: the agentic sandbox pool on belayer-cluster's sandbox hosts (one per Ray node).

With ``cluster.nodes`` / ``cluster.address`` every trajectory's sandbox is created by a node's
sandbox host (through the rollout host's `belayer_cluster.SandboxCluster` when that is the Ray
driver: `belayer_grpo._cluster.hosted_sandboxes`) (belayer-envckpt on that node's container engine), the nodes taken in turn; its
actions, probes and checkpoints run there, and checkpoints are published to the cluster's shared
directory, which every node reads.  The agent loop sees a `belayer_cluster.RemoteSandbox`, a
`belayer_envckpt.SandboxLike` as a local `belayer_envckpt.Sandbox` is.

With ``spares`` (``rollout.spare_sandboxes``) every node's sandbox host keeps that many started
spare containers per sandbox configuration (`SandboxCluster.keep_spares`, belayer-envckpt's
`SparePool` on the node): a restore on a node, a lost node's sandbox's on a survivor too, goes into
one of that node's when it fits, and its timings hold ``spare_ms`` as on one machine.

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
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio
import attrs

from belayer_envckpt import Checkpoint, SandboxConfig, SandboxLike
from belayer_grpo._agentic.environment import REPO_HASH_SCRIPT, context_ref, is_repository_hash
from belayer_grpo._agentic.pool import SandboxLease, SandboxPool
from belayer_grpo._agentic.records import CheckpointRecord
from belayer_grpo._errors import SandboxCommandError, SystemStartError

if TYPE_CHECKING:
    from belayer_cluster import RemoteSandbox, SandboxCluster
    from belayer_grpo._cluster.hosted_sandboxes import HostedSandboxes

__all__ = ["ClusterSandboxPool"]


def _remote(sandbox: SandboxLike) -> RemoteSandbox:
    from belayer_cluster import RemoteSandbox

    if not isinstance(sandbox, RemoteSandbox):
        raise TypeError(
            f"a ClusterSandboxPool sandbox must be a belayer_cluster.RemoteSandbox (got {type(sandbox).__name__})"
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
    sandbox is never reused, and a lost node's parked sandboxes are fenced with it.  ``spares``
    are kept by every node's host (`SandboxCluster.keep_spares`), not on this machine.
    """

    # `HostedSandboxes` when the rollout host is the Ray driver (each call through its socket)
    hosts: SandboxCluster | HostedSandboxes | None = attrs.field(default=None, kw_only=True)
    # Called, in the checkpointing thread, with the sandbox's node after each ready checkpoint
    # (before the trajectory's next action); chaos.kill_node_at_step holds one trajectory there.
    checkpointed: Callable[[str], None] | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if self.hosts is None:
            raise ValueError("ClusterSandboxPool needs hosts (a started belayer_cluster.SandboxCluster)")
        super().__attrs_post_init__()

    def _open_spares(self) -> None:
        """A restore runs in the sandbox's node's host: every host keeps the spares."""
        self._hosts.keep_spares(self.spares)

    async def warm_spares(self, image: str, workdir: str) -> None:
        """Make every node's spares for ``image`` and ``workdir`` ready now (nothing without
        ``spares``; a `create` otherwise asks for them in the background)."""
        config = self.sandbox_config(image, workdir)
        if self.spares:
            await anyio.to_thread.run_sync(
                lambda: self._hosts.warm_spares(
                    config.image, working_dir=config.working_dir, labels=dict(config.labels)
                )
            )

    @property
    def _hosts(self) -> SandboxCluster | HostedSandboxes:
        assert self.hosts is not None
        return self.hosts

    async def _create(self, config: SandboxConfig, trajectory: str) -> SandboxLike:
        from belayer_cluster import RemoteSandbox, SandboxHostError

        try:
            info = await anyio.to_thread.run_sync(
                lambda: self._hosts.create(
                    trajectory, None, config.image, working_dir=config.working_dir, labels=dict(config.labels)
                )
            )
        except SandboxHostError as error:
            raise SandboxCommandError(f"no sandbox for {trajectory}: {error}") from error
        return RemoteSandbox(self._hosts, info, config)

    async def _take(self, config: SandboxConfig, trajectory: str) -> SandboxLike:
        from belayer_cluster import RemoteSandbox

        if self.reuse:
            info = await anyio.to_thread.run_sync(
                lambda: self._hosts.take_idle(trajectory, config.image, config.working_dir)
            )
            if info is not None:
                self.num_reused += 1
                return RemoteSandbox(self._hosts, info, config)
        sandbox = await self._create(config, trajectory)
        if self.reuse:
            self._created.add(sandbox.id)
        return sandbox

    def take_checkpoint(
        self,
        sandbox: SandboxLike,
        *,
        trajectory: str,
        prefix: int,
        turn: int,
        workdir: str,
        context_hash: str,
        previous: CheckpointRecord | None = None,
    ) -> CheckpointRecord:
        """The repository hash and a checkpoint of the same state (the cheapest kind that captures
        it), both taken by the sandbox's host (`belayer_cluster.RemoteSandbox.probe_then_checkpoint`);
        the checkpoint lands in the shared directory.  (``previous`` is not used: the host probes
        every time.)"""
        remote = _remote(sandbox)
        started = time.perf_counter()
        ref = context_ref(trajectory, turn)
        probed, checkpoint = remote.probe_then_checkpoint(
            REPO_HASH_SCRIPT, prefix=prefix, context_ref=ref, workdir=workdir, accept=is_repository_hash
        )
        record = CheckpointRecord(
            prefix=prefix, turn=turn, context_ref=ref, context_hash=context_hash,
            repo_hash=probed.stdout.strip(), duration_s=time.perf_counter() - started, checkpoint=checkpoint,
            kind=checkpoint.kind,
        )  # fmt: skip
        if self.checkpointed is not None:
            self.checkpointed(remote.node_id)
        return record

    def next_kind(self, sandbox: SandboxLike, trajectory: str) -> str | None:
        """The kind a checkpoint would take now, asked of the sandbox's host."""
        return _remote(sandbox).next_checkpoint_kind()

    def restore(self, checkpoint: Checkpoint, current: SandboxLike) -> SandboxLike:
        """The trajectory's sandbox from ``checkpoint``: on its node if alive, else on another (or
        the one a lost node's recovery already restored from this checkpoint)."""
        return _remote(current).restored(checkpoint)

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
        """Remove the nodes' spares; every lease cleans up after itself, and the cluster's
        `SandboxCluster.stop` removes whatever is left on any node (parked sandboxes too).  A
        rollout host's pool (`HostedSandboxes`) closes after the host stopped: nothing to ask."""
        from belayer_cluster import SandboxHostError

        self._idle.clear()
        self._created.clear()
        if self.spares:
            with anyio.CancelScope(shield=True), contextlib.suppress(SandboxHostError, SystemStartError):
                await anyio.to_thread.run_sync(lambda: self._hosts.keep_spares(0))
