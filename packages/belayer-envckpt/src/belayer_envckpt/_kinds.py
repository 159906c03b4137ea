"""`checkpoint`: the cheapest checkpoint that still captures the sandbox's whole state.

Chosen at every checkpoint, conservatively (when unsure: `full`):

- ``reference``: the runtime is the stateless init and the writable layer's metadata digest equals
  that of an earlier fresh-runtime checkpoint of the same container: nothing changed, so the new
  prefix's checkpoint shares that one's artifacts (hard links), published atomically like any other.
- ``fresh-runtime``: the runtime is the stateless init (nothing else runs, nothing outlives a
  process): the checkpoint is the layer archive; restore starts the image's command anew.
- ``full``: anything else (`full_checkpoint`: layer + CRIU, from one frozen moment).

A process outside the init's tree is refused by every kind (`UncapturedProcessError`).
"""

from __future__ import annotations

import time
from pathlib import Path

from ._checkpoint import _maybe_fault, _ms, full_checkpoint, new_checkpoint_id
from ._errors import (
    BelayerEnvckptError,
    CheckpointFailedError,
    CommandError,
    ContainerEngineError,
    InjectedCrash,
    InvalidConfigError,
)
from ._faults import CheckpointFault, CrashPoint
from ._ids import validate_id
from ._layer import capture_layer, layer_digest
from ._limit_guard import check_checkpoint_size, check_layer, layer_size_bytes
from ._manifest import RUNTIME_FRESH, CheckpointKind
from ._runtime import refuse_uncaptured, sandbox_runtime, sandbox_status
from ._sandbox import Sandbox, check_guarantee
from ._store import LAYER, Checkpoint, CheckpointStore, link_artifacts, record_files


def _shared_owner(
    store: CheckpointStore, trajectory: str, sandbox: Sandbox, k: int, digest: str
) -> Checkpoint | None:
    """An earlier checkpoint of this container whose state equals the sandbox's now, or None."""
    last = store.last_published(trajectory)
    if (
        last is None
        or last.runtime != RUNTIME_FRESH
        or last.container_id != sandbox.id
        or not last.layer_digest
        or last.layer_digest != digest
        or last.prefix > k
    ):
        return None
    return last


def next_checkpoint_kind(sandbox: Sandbox, store: CheckpointStore, trajectory: str) -> CheckpointKind:
    """The kind `checkpoint` would take now (for a policy's cost estimate); nothing is written."""
    with sandbox.action_boundary():
        if sandbox_status(sandbox) != "running":
            return CheckpointKind.FULL
        view = sandbox_runtime(sandbox)
        if not view.fresh or view.outside_init:
            return CheckpointKind.FULL
        digest = layer_digest(sandbox.engine.upper_dir(sandbox._container))
        if _shared_owner(store, trajectory, sandbox, sandbox.prefix, digest) is not None:
            return CheckpointKind.REFERENCE
        return CheckpointKind.FRESH_RUNTIME


