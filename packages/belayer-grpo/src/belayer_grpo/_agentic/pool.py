"""`SandboxPool`: at most ``capacity`` live task sandboxes, each leased to one trajectory.

A lease hands out the trajectory's current sandbox and follows it through failures (a restore or
a fresh start replaces the container).  Leaving the lease removes the container and, unless asked
to keep them, every checkpoint of the trajectory; closing the pool removes anything of it that
is still there (containers carry the pool's label, restored ones included).

With ``reuse`` a sandbox the pool created that is still running when its trajectory ends is not
removed: every process in it but PID 1 is killed and its working directory's contents are
emptied (`belayer_envckpt.Sandbox.reset_for_reuse`), and the next trajectory of the same image and working directory gets it,
which saves a container start and removal per trajectory.  Files outside the working directory
are not reset, so reuse suits tasks whose state lives there (the tool-use tasks); a container
restored from a checkpoint, or one whose working directory is ``/``, is never reused.

With ``spares`` (``rollout.spare_sandboxes``) the pool keeps that many started, untouched
containers per sandbox configuration (image and working directory) for the whole run, shared by
its trajectories (`belayer_envckpt.SparePool` with ``shared``): a restore of a ``fresh-runtime``
checkpoint (or a reference to one) goes into one of them instead of creating and starting a
container, and its timings then hold ``spare_ms``.  Spares carry the pool's labels (the run's
too, so the guardian reaps them); a lease of another configuration drops the spares of those no
lease uses, and closing the pool removes them.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import attrs

from belayer_envckpt import (
    BelayerEnvckptError,
    Checkpoint,
    CheckpointStore,
    Engine,
    Sandbox,
    SandboxConfig,
    SandboxLike,
    SparePool,
    full_restore,
)
from belayer_grpo._agentic import environment
from belayer_grpo._agentic.records import CheckpointRecord

__all__ = ["POOL_LABEL", "SandboxLease", "SandboxPool"]

POOL_LABEL = "belayer.grpo.pool"


def _local(sandbox: SandboxLike) -> Sandbox:
    if not isinstance(sandbox, Sandbox):
        raise TypeError(
            f"a SandboxPool sandbox must be a belayer_envckpt.Sandbox (got {type(sandbox).__name__})"
        )
    return sandbox


@attrs.define(eq=False)
class SandboxLease:
    """One trajectory's hold on the pool: its current sandbox and how to make a fresh one."""

    pool: SandboxPool
    trajectory: str
    config: SandboxConfig
    sandbox: SandboxLike

    async def replace(self, sandbox: SandboxLike) -> None:
        """Adopt ``sandbox`` (restored by ``full_restore``) as the trajectory's sandbox."""
        old, self.sandbox = self.sandbox, sandbox
        if old.id != sandbox.id:
            await anyio.to_thread.run_sync(old.remove)

    async def restart(self) -> SandboxLike:
        """Remove the current container and start a fresh one from the base image."""
        self.pool._created.discard(self.sandbox.id)
        await anyio.to_thread.run_sync(self.sandbox.remove)
        self.sandbox = await self.pool._create(self.config, self.trajectory)
        if self.pool.reuse:
            self.pool._created.add(self.sandbox.id)  # fresh from the image: reusable
        return self.sandbox


