"""The environment side of a trajectory: actions, state hashes and checkpoints (of every kind).

Blocking calls into belayer-envckpt (which translates every container-engine error into its own
typed errors); the agent loop runs each function in a worker thread.  A sandbox failure is
reported as a `SandboxFailure` value, never raised through the loop.
"""

from __future__ import annotations

import time
from typing import Protocol

import attrs

from belayer_envckpt import (
    BelayerEnvckptError,
    CheckpointStore,
    ExecResult,
    FaultInjector,
    Sandbox,
    SandboxLike,
    checkpoint,
    next_checkpoint_kind,
)
from belayer_grpo._agentic.records import CheckpointRecord
from belayer_grpo._errors import SandboxCommandError

__all__ = [
    "REPO_HASH_SCRIPT",
    "SandboxChaos",
    "SandboxFailure",
    "checkpoint_sandbox",
    "context_ref",
    "is_repository_hash",
    "next_kind",
    "parse_context_ref",
    "repository_hash",
    "run_action",
]

# Content and names of every file of the repository (``.git`` aside), in a fixed order.
REPO_HASH_SCRIPT = (
    "find . -path ./.git -prune -o -type f -print0 | LC_ALL=C sort -z "
    "| xargs -0 -r sha256sum | sha256sum | cut -d' ' -f1"
)
_REF_PREFIX = "router:contexts/"


@attrs.frozen
class SandboxFailure:
    """The sandbox died (or could not run the action): ``reason`` says how it was detected."""

    reason: str
    action_s: float = 0.0


class StepFault(Protocol):
    """Called after each action; True when it failed the sandbox (`FaultInjector`, `SandboxChaos`)."""

    def step(self, sandbox: SandboxLike) -> bool: ...


@attrs.define
class SandboxChaos:
    """Kills the sandbox after the actions numbered ``at_actions`` (each once), and otherwise
    as ``injector`` (a probability per action) decides."""

    at_actions: tuple[int, ...] = ()
    injector: FaultInjector | None = None
    _fired: set[int] = attrs.field(factory=set)

    def step(self, sandbox: SandboxLike) -> bool:
        """Call after each action (``sandbox.prefix`` counts it already)."""
        if sandbox.prefix in self.at_actions and sandbox.prefix not in self._fired:
            self._fired.add(sandbox.prefix)
            sandbox.kill()
            return True
        return self.injector is not None and self.injector.step(sandbox)


def context_ref(trajectory: str, turn: int) -> str:
    """The checkpoint's reference to the router's context log entry ``L_turn``."""
    return f"{_REF_PREFIX}{trajectory}/{turn}"


def parse_context_ref(ref: str) -> tuple[str, int]:
    """``(trajectory, turn)`` of a `context_ref`; ValueError for anything else."""
    if not ref.startswith(_REF_PREFIX):
        raise ValueError(f"context reference {ref!r} does not name a router context")
    trajectory, _, turn = ref.removeprefix(_REF_PREFIX).rpartition("/")
    if not trajectory or not turn.isdigit():
        raise ValueError(f"context reference {ref!r} is malformed")
    return trajectory, int(turn)


def is_repository_hash(result: ExecResult) -> bool:
    """Whether a `REPO_HASH_SCRIPT` answer is a hash: exit 0 and 64 hex digits. On a loaded machine
    the pipeline was seen to end with exit 0 and no output (its last stage, ``cut``, succeeds when
    an earlier one dies): such an answer is asked again, never recorded."""
    text = result.stdout.strip()
    return result.exit_code == 0 and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def repository_hash(
    sandbox: SandboxLike, workdir: str, *, attempts: int = 3, retry_pause_s: float = 0.5
) -> str:
    """Hash of the repository's files, read between actions (it does not count as an action).

    The probe is read-only, so a malformed answer (`is_repository_hash`) is asked again
    (``attempts`` in all), as `belayer_envckpt.probe_then_checkpoint` does before a checkpoint.
    """
    for attempt in range(attempts):
        result = sandbox.probe(["/bin/sh", "-c", REPO_HASH_SCRIPT], workdir=workdir)
        if is_repository_hash(result):
            return result.stdout.strip()
        if attempt + 1 < attempts:
            time.sleep(retry_pause_s * (attempt + 1))
    raise SandboxCommandError(
        f"hashing the repository {workdir} in sandbox {sandbox.id} failed (exit {result.exit_code}) "
        f"{attempts} times: {(result.stdout.strip() + result.stderr)[-200:]}"
    )


