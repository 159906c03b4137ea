"""`RemoteSandbox`: a trajectory's sandbox on a node's sandbox host, as a `belayer_envckpt.SandboxLike`.

Code that runs actions and probes in a sandbox (an agent loop) takes a `SandboxLike` and does not
care where the container runs: `belayer_envckpt.Sandbox` on this machine's engine, or this class,
whose every call is carried out by the `SandboxHost` of the node the container runs on. Every call
names its container: once the trajectory's sandbox runs elsewhere (its node lost, restored on
another node) the call fails with `RemoteSandboxError`, a `belayer_envckpt.BelayerEnvckptError`
like every failure of a local sandbox, so the caller recovers as from any sandbox failure.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from belayer_cluster._errors import SandboxHostError
from belayer_cluster._sandbox_host import SandboxInfo
from belayer_envckpt import BelayerEnvckptError, Checkpoint, ExecResult, SandboxConfig

__all__ = ["RemoteSandbox", "RemoteSandboxError", "SandboxCalls"]


class SandboxCalls(Protocol):
    """The calls a `RemoteSandbox` makes: `SandboxCluster`'s, or those of a stand-in that carries
    them to a `SandboxCluster` in another process (the driver that owns the hosts).  Each raises
    `SandboxHostError` when the host cannot do it."""

    def exec(
        self, trajectory: str, command: str, timeout_s: float = 60.0, *, container_id: str | None = None
    ) -> ExecResult: ...

    def probe(
        self,
        trajectory: str,
        argv: list[str],
        timeout_s: float = 60.0,
        *,
        workdir: str | None = None,
        container_id: str | None = None,
    ) -> ExecResult: ...

    def control(self, trajectory: str, operation: str, *, container_id: str | None = None) -> str: ...

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
    ) -> tuple[SandboxInfo, Checkpoint, ExecResult | None]: ...

    def next_kind(self, trajectory: str, *, container_id: str | None = None) -> str | None: ...

    def restore(self, trajectory: str, checkpoint: Checkpoint, *, replacing: str = "") -> SandboxInfo: ...

    def remove(self, trajectory: str, container_id: str) -> None: ...


class RemoteSandboxError(SandboxHostError, BelayerEnvckptError):
    """A call on a `RemoteSandbox` failed: its container is gone (restored elsewhere, its node
    lost) or its host did not answer. Both a `SandboxHostError` and a `BelayerEnvckptError`:
    recover the trajectory from its latest ready checkpoint (or afresh from its image)."""


class RemoteSandbox:
    """One trajectory's sandbox in one container on a node's sandbox host (`SandboxCluster`, or
    any `SandboxCalls` that carries its calls to one).

    Satisfies `belayer_envckpt.SandboxLike`. ``info`` says where it runs (node, container, prefix,
    LLM context); ``config`` is the configuration it was created with (and is restored to).
    """

    def __init__(self, hosts: SandboxCalls, info: SandboxInfo, config: SandboxConfig) -> None:
        self.hosts, self.config = hosts, config
        self.trajectory, self.node_id, self.container_id = info.trajectory, info.node_id, info.container_id
        self.prefix, self.context_ref = info.prefix, info.context_ref
        # A restored one's (`SandboxHost.restore`): ``spare_ms`` in them when it went into a spare.
        self.restore_timings_ms: dict[str, float] = dict(info.restore_timings_ms)
        self._boundary = threading.RLock()

    @property
    def id(self) -> str:
        """The container's id."""
        return self.container_id

    def _failed(self, what: str, error: Exception) -> RemoteSandboxError:
        return RemoteSandboxError(
            f"{what} in sandbox {self.container_id[:12]} of {self.trajectory} on node {self.node_id[:12]} "
            f"failed: {error}"
        )

    def exec(self, command: str, timeout_s: float = 60.0) -> ExecResult:
        """Run one action (``prefix`` grows by one)."""
        with self._boundary:
            try:
                result = self.hosts.exec(self.trajectory, command, timeout_s, container_id=self.container_id)
            except SandboxHostError as error:
                raise self._failed("action", error) from error
            self.prefix += 1
        return result

    def probe(
        self, command: str | Sequence[str], timeout_s: float = 60.0, *, workdir: str | None = None
    ) -> ExecResult:
        """A read-only command that is not an action (``prefix`` stays)."""
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        with self._boundary:
            try:
                return self.hosts.probe(
                    self.trajectory, argv, timeout_s, workdir=workdir, container_id=self.container_id
                )
            except SandboxHostError as error:
                raise self._failed("probe", error) from error

    def probe_then_checkpoint(
        self,
        probe: str | Sequence[str],
        *,
        prefix: int,
        context_ref: str,
        workdir: str | None = None,
        accept: Callable[[ExecResult], bool] | None = None,
    ) -> tuple[ExecResult, Checkpoint]:
        """A read-only probe and a checkpoint of the same state under one action boundary on the
        sandbox's host (`SandboxHost.checkpoint_at`), published to the cluster's shared store; the
        checkpoint is the cheapest kind that captures the sandbox (`belayer_envckpt.checkpoint`:
        ``full``, ``fresh-runtime`` or ``reference``, its ``kind``). Returns the accepted answer
        and the checkpoint."""
        argv = ["/bin/sh", "-c", probe] if isinstance(probe, str) else list(probe)
        with self._boundary:
            try:
                _, checkpoint, probed = self.hosts.checkpoint_at(
                    self.trajectory, context_ref, prefix, probe_argv=argv, workdir=workdir,
                    container_id=self.container_id, accept=accept,
                )  # fmt: skip
            except SandboxHostError as error:
                raise self._failed("checkpoint", error) from error
        assert probed is not None  # a probe was given
        return probed, checkpoint

    def next_checkpoint_kind(self) -> str | None:
        """The kind a checkpoint would take now (`belayer_envckpt.next_checkpoint_kind` on its host),
        for a policy's cost; None when it cannot be told (the container is gone)."""
        try:
            return self.hosts.next_kind(self.trajectory, container_id=self.container_id)
        except SandboxHostError:
            return None

    def restored(self, checkpoint: Checkpoint) -> RemoteSandbox:
        """The trajectory's sandbox brought back from ``checkpoint``: on its node if alive, else on
        another (or the one a lost node's recovery already restored from this checkpoint)."""
        try:
            info = self.hosts.restore(self.trajectory, checkpoint, replacing=self.container_id)
        except SandboxHostError as error:
            raise self._failed("restore", error) from error
        return RemoteSandbox(self.hosts, info, self.config)

    def _control(self, operation: str) -> str:
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
        except RemoteSandboxError:
            return "removed"

    def is_running(self) -> bool:
        """Whether the container runs (False when it, or its node, is gone)."""
        return self.status() == "running"

    def remove(self) -> None:
        """Remove the container, wherever it is (quiet if it is gone)."""
        with contextlib.suppress(SandboxHostError):
            self.hosts.remove(self.trajectory, self.container_id)

    @contextlib.contextmanager
    def action_boundary(self) -> Iterator[None]:
        """Hold the sandbox between this process's calls (the host holds its own boundary too)."""
        with self._boundary:
            yield
