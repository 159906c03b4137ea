"""`probe_then_checkpoint`: a read-only probe and a full checkpoint of one quiescent state.

A caller that records something about the sandbox's state beside its checkpoint (a repository
hash, a listing) must read it from the very state the checkpoint captures: both run here under
one action boundary, so no action runs in between. The probe is read-only, so an answer the
caller does not accept is asked again before anything is checkpointed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ._checkpoint import full_checkpoint
from ._errors import InvalidConfigError, ProbeFailedError
from ._exec import ExecResult
from ._sandbox import Sandbox
from ._store import Checkpoint, CheckpointStore

__all__ = ["probe_then_checkpoint"]


def probe_then_checkpoint(
    sandbox: Sandbox,
    trajectory: str,
    probe: str | Sequence[str],
    *,
    store: CheckpointStore,
    prefix: int | None = None,
    context_ref: str = "",
    workdir: str | None = None,
    accept: Callable[[ExecResult], bool] | None = None,
    attempts: int = 3,
    retry_pause_s: float = 0.5,
    timeout_s: float = 60.0,
) -> tuple[ExecResult, Checkpoint]:
    """Run ``probe`` (not an action) until ``accept`` takes its answer (None: exit 0 before the
    timeout; ``attempts`` tries, pausing ``retry_pause_s`` times the try between them), then
    `full_checkpoint` the same state.

    Returns the accepted answer and the published checkpoint. Raises `ProbeFailedError` (nothing
    checkpointed) when no answer was accepted, or what `Sandbox.probe` and `full_checkpoint` raise.
    An answer can be malformed on a loaded machine (a shell pipeline whose last stage succeeds after
    an earlier one died prints nothing and exits 0): ``accept`` should check its form, not only the
    exit code.
    """
    if attempts < 1:
        raise InvalidConfigError(f"attempts must be >= 1, got {attempts}")
    if retry_pause_s < 0:
        raise InvalidConfigError(f"retry_pause_s must be >= 0, got {retry_pause_s}")
    with sandbox.action_boundary():
        for attempt in range(attempts):
            result = sandbox.probe(probe, timeout_s, workdir=workdir)
            if result.ok if accept is None else accept(result):
                break
            if attempt + 1 < attempts:
                time.sleep(retry_pause_s * (attempt + 1))
        else:
            raise ProbeFailedError(
                f"the probe before checkpointing {trajectory!r} in sandbox {sandbox.id[:12]} gave no "
                f"accepted answer in {attempts} tries (last: exit {result.exit_code}, "
                f"{(result.stdout + result.stderr)[-200:]!r}); nothing was checkpointed: check the "
                "probe command, or retry",
                result,
            )
        checkpoint = full_checkpoint(sandbox, trajectory, prefix, context_ref, store=store)
    return result, checkpoint