def _is_running(sandbox: SandboxLike) -> bool:
    try:
        return sandbox.is_running()
    except BelayerEnvckptError:
        return False


def run_action(
    sandbox: SandboxLike, command: str, timeout_s: float, injector: StepFault | None
) -> ExecResult | SandboxFailure:
    """Run one action; then chaos may kill the sandbox; then check that it is still running.

    An action whose container died (by itself or by chaos) has not committed: its output is
    discarded and the trajectory goes back to its latest ready checkpoint.
    """
    started = time.perf_counter()
    try:
        result = sandbox.exec(command, timeout_s=timeout_s)
    except BelayerEnvckptError as error:  # a RemoteSandbox's failures are envckpt's errors too
        return SandboxFailure(f"exec failed: {error}", time.perf_counter() - started)
    try:
        if injector is not None and injector.step(sandbox):
            return SandboxFailure("killed by chaos", result.duration_s)
    except BelayerEnvckptError as error:
        return SandboxFailure(f"chaos could not act on the sandbox: {error}", result.duration_s)
    if not _is_running(sandbox):
        return SandboxFailure("container not running after the action", result.duration_s)
    return result


def checkpoint_sandbox(
    sandbox: Sandbox,
    store: CheckpointStore,
    *,
    trajectory: str,
    prefix: int,
    turn: int,
    workdir: str,
    context_hash: str,
    previous: CheckpointRecord | None = None,
) -> CheckpointRecord:
    """Checkpoint the sandbox and hash its repository in the same quiescent state, tied to
    ``L_turn``: both under the sandbox's action boundary, so no action runs in between (a
    malformed hash is asked again, 3 tries).  The checkpoint is the cheapest kind that captures
    the sandbox (`belayer_envckpt.checkpoint`: ``reference`` when nothing changed since the last
    one, ``fresh-runtime`` when only the stateless init runs, else ``full``); the record says which.
    A reference to ``previous`` (the trajectory's latest record) takes its repository hash: the
    layer's metadata is unchanged, so are its files, and no probe runs (the probe, an exec, was
    most of a reference's cost).  Raises a `belayer_envckpt.BelayerEnvckptError` (or
    `SandboxCommandError` for the hash) if it cannot be taken.
    """
    started = time.perf_counter()
    ref = context_ref(trajectory, turn)
    with sandbox.action_boundary():
        taken = checkpoint(sandbox, trajectory, prefix, ref, store=store)
        owner = None if previous is None or previous.checkpoint is None else previous.checkpoint
        shares = (
            owner is not None
            and taken.kind == "reference"
            and taken.artifacts_of in (owner.checkpoint_id, owner.artifacts_of)
        )
        repo_hash = (
            previous.repo_hash if shares and previous is not None else repository_hash(sandbox, workdir)
        )
    return CheckpointRecord(
        prefix=prefix,
        turn=turn,
        context_ref=ref,
        context_hash=context_hash,
        repo_hash=repo_hash,
        duration_s=time.perf_counter() - started,
        checkpoint=taken,
        kind=taken.kind,
    )


def next_kind(sandbox: Sandbox, store: CheckpointStore, trajectory: str) -> str | None:
    """The kind a checkpoint of ``sandbox`` would take now (`belayer_envckpt.next_checkpoint_kind`,
    for the policy's cost), or None when it cannot be told (the sandbox is gone: the policy then
    weighs a full checkpoint and the next action reports the failure)."""
    try:
        return str(next_checkpoint_kind(sandbox, store, trajectory))
    except (BelayerEnvckptError, OSError):
        return None