@attrs.define
class SandboxPool:
    """Creates, tracks and cleans up the sandboxes of a batch of trajectories."""

    engine: Engine
    store: CheckpointStore
    capacity: int = 8
    labels: dict[str, str] = attrs.field(factory=dict)
    keep_checkpoints: bool = False
    reuse: bool = False
    spares: int = 0  # started spare containers per configuration, for restores (0: none)
    pool_id: str = attrs.field(factory=lambda: uuid.uuid4().hex[:12])
    _spare_pool: SparePool | None = attrs.field(init=False, default=None)
    _limiter: anyio.CapacityLimiter = attrs.field(init=False)
    _leases: dict[str, SandboxLease] = attrs.field(init=False, factory=dict)
    _idle: dict[tuple[str, str], list[Sandbox]] = attrs.field(init=False, factory=dict)
    _created: set[str] = attrs.field(init=False, factory=set)
    num_reused: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.spares < 0:
            raise ValueError(f"spares must be >= 0 (0: no spare containers), got {self.spares}")
        self._limiter = anyio.CapacityLimiter(self.capacity)
        if self.spares:
            self._spare_pool = self._open_spares()

    def _open_spares(self) -> SparePool | None:
        """Where this pool's spares live: a run-wide `SparePool` on this machine's engine (a pool
        whose sandboxes live elsewhere keeps them there and returns None)."""
        return SparePool(self.engine, size=self.spares, shared=True)

    @property
    def num_live(self) -> int:
        """Trajectories holding a sandbox now."""
        return len(self._leases)

    def sandbox_config(self, image: str, workdir: str) -> SandboxConfig:
        """The configuration every sandbox of this pool is created with (and restored to)."""
        return SandboxConfig(
            image=image,
            working_dir=workdir,
            labels={**self.labels, POOL_LABEL: self.pool_id},
        )

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
        """Hash the repository and publish a checkpoint of ``sandbox`` into the pool's store, of the
        cheapest kind that captures it (`environment.checkpoint_sandbox`; blocking; raises a
        `belayer_envckpt.BelayerEnvckptError`)."""
        return environment.checkpoint_sandbox(
            _local(sandbox), self.store, trajectory=trajectory, prefix=prefix, turn=turn, workdir=workdir,
            context_hash=context_hash, previous=previous,
        )  # fmt: skip

    def next_kind(self, sandbox: SandboxLike, trajectory: str) -> str | None:
        """The kind a checkpoint of ``sandbox`` would take now (None when it cannot be told)."""
        return environment.next_kind(_local(sandbox), self.store, trajectory)

    def restore(self, checkpoint: Checkpoint, current: SandboxLike) -> SandboxLike:
        """A sandbox restored from ``checkpoint`` to replace ``current`` (blocking; raises like
        `take_checkpoint`).  `belayer_envckpt.full_restore` goes by the checkpoint's kind: a
        ``full`` one restores its processes with CRIU, a ``fresh-runtime`` one (or a ``reference``
        to one) installs its layer and starts the image's stateless init anew.  The sandbox carries
        this pool's labels, also restored from another pool's checkpoint (a killed trainer's, on
        ``--resume``): this pool removes it, and its spares of that configuration take it."""
        labels = {**self.labels, POOL_LABEL: self.pool_id}
        return full_restore(checkpoint, engine=self.engine, spares=self._spare_pool, labels=labels)

    async def warm_spares(self, image: str, workdir: str) -> None:
        """Make this pool's spares for ``image`` and ``workdir`` ready now, after the refills in
        flight (a lease otherwise asks for them in the background; nothing without ``spares``)."""
        spare_pool, config = self._spare_pool, self.sandbox_config(image, workdir)
        if spare_pool is not None:
            await anyio.to_thread.run_sync(spare_pool.wait_idle)
            await anyio.to_thread.run_sync(lambda: spare_pool.warm(config))

    async def _ask_for_spares(self, config: SandboxConfig) -> None:
        """Spares for ``config`` in the background; those of configurations no lease uses go."""
        spare_pool = self._spare_pool
        if spare_pool is None:
            return
        used = [lease.config for lease in self._leases.values()] + [config]
        await anyio.to_thread.run_sync(lambda: spare_pool.retain(used))
        spare_pool.refill_later(config)

    async def _create(self, config: SandboxConfig, trajectory: str) -> SandboxLike:
        return await anyio.to_thread.run_sync(
            lambda: Sandbox.create(self.engine, config, trajectory=trajectory)
        )

    async def _take(self, config: SandboxConfig, trajectory: str) -> SandboxLike:
        idle = self._idle.get((config.image, config.working_dir))
        if idle:
            reused = idle.pop()
            reused.trajectory, reused.prefix, reused.context_ref = trajectory, 0, ""
            self.num_reused += 1
            return reused
        sandbox = await self._create(config, trajectory)
        if self.reuse:
            self._created.add(sandbox.id)
        return sandbox

    def _reset(self, sandbox: SandboxLike) -> bool:
        """Reset a sandbox this pool created (`Sandbox.reset_for_reuse`); False if it cannot be reused."""
        if sandbox.id not in self._created or not isinstance(sandbox, Sandbox):
            return False
        try:
            return sandbox.reset_for_reuse(30.0)  # False for a working folder of "/"
        except BelayerEnvckptError:
            return False

    @asynccontextmanager
    async def lease(self, trajectory: str, image: str, workdir: str) -> AsyncIterator[SandboxLease]:
        """Wait for capacity, start a sandbox for ``trajectory``; clean it all up on exit."""
        if trajectory in self._leases:
            raise ValueError(f"trajectory {trajectory!r} already holds a sandbox of this pool")
        async with self._limiter:
            config = self.sandbox_config(image, workdir)
            await self._ask_for_spares(config)
            sandbox = await self._take(config, trajectory)
            lease = SandboxLease(self, trajectory, config, sandbox)
            self._leases[trajectory] = lease
            try:
                yield lease
            finally:
                del self._leases[trajectory]
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(lambda: self._clean(lease))

    def _clean(self, lease: SandboxLease) -> None:
        sandbox = lease.sandbox
        if self.reuse and self._reset(sandbox) and isinstance(sandbox, Sandbox):
            self._idle.setdefault((lease.config.image, lease.config.working_dir), []).append(sandbox)
        else:
            self._created.discard(sandbox.id)
            sandbox.remove()
        idle = {s.id for pool in self._idle.values() for s in pool}
        for container in self._containers(trajectory=lease.trajectory):
            if container not in idle:
                self.engine.remove(container)
        if not self.keep_checkpoints:
            # Not `store.gc`: it also sweeps partial checkpoints, which here are other
            # trajectories' checkpoints in progress.
            shutil.rmtree(self.store.trajectory_dir(lease.trajectory), ignore_errors=True)

    def _containers(self, trajectory: str | None = None) -> list[str]:
        filters = [f"{POOL_LABEL}={self.pool_id}"]
        if trajectory is not None:
            filters.append(f"belayer.trajectory={trajectory}")
        return [container.id for container in self.engine.list_containers(filters)]

    async def aclose(self) -> None:
        """Remove every container this pool created that is still there, its spares included."""
        self._idle.clear()
        self._created.clear()
        with anyio.CancelScope(shield=True):
            if self._spare_pool is not None:
                await anyio.to_thread.run_sync(self._spare_pool.close)
            for container in await anyio.to_thread.run_sync(self._containers):
                await anyio.to_thread.run_sync(self.engine.remove, container)