def checkpoint(
    sandbox: Sandbox,
    trajectory: str,
    prefix: int | None = None,
    context_ref: str = "",
    *,
    store: CheckpointStore,
    fault: CheckpointFault | None = None,
) -> Checkpoint:
    """Checkpoint the sandbox at prefix ``k`` with the cheapest kind that captures its state.

    Same contract as `full_checkpoint` (waits for the current action, atomic publication, the
    previous ready checkpoint stays in effect on any failure); the manifest's ``kind`` says which
    was taken.  ``timings_ms["hold_ms"]`` is how long the sandbox's actions were held.
    """
    validate_id(trajectory, "trajectory")
    started = time.perf_counter()
    with sandbox.action_boundary():
        k = sandbox.prefix if prefix is None else prefix
        if k < 0:
            raise InvalidConfigError(f"prefix must be >= 0, got {k}")
        if sandbox_status(sandbox) != "running":
            return full_checkpoint(
                sandbox, trajectory, k, context_ref, store=store, fault=fault
            )  # it refuses
        check_guarantee(sandbox._container.attrs)
        view = sandbox_runtime(sandbox)
        if not view.unreadable:  # else the full checkpoint reads again, frozen, and refuses if it must
            refuse_uncaptured(view, sandbox.id)
        if not view.fresh:
            return full_checkpoint(sandbox, trajectory, k, context_ref, store=store, fault=fault)
        upper = sandbox.engine.upper_dir(sandbox._container)
        check_layer(sandbox.config.limits, upper, sandbox.id)
        timings = {"detect_ms": _ms(started)}
        step = time.perf_counter()
        digest = layer_digest(upper)
        timings["digest_ms"] = _ms(step)
        owner = _shared_owner(store, trajectory, sandbox, k, digest)
        kind = CheckpointKind.FRESH_RUNTIME if owner is None else CheckpointKind.REFERENCE
        checkpoint_id = new_checkpoint_id(k)
        tmp = store.begin(trajectory, checkpoint_id)
        changed = False
        try:
            step = time.perf_counter()
            if owner is None:
                capture_layer(upper, tmp / LAYER)
                timings["layer_ms"] = _ms(step)
                _maybe_fault(sandbox, fault, CrashPoint.AFTER_LAYER)
                # Something that started meanwhile (not through this Sandbox) may have written: retake.
                changed = sandbox_runtime(sandbox).identity != view.identity
            else:
                link_artifacts(owner, tmp)
                timings["link_ms"] = _ms(step)
        except InjectedCrash:
            store.abandon(tmp)  # a dead process cleans nothing up: the partial directory stays for gc
            raise
        except Exception as exc:
            store.abort(tmp)
            failure = _failure(kind, sandbox, exc)
            if failure is exc:
                raise
            raise failure from exc
        if changed:
            store.abort(tmp)
            return full_checkpoint(sandbox, trajectory, k, context_ref, store=store, fault=fault)
        timings["freeze_ms"] = 0.0  # never frozen: nothing but the stateless init ran
        timings["hold_ms"] = _ms(started)
    return _publish(
        sandbox,
        store,
        tmp,
        owner,
        kind,
        checkpoint_id,
        trajectory,
        k,
        context_ref,
        digest,
        timings,
        started,
        fault,
    )


def _publish(
    sandbox: Sandbox,
    store: CheckpointStore,
    tmp: Path,
    owner: Checkpoint | None,
    kind: CheckpointKind,
    checkpoint_id: str,
    trajectory: str,
    k: int,
    context_ref: str,
    digest: str,
    timings: dict[str, float],
    started: float,
    fault: CheckpointFault | None,
) -> Checkpoint:
    """Hash (a fresh-runtime layer) and publish, after the sandbox was let go."""
    try:
        step = time.perf_counter()
        if owner is None:
            check_checkpoint_size(sandbox.config.limits, layer_size_bytes(tmp), sandbox.id)
            files = record_files(tmp)
        else:
            files = dict(owner.files)
        record = Checkpoint(
            checkpoint_id=checkpoint_id,
            trajectory=trajectory,
            prefix=k,
            context_ref=context_ref,
            image=sandbox.config.image,
            config=sandbox.config.to_dict(),
            container_id=sandbox.id,
            created_ns=time.time_ns(),
            timings_ms=timings,
            files=files,
            path=tmp,
            kind=kind.value,
            runtime=RUNTIME_FRESH,
            layer_digest=digest,
            artifacts_of="" if owner is None else owner.artifacts_of or owner.checkpoint_id,
        )
        _maybe_fault(sandbox, fault, CrashPoint.BEFORE_PUBLISH)
        timings["publish_ms"] = _ms(step)
        timings["total_ms"] = _ms(started)
        return store.publish(tmp, record)
    except InjectedCrash:
        store.abandon(tmp)
        raise
    except Exception as exc:
        store.abort(tmp)
        failure = _failure(kind, sandbox, exc)
        if failure is exc:
            raise
        raise failure from exc


def _failure(kind: CheckpointKind, sandbox: Sandbox, exc: Exception) -> BelayerEnvckptError:
    """The error to raise: a refusal passes through, anything else is a failed checkpoint."""
    if isinstance(exc, BelayerEnvckptError) and not isinstance(exc, ContainerEngineError | CommandError):
        return exc
    return CheckpointFailedError(
        f"{kind} checkpoint of sandbox {sandbox.id[:12]} failed ({exc}); the partial checkpoint was "
        "removed and the previous ready checkpoint is still in effect"
    )
