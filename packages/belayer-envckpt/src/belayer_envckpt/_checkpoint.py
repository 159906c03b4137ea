"""`full_checkpoint` and `full_restore`: the environment half of prefix-consistent recovery."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import attrs

from ._criu import describe_inet_socket, first_error_line, log_named_in, unrestorable_connection
from ._docker import Engine
from ._errors import (
    BelayerEnvckptError,
    CheckpointCorruptError,
    CheckpointFailedError,
    CheckpointNotFoundError,
    CommandError,
    ContainerEngineError,
    InjectedCrash,
    InvalidConfigError,
    RestoreFailedError,
    SandboxStillPausedError,
    UnrestorableConnectionError,
)
from ._faults import CheckpointFault, CrashPoint, apply_fault
from ._ids import validate_id
from ._layer import capture_layer, checked_members, install_layer
from ._limit_guard import check_checkpoint_size, check_checkpointable, layer_size_bytes
from ._manifest import RUNTIME_FRESH
from ._runtime import refuse_uncaptured, sandbox_runtime
from ._sandbox import Sandbox, SandboxConfig, check_guarantee
from ._spares import SparePool, restore_into_spare
from ._store import (
    CRIU_DIR,
    LAYER,
    PARTIAL,
    Checkpoint,
    CheckpointStore,
    is_page_image,
    record_files,
    verify_checkpoint,
    verify_files_meanwhile,
)


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000.0, 3)


def new_checkpoint_id(prefix: int) -> str:
    """A unique, engine-safe checkpoint name that sorts by prefix."""
    return f"k{prefix:05d}-{uuid.uuid4().hex[:12]}"


def full_checkpoint(
    sandbox: Sandbox,
    trajectory: str,
    prefix: int | None = None,
    context_ref: str = "",
    *,
    store: CheckpointStore,
    fault: CheckpointFault | None = None,
) -> Checkpoint:
    """Freeze, capture layer + processes from the same frozen moment, thaw, publish atomically.

    Waits for the current action to end.  Only the freeze window (pause -> thaw) is on the
    sandbox's critical path; hashing and publication run after the thaw.  On any failure the
    partial checkpoint is removed and the previous ready checkpoint stays in effect.  A sandbox
    that cannot be thawed (two tries) raises `SandboxStillPausedError` after the publication.
    """
    validate_id(trajectory, "trajectory")
    sandbox.engine.require_checkpoint_support()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    tmp: Path | None = None
    thaw_error: ContainerEngineError | None = None
    try:
        with sandbox.action_boundary():
            k = sandbox.prefix if prefix is None else prefix
            if k < 0:
                raise InvalidConfigError(f"prefix must be >= 0, got {k}")
            checkpoint_id = new_checkpoint_id(k)
            status = sandbox.status()
            if status != "running":
                raise CheckpointFailedError(
                    f"sandbox {sandbox.id[:12]} is {status}, not running: there is nothing consistent "
                    "to capture. Restore it from its latest ready checkpoint instead"
                )
            check_guarantee(sandbox._container.attrs)
            upper = sandbox.engine.upper_dir(sandbox._container)
            check_checkpointable(
                sandbox.config.limits, sandbox._container.attrs["Config"].get("User") or "", upper, sandbox.id
            )
            tmp = store.begin(trajectory, checkpoint_id)
            container_id = sandbox.id
            freeze = time.perf_counter()
            sandbox.pause()
            try:
                # CRIU dumps the init's tree: a process outside it would be lost without a word.
                refuse_uncaptured(sandbox_runtime(sandbox), sandbox.id)
                step = time.perf_counter()
                capture_layer(upper, tmp / LAYER)
                timings["layer_ms"] = _ms(step)
                _maybe_fault(sandbox, fault, CrashPoint.AFTER_LAYER)
                step = time.perf_counter()
                sandbox.engine.checkpoint(sandbox._container, checkpoint_id, tmp)
                (tmp / checkpoint_id).rename(tmp / CRIU_DIR)
                timings["dump_ms"] = _ms(step)
                _maybe_fault(sandbox, fault, CrashPoint.AFTER_DUMP)
            finally:
                thaw_error = _thaw(sandbox)
                timings["freeze_ms"] = _ms(freeze)
        check_checkpoint_size(sandbox.config.limits, layer_size_bytes(tmp), sandbox.id)
        step = time.perf_counter()
        checkpoint = Checkpoint(
            checkpoint_id=checkpoint_id,
            trajectory=trajectory,
            prefix=k,
            context_ref=context_ref,
            image=sandbox.config.image,
            config=sandbox.config.to_dict(),
            container_id=container_id,
            created_ns=time.time_ns(),
            timings_ms=timings,
            files=record_files(tmp),
            path=tmp,
        )
        _maybe_fault(sandbox, fault, CrashPoint.BEFORE_PUBLISH)
        timings["publish_ms"] = _ms(step)
        timings["total_ms"] = _ms(started)
        published = store.publish(tmp, checkpoint)
        tmp = None
    except InjectedCrash:
        if tmp is not None:
            store.abandon(tmp)  # a dead process cleans nothing up: the partial directory stays for gc
        raise
    except Exception as exc:
        kept = _keep_criu_log(store, trajectory, exc, tmp)
        if tmp is not None:
            store.abort(tmp)
        if isinstance(exc, BelayerEnvckptError) and not isinstance(exc, ContainerEngineError | CommandError):
            raise  # refused before anything was captured: the error already says what to do
        raise _failure(sandbox, exc, kept) from exc
    if thaw_error is not None:
        raise SandboxStillPausedError(
            f"checkpoint {published.checkpoint_id} was published and is ready, but sandbox {sandbox.id[:12]} "
            f"is still paused: unpausing it failed twice ({thaw_error}). Unpause it (`docker unpause "
            f"{sandbox.id[:12]}`, or Sandbox.unpause()) before its next action, or remove it and "
            "`full_restore` this checkpoint",
            published,
        ) from thaw_error
    return published


def _keep_criu_log(store: CheckpointStore, trajectory: str, exc: Exception, tmp: Path | None) -> Path | None:
    """Copy CRIU's log of a failed dump into the store's failed area before the partial goes."""
    # runc's dump leaves the log in the partial checkpoint; the engine's names it in its error.
    log = exc.log_path if isinstance(exc, CommandError) else log_named_in(str(exc))
    if log is None or tmp is None or not log.is_file():
        return None
    try:
        return store.keep_failed_log(trajectory, tmp.name.removeprefix(PARTIAL), log)
    except OSError:
        return None


def _name_socket(sandbox: Sandbox, inode: int) -> str:
    if inode == 0:
        return "an established TCP connection"
    try:
        pid = int(sandbox.inspect()["State"]["Pid"])
    except (BelayerEnvckptError, KeyError, TypeError, ValueError):
        return f"socket inode {inode}"
    described = describe_inet_socket(pid, inode)
    if described.endswith("(LISTEN)"):
        return f"a connection not yet accepted by the listener {described.split(' -> ')[0]}"
    return described


def _failure(sandbox: Sandbox, exc: Exception, log: Path | None) -> CheckpointFailedError:
    after = "the partial checkpoint was removed and the previous ready checkpoint is still in effect"
    if log is None:
        return CheckpointFailedError(f"checkpoint of sandbox {sandbox.id[:12]} failed ({exc}); {after}")
    line = first_error_line(log)
    inode = unrestorable_connection(line)
    if inode is not None:
        return UnrestorableConnectionError(
            f"sandbox {sandbox.id[:12]} holds a connection CRIU cannot checkpoint: {_name_socket(sandbox, inode)} "
            f"(CRIU: {line!r}; its log: {log}). Accept or close it before the checkpoint: established "
            "loopback TCP connections are supported (with tcp-established in /etc/criu/runc.conf, "
            f"see `belayer-envckpt doctor`), connections still waiting in a listener's queue are not; {after}",
            log,
        )
    return CheckpointFailedError(
        f"CRIU could not checkpoint sandbox {sandbox.id[:12]}: {line or 'no error line in its log'!r} "
        f"(CRIU's log: {log}); {after}",
        log,
    )


def _maybe_fault(sandbox: Sandbox, fault: CheckpointFault | None, point: CrashPoint) -> None:
    if fault is not None and fault.point is point:
        apply_fault(sandbox, fault.action)


def _thaw(sandbox: Sandbox) -> ContainerEngineError | None:
    """Unpause the sandbox, trying twice; the last error when it may still be paused, else None."""
    error: ContainerEngineError | None = None
    for _attempt in range(2):
        try:
            if sandbox.status() != "paused":
                return None
            sandbox.unpause()
            return None
        except ContainerEngineError as exc:
            error = exc
    return error


def full_restore(
    checkpoint: Checkpoint | None,
    *,
    engine: Engine | None = None,
    remove_failed: bool = True,
    labels: Mapping[str, str] | None = None,
    spares: SparePool | None = None,
) -> Sandbox:
    """Verify ``checkpoint``, replace the failed container with a fresh one restored from it.

    ``spares``: a `SparePool` whose started spare of the same configuration takes a
    ``fresh-runtime`` checkpoint's layer (through its merged root) instead of a container being
    created and started; with no spare, or a layer it cannot replay exactly, the normal path.

    ``labels`` go on the new container over the checkpoint's own (same keys: the new values), e.g.
    the label of the node that owns the container now (belayer-cluster's isolated nodes).

    Nothing is touched before the manifest, every checksum and the layer archive's members have
    been checked, except that the CRIU page images (most of a full checkpoint's bytes) are hashed
    in a thread while the new container is created and the layer installed into it: the failed
    container is removed and the new one started only once they match; when one does not, the
    new container is removed and `CheckpointCorruptError` raised, the failed one left as it was.
    The failed instance is never reused: a new container is created from the
    original image and configuration, the layer is installed, and it starts from the CRIU images
    (a ``full`` checkpoint) or normally (a ``fresh-runtime`` one, or a ``reference`` to one).
    """
    if checkpoint is None:  # `full_restore(store.latest_ready(t))` for a trajectory never checkpointed
        raise CheckpointNotFoundError(
            "full_restore got no checkpoint (None): the trajectory has no ready checkpoint. Restart it "
            "from its base image (Sandbox.create), or list what the store holds with `belayer-envckpt ls`"
        )
    timings: dict[str, float] = {}
    started = time.perf_counter()
    checkpoint = verify_checkpoint(checkpoint.path, hash_later=is_page_image)
    pages_verified = verify_files_meanwhile(checkpoint, [r for r in checkpoint.files if is_page_image(r)])
    members = checked_members(checkpoint.path / LAYER)
    timings["verify_ms"] = _ms(started)
    own_engine = engine is None and spares is None
    engine = engine or (spares.engine if spares is not None else Engine.connect())
    engine.require_checkpoint_support()
    config = SandboxConfig.from_dict(checkpoint.config)
    if labels:
        config = attrs.evolve(config, labels={**config.labels, **labels})
    if spares is not None and checkpoint.runtime == RUNTIME_FRESH:  # no page images: all verified
        _remove_failed(engine, checkpoint, remove_failed, timings)
        remove_failed = False
        spare = restore_into_spare(
            spares, checkpoint.path / LAYER, members, config, checkpoint.trajectory, timings
        )
        if spare is not None:
            return _restored(spare, checkpoint, timings, started)
    step = time.perf_counter()
    sandbox = Sandbox.create(engine, config, trajectory=checkpoint.trajectory, start=False)
    timings["create_ms"] = _ms(step)
    try:
        step = time.perf_counter()
        install_layer(checkpoint.path / LAYER, engine.upper_dir(sandbox._container))
        timings["layer_ms"] = _ms(step)
        step = time.perf_counter()
        pages_verified()  # hashed beside the create and the layer: nothing starts before they match
        timings["pages_verify_wait_ms"] = _ms(step)
        _remove_failed(engine, checkpoint, remove_failed, timings)
        step = time.perf_counter()
        if checkpoint.runtime == RUNTIME_FRESH:
            sandbox.start()  # the runtime was the image's stateless init: start it anew
        else:
            sandbox.restore_images = engine.start_from_checkpoint(
                sandbox._container, checkpoint.checkpoint_id, checkpoint.path / CRIU_DIR
            )
        sandbox.reload()
        timings["start_ms"] = _ms(step)
    except CheckpointCorruptError:
        sandbox.remove()
        if own_engine:
            engine.close()
        raise
    except (BelayerEnvckptError, OSError) as exc:
        sandbox.remove()
        if own_engine:
            engine.close()
        raise RestoreFailedError(
            f"restoring checkpoint {checkpoint.checkpoint_id} failed ({exc}); the new container was "
            "removed and the checkpoint is untouched. Check `belayer-envckpt doctor`"
        ) from exc
    return _restored(sandbox, checkpoint, timings, started)


def _remove_failed(engine: Engine, checkpoint: Checkpoint, remove: bool, timings: dict[str, float]) -> None:
    if remove:
        step = time.perf_counter()
        engine.remove(checkpoint.container_id)
        timings["remove_ms"] = _ms(step)


def _restored(sandbox: Sandbox, checkpoint: Checkpoint, timings: dict[str, float], started: float) -> Sandbox:
    timings["total_ms"] = _ms(started)
    sandbox.prefix = checkpoint.prefix
    sandbox.context_ref = checkpoint.context_ref
    sandbox.restore_timings_ms = timings
    return sandbox
