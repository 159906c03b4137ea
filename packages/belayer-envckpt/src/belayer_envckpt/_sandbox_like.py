"""`SandboxLike`: what a caller may ask of a sandbox, wherever its container runs.

`Sandbox` (a container on this machine's engine) satisfies it; so does a sandbox whose container
runs elsewhere and is reached through a host (belayer-cluster's `RemoteSandbox`). Code that only
runs actions, probes and checks a sandbox's life takes a `SandboxLike`, never a cast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ._exec import ExecResult
from ._sandbox import SandboxConfig

__all__ = ["SandboxLike"]


@runtime_checkable
class SandboxLike(Protocol):
    """One trajectory's sandbox: actions, read-only probes, its life cycle and its prefix.

    Every failure of a call (the container gone, its engine or host unreachable) raises a
    `BelayerEnvckptError` subclass; `status` answers ``"removed"`` for a container that is gone
    where an engine would say so. ``prefix`` counts the committed actions (``k`` of the prefix);
    ``context_ref`` names the LLM context the sandbox's state belongs to (a restored sandbox's).
    """

    config: SandboxConfig
    trajectory: str
    prefix: int
    context_ref: str
    restore_timings_ms: dict[str, float]

    @property
    def id(self) -> str:
        """The container's id."""
        ...

    def exec(self, command: str, timeout_s: float = 60.0) -> ExecResult:
        """Run one action (``prefix`` grows by one)."""
        ...

    def probe(
        self, command: str | Sequence[str], timeout_s: float = 60.0, *, workdir: str | None = None
    ) -> ExecResult:
        """A read-only command that is not an action (``prefix`` stays)."""
        ...

    def kill(self) -> None:
        """SIGKILL the container's processes (a fail-stop failure)."""
        ...

    def stop(self) -> None:
        """Stop the container."""
        ...

    def pause(self) -> None:
        """Freeze the container's processes."""
        ...

    def unpause(self) -> None:
        """Thaw the container."""
        ...

    def status(self) -> str:
        """The engine's word for the container (``running``, ``exited``, ...)."""
        ...

    def is_running(self) -> bool:
        """Whether the container runs."""
        ...

    def remove(self) -> None:
        """Remove the container; quiet if it is gone."""
        ...

    def action_boundary(self) -> contextlib.AbstractContextManager[None]:
        """Hold the sandbox between actions (no action runs while it is held)."""
        ...
