"""Checkpoints on disk: manifest, verification, listing, publication and garbage collection.

Layout: ``ROOT/<trajectory>/<checkpoint_id>/{manifest.json, layer.tar, criu/...}``.  A checkpoint
is built in ``ROOT/<trajectory>/.partial-<checkpoint_id>/`` and published by one rename, so a
directory without the ``.partial-`` prefix is always complete: that rename is the ready pointer.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import json
import os
import shutil
import threading
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import attrs

from ._errors import (
    CheckpointCorruptError,
    CheckpointDurabilityError,
    CheckpointNotFoundError,
    InvalidConfigError,
)
from ._fsync import fsync_path, fsync_tree, sha256_file
from ._ids import validate_id
from ._manifest import (
    CRIU_DIR,
    FORMAT,
    LAYER,
    MANIFEST,
    RUNTIME_CRIU,
    Checkpoint,
    CheckpointKind,
    FileRecord,
)

__all__ = [
    "CRIU_DIR",
    "FORMAT",
    "LAYER",
    "MANIFEST",
    "PARTIAL",
    "Checkpoint",
    "CheckpointKind",
    "CheckpointStore",
    "FileRecord",
    "is_page_image",
    "link_artifacts",
    "record_files",
    "verify_checkpoint",
    "verify_files",
    "verify_files_meanwhile",
]

PARTIAL = ".partial-"
LOCK_SUFFIX = ".lock"
# CRIU's logs of failed checkpoints: ROOT/.failed/<trajectory>/<checkpoint_id>.log.  The dot keeps
# the area apart from trajectories (an id cannot start with one); only the newest are kept.
FAILED = ".failed"
MAX_FAILED_LOGS = 16


def record_files(directory: Path) -> dict[str, FileRecord]:
    """Sizes and sha256 of every file under ``directory`` (relative POSIX paths)."""
    records = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        records[file.relative_to(directory).as_posix()] = FileRecord(file.stat().st_size, sha256_file(file))
    return records


def link_artifacts(owner: Checkpoint, tmp: Path) -> dict[str, FileRecord]:
    """Hard-link ``owner``'s layer archive and CRIU images into ``tmp`` (a reference checkpoint).

    The links share the owner's inodes, so a reference costs no copy and no hashing, and its
    artifacts stay on disk as long as any checkpoint links them, whatever `gc` removes.  Each
    file's size is checked against the owner's manifest; its checksum is the owner's.
    """
    for rel, record in owner.files.items():
        source, target = owner.path / rel, tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target)
        if target.stat().st_size != record.size:
            raise CheckpointCorruptError(
                f"checkpoint {owner.path}: {rel} is {target.stat().st_size} B, its manifest says "
                f"{record.size} B; it cannot be shared. Take a full checkpoint"
            )
    return dict(owner.files)


def _missing_artifacts(files: builtins.set[str], runtime: str) -> str:
    """What is wrong with the files of a checkpoint of ``runtime`` ("" when they fit)."""
    has_criu = any(k.startswith(CRIU_DIR + "/") for k in files)
    if LAYER not in files:
        return "it lacks its layer archive"
    if runtime == RUNTIME_CRIU and not has_criu:
        return "it lacks its CRIU images"
    if runtime != RUNTIME_CRIU and has_criu:
        return "it holds CRIU images although its runtime is fresh"
    return ""


def is_page_image(rel: str) -> bool:
    """Whether ``rel`` (a manifest's file name) is one of CRIU's memory page images."""
    name = rel.removeprefix(f"{CRIU_DIR}/")
    return name != rel and name.startswith("pages-") and name.endswith(".img")


def verify_checkpoint(path: Path, *, hash_later: Callable[[str], bool] | None = None) -> Checkpoint:
    """Load and fully check a checkpoint: manifest, every file's presence, size and sha256.

    The files ``hash_later`` names are checked for presence and size only: the caller hashes them
    with `verify_files` (`full_restore` does so while it creates the new container).
    """
    checkpoint = Checkpoint.load(path)
    lacking = _missing_artifacts(set(checkpoint.files), checkpoint.runtime)
    if lacking:
        raise CheckpointCorruptError(f"checkpoint {path} ({checkpoint.kind}): {lacking}; it is partial")
    for rel, record in checkpoint.files.items():
        file = path / rel
        if not file.is_file():
            raise CheckpointCorruptError(f"checkpoint {path} is missing {rel}; it cannot be restored")
        if file.stat().st_size != record.size:
            raise _mismatch(path, rel)
        if hash_later is None or not hash_later(rel):
            verify_files(checkpoint, [rel])
    extra = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - set(checkpoint.files)
    if extra - {MANIFEST}:
        raise CheckpointCorruptError(
            f"checkpoint {path} holds files its manifest does not list: {sorted(extra)}"
        )
    return checkpoint


def verify_files(checkpoint: Checkpoint, rels: Iterable[str]) -> None:
    """Check the sha256 of each of ``checkpoint``'s files ``rels`` against its manifest."""
    for rel in rels:
        if sha256_file(checkpoint.path / rel) != checkpoint.files[rel].sha256:
            raise _mismatch(checkpoint.path, rel)


def verify_files_meanwhile(checkpoint: Checkpoint, rels: Collection[str]) -> Callable[[], None]:
    """Start `verify_files` of ``rels`` in a thread; the call returned waits for it and raises
    what it raised (sha256 releases the GIL: the hashing runs beside the caller's engine calls)."""
    if not rels:
        return lambda: None
    failed: list[BaseException] = []

    def run() -> None:
        try:
            verify_files(checkpoint, rels)
        except BaseException as exc:  # handed to the waiter
            failed.append(exc)

    worker = threading.Thread(target=run, name=f"verify-{checkpoint.checkpoint_id}", daemon=True)
    worker.start()

    def wait() -> None:
        worker.join()
        if failed:
            raise failed[0]

    return wait


def _mismatch(path: Path, rel: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {path}: {rel} does not match its checksum; it is corrupt and cannot be "
        "restored. Restore an earlier checkpoint (`belayer-envckpt ls`) or restart the trajectory"
    )


def _lock_path(partial: Path) -> Path:
    return partial.with_name(partial.name + LOCK_SUFFIX)


def _take_lock(lock: Path, *, wait: bool) -> int | None:
    """Create (if needed) and flock ``lock``; None when another holds it and ``wait`` is False.

    A lock file unlinked or replaced between the open and the flock is not the one others see:
    open it again.  FileNotFoundError means its directory is gone.
    """
    while True:
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            current = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except BlockingIOError:
            os.close(fd)
            return None
        except FileNotFoundError:
            current = False
        except BaseException:
            os.close(fd)
            raise
        if current:
            return fd
        os.close(fd)


def _in_progress(partial: Path) -> bool:
    """Whether some process holds the lock of a partial checkpoint (it is still being written)."""
    try:
        fd = os.open(_lock_path(partial), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _remove_partial(partial: Path) -> bool:
    """Remove a partial checkpoint and its lock under that lock; False if its writer holds it."""
    try:
        fd = _take_lock(_lock_path(partial), wait=False)
    except FileNotFoundError:
        return False  # its trajectory directory went meanwhile: nothing left to remove
    if fd is None:
        return False
    try:
        shutil.rmtree(partial, ignore_errors=True)
        _lock_path(partial).unlink(missing_ok=True)
    finally:
        os.close(fd)
    return True


@attrs.define
class CheckpointStore:
    """A directory of checkpoints, grouped by trajectory."""

    root: Path = attrs.field(converter=Path)
    _held: dict[Path, int] = attrs.field(factory=dict, init=False, repr=False)
    _published: dict[str, Checkpoint] = attrs.field(factory=dict, init=False, repr=False)

    def trajectory_dir(self, trajectory: str) -> Path:
        """Where one trajectory's checkpoints live."""
        return self.root / validate_id(trajectory, "trajectory")

    def begin(self, trajectory: str, checkpoint_id: str) -> Path:
        """Create the private working directory of a checkpoint in progress.

        The lock file is created and locked (flock) before the directory exists and held until
        `publish`, `abort` or `abandon`: `gc` takes that lock itself before it removes anything,
        so it never takes a checkpoint that some process is still writing for a leftover, and a
        process that dies releases its lock with its file descriptors.
        """
        validate_id(checkpoint_id, "checkpoint")
        tdir = self.trajectory_dir(trajectory)
        tmp = tdir / f"{PARTIAL}{checkpoint_id}"
        fd = None
        while fd is None:
            self._make_trajectory_dir(tdir)
            with contextlib.suppress(FileNotFoundError):  # a gc removed it as empty just now
                fd = _take_lock(_lock_path(tmp), wait=True)
        try:
            tmp.mkdir()
        except BaseException:
            os.close(fd)
            raise
        self._held[tmp] = fd
        return tmp

    def _make_trajectory_dir(self, tdir: Path) -> None:
        if tdir.is_dir():
            return
        new_root = not self.root.is_dir()
        tdir.mkdir(parents=True, exist_ok=True)
        fsync_path(self.root)  # the new trajectory's entry, so a published checkpoint's path survives
        if new_root:
            fsync_path(self.root.parent)

    def abort(self, tmp: Path) -> None:
        """Remove a checkpoint in progress (after a failure) and its lock."""
        shutil.rmtree(tmp, ignore_errors=True)
        self._release(tmp, unlink=True)

    def abandon(self, tmp: Path) -> None:
        """Let go of a checkpoint in progress as a dead process would: its files stay for `gc`."""
        self._release(tmp, unlink=False)

    def _release(self, tmp: Path, *, unlink: bool) -> None:
        fd = self._held.pop(tmp, None)
        if unlink:
            _lock_path(tmp).unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)

    def publish(self, tmp: Path, checkpoint: Checkpoint) -> Checkpoint:
        """Write the manifest, make everything durable, then rename into place (the ready point).

        Refuses (`CheckpointCorruptError`) a checkpoint without its layer archive or CRIU images.
        A failure to fsync the trajectory directory after the rename raises
        `CheckpointDurabilityError`: the checkpoint is published then, only not known durable.
        """
        final = tmp.parent / validate_id(checkpoint.checkpoint_id, "checkpoint")
        if final.exists():
            raise CheckpointCorruptError(f"checkpoint {final} already exists; refusing to overwrite it")
        if tmp.name != PARTIAL + checkpoint.checkpoint_id or tmp.parent.name != checkpoint.trajectory:
            raise InvalidConfigError(
                f"checkpoint {checkpoint.trajectory}/{checkpoint.checkpoint_id} does not belong in {tmp}; "
                "publish the directory `begin` returned for that trajectory and id"
            )
        criu = tmp / CRIU_DIR
        present = {LAYER} if (tmp / LAYER).is_file() else builtins.set()
        if criu.is_dir() and any(criu.iterdir()):
            present.add(f"{CRIU_DIR}/")
        lacking = _missing_artifacts(present, checkpoint.runtime)
        if lacking:
            raise CheckpointCorruptError(
                f"checkpoint in progress {tmp} ({checkpoint.kind}): {lacking} (was it removed "
                "while being written?); nothing was published and the previous ready checkpoint is still "
                "in effect: take the checkpoint again"
            )
        manifest = tmp / MANIFEST
        with manifest.open("w") as handle:
            json.dump(checkpoint.to_manifest(), handle, indent=1, sort_keys=True)
        fsync_tree(tmp)
        os.rename(tmp, final)
        published = attrs.evolve(checkpoint, path=final)
        try:
            fsync_path(final.parent)
        except OSError as exc:
            raise CheckpointDurabilityError(
                f"checkpoint {final} IS published (it is the latest ready one now) but fsync of "
                f"{final.parent} failed ({exc}): a host crash or power loss may still lose it. Check the "
                "store's disk; take another checkpoint to have one known durable",
                published,
            ) from exc
        finally:
            self._release(tmp, unlink=True)
            self._published[checkpoint.trajectory] = published
        return published

    def last_published(self, trajectory: str) -> Checkpoint | None:
        """The checkpoint this store object published last for ``trajectory`` while it is still on
        disk, else `latest_ready` (a scan of the trajectory's manifests)."""
        mine = self._published.get(trajectory)
        if mine is not None and os.path.lexists(mine.path / MANIFEST):
            return mine
        return self.latest_ready(trajectory)

    def list(self, trajectory: str | None = None) -> builtins.list[Checkpoint]:
        """Ready checkpoints (published, manifest valid) by trajectory, each oldest first: by prefix,
        then creation time.

        A checkpoint whose manifest cannot be read is skipped; `unreadable` reports it.
        """
        return self._scan(trajectory)[0]

    def unreadable(self, trajectory: str | None = None) -> builtins.list[tuple[Path, CheckpointCorruptError]]:
        """Published checkpoints with a manifest that `list` skips, each with the reason."""
        return self._scan(trajectory)[1]

    def _scan(
        self, trajectory: str | None
    ) -> tuple[builtins.list[Checkpoint], builtins.list[tuple[Path, CheckpointCorruptError]]]:
        found: builtins.list[Checkpoint] = []
        bad: builtins.list[tuple[Path, CheckpointCorruptError]] = []
        for tdir in self._dirs(trajectory):
            for entry in sorted(tdir.iterdir()):
                if not entry.is_dir() or entry.name.startswith(PARTIAL):
                    continue
                try:
                    found.append(Checkpoint.load(entry))
                except CheckpointCorruptError as exc:
                    if os.path.lexists(entry / MANIFEST):
                        bad.append((entry, exc))
        # Wall clocks of different hosts disagree: the prefix orders a trajectory's checkpoints.
        found.sort(key=lambda c: (c.trajectory, c.prefix, c.created_ns, c.checkpoint_id))
        return found, bad

    def leftovers(self, trajectory: str | None = None) -> builtins.list[Path]:
        """Partial checkpoints no process is writing, published directories without a manifest,
        and lock files no process holds whose partial directory is gone."""
        bad: builtins.list[Path] = []
        for tdir in self._dirs(trajectory):
            for entry in tdir.iterdir():
                if entry.name.startswith(PARTIAL) and entry.name.endswith(LOCK_SUFFIX):
                    partial = entry.with_name(entry.name.removesuffix(LOCK_SUFFIX))
                    if not partial.is_dir() and not _in_progress(partial):
                        bad.append(entry)
                elif not entry.is_dir():
                    continue
                elif entry.name.startswith(PARTIAL):
                    if not _in_progress(entry):
                        bad.append(entry)
                elif not os.path.lexists(entry / MANIFEST):
                    bad.append(entry)
        return sorted(bad)

    def latest_ready(self, trajectory: str) -> Checkpoint | None:
        """The ready checkpoint of ``trajectory`` with the highest prefix (the newest among equals), or None."""
        ready = self.list(trajectory)
        return ready[-1] if ready else None

    def get(self, trajectory: str, prefix: int | None = None) -> Checkpoint:
        """The latest ready checkpoint of ``trajectory`` (at ``prefix`` if given)."""
        ready = [c for c in self.list(trajectory) if prefix is None or c.prefix == prefix]
        if not ready:
            at = f" at prefix {prefix}" if prefix is not None else ""
            raise CheckpointNotFoundError(
                f"no ready checkpoint for trajectory {trajectory!r}{at} in {self.root}; "
                "list them with `belayer-envckpt ls`, or restart the trajectory from its base image"
            )
        return ready[-1]

    def verify(self, checkpoint: Checkpoint | Path) -> Checkpoint:
        """Check a checkpoint's manifest (with its self-checksum) and every file's size and sha256."""
        return verify_checkpoint(checkpoint.path if isinstance(checkpoint, Checkpoint) else Path(checkpoint))

    def gc(self, trajectory: str | None = None, *, keep: int | None = None) -> builtins.list[Path]:
        """Remove leftovers and kept CRIU logs of failed checkpoints; with ``trajectory``, only that
        trajectory's, and also its checkpoints (all, or all but the newest ``keep``).  Checkpoints
        in progress are never touched, nor checkpoints whose manifest this version cannot read
        (`unreadable` lists them).
        """
        removed: builtins.list[Path] = []
        for path in self.leftovers(trajectory):
            if path.name.startswith(PARTIAL):
                partial = path.with_name(path.name.removesuffix(LOCK_SUFFIX))
                if _remove_partial(partial):
                    removed.append(path)
            else:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        ready = self.list(trajectory) if trajectory is not None or keep else []
        for tdir in self._dirs(trajectory):
            mine = [c for c in ready if c.path.parent == tdir]
            for checkpoint in mine[:-keep] if keep else mine:
                shutil.rmtree(checkpoint.path, ignore_errors=True)
                removed.append(checkpoint.path)
            with contextlib.suppress(OSError):  # not empty, or a `begin` is filling it right now
                if not any(tdir.iterdir()):
                    tdir.rmdir()
        return removed + self._gc_failed_logs(trajectory)

    def keep_failed_log(self, trajectory: str, checkpoint_id: str, log: Path) -> Path:
        """Copy CRIU's log of a failed checkpoint into the failed area; drop the oldest beyond the bound."""
        target = self.root / FAILED / validate_id(trajectory, "trajectory") / f"{checkpoint_id}.log"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log, target)
        for old in self.failed_logs()[:-MAX_FAILED_LOGS]:
            old.unlink(missing_ok=True)
        return target

    def failed_logs(self, trajectory: str | None = None) -> builtins.list[Path]:
        """CRIU logs kept from failed checkpoints, oldest first."""
        area = self.root / FAILED
        pattern = f"{validate_id(trajectory, 'trajectory')}/*.log" if trajectory is not None else "*/*.log"
        return (
            sorted(area.glob(pattern), key=lambda p: (p.stat().st_mtime_ns, p.name)) if area.is_dir() else []
        )

    def _gc_failed_logs(self, trajectory: str | None) -> builtins.list[Path]:
        logs = self.failed_logs(trajectory)
        for log in logs:
            log.unlink(missing_ok=True)
        area = self.root / FAILED
        if area.is_dir():
            folders = [area / trajectory] if trajectory is not None else list(area.iterdir())
            for folder in [*folders, area]:
                with contextlib.suppress(OSError):
                    if folder.is_dir() and not any(folder.iterdir()):
                        folder.rmdir()
        return logs

    def _dirs(self, trajectory: str | None) -> builtins.list[Path]:
        if trajectory is not None:
            tdir = self.trajectory_dir(trajectory)
            return [tdir] if tdir.is_dir() else []
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
