"""Checkpoints on disk: manifest, verification, listing, publication and garbage collection.

Layout: ``ROOT/<trajectory>/<checkpoint_id>/{manifest.json, layer.tar, criu/...}``.  A checkpoint
is built in ``ROOT/<trajectory>/.partial-<checkpoint_id>/`` and published by one rename, so a
directory without the ``.partial-`` prefix is always complete: that rename is the ready pointer.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

import attrs

from ._errors import CheckpointCorruptError, CheckpointNotFoundError
from ._fsync import fsync_path, fsync_tree, sha256_file
from ._ids import validate_id

MANIFEST = "manifest.json"
LAYER = "layer.tar"
CRIU_DIR = "criu"
PARTIAL = ".partial-"
FORMAT = 1
# CRIU's logs of failed checkpoints: ROOT/.failed/<trajectory>/<checkpoint_id>.log.  The dot keeps
# the area apart from trajectories (an id cannot start with one); only the newest are kept.
FAILED = ".failed"
MAX_FAILED_LOGS = 16


@attrs.frozen
class FileRecord:
    """Size and checksum of one file of a checkpoint."""

    size: int
    sha256: str


@attrs.frozen
class Checkpoint:
    """A ready checkpoint: the manifest plus where it lies."""

    checkpoint_id: str
    trajectory: str
    prefix: int
    context_ref: str
    image: str
    config: dict[str, Any]
    container_id: str
    created_ns: int
    timings_ms: dict[str, float]
    files: dict[str, FileRecord]
    path: Path = attrs.field(eq=False)

    @property
    def total_bytes(self) -> int:
        """Bytes of the layer archive and CRIU images together."""
        return sum(f.size for f in self.files.values())

    def to_manifest(self) -> dict[str, Any]:
        """The JSON form written to manifest.json."""
        data = attrs.asdict(self, filter=lambda a, _v: a.name != "path")
        data["format"] = FORMAT
        return data

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        """Read ``path/manifest.json``; a missing or malformed one raises `CheckpointCorruptError`."""
        try:
            data = json.loads((path / MANIFEST).read_text())
            if data.pop("format", None) != FORMAT:
                raise ValueError(f"unknown manifest format (expected {FORMAT})")
            data["files"] = {k: FileRecord(**v) for k, v in data["files"].items()}
            return cls(path=path, **data)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"checkpoint {path} has no manifest: it is partial; remove it with `belayer-envckpt gc`"
            ) from exc
        except (ValueError, TypeError, KeyError) as exc:
            raise CheckpointCorruptError(
                f"checkpoint {path} has a malformed manifest ({exc}); remove it with `belayer-envckpt gc`"
            ) from exc


def record_files(directory: Path) -> dict[str, FileRecord]:
    """Sizes and sha256 of every file under ``directory`` (relative POSIX paths)."""
    records = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        records[file.relative_to(directory).as_posix()] = FileRecord(file.stat().st_size, sha256_file(file))
    return records


def verify_checkpoint(path: Path) -> Checkpoint:
    """Load and fully check a checkpoint: manifest, every file's presence, size and sha256."""
    checkpoint = Checkpoint.load(path)
    if LAYER not in checkpoint.files or not any(k.startswith(CRIU_DIR + "/") for k in checkpoint.files):
        raise CheckpointCorruptError(
            f"checkpoint {path} lacks its layer archive or CRIU images; it is partial"
        )
    for rel, record in checkpoint.files.items():
        file = path / rel
        if not file.is_file():
            raise CheckpointCorruptError(f"checkpoint {path} is missing {rel}; it cannot be restored")
        if file.stat().st_size != record.size or sha256_file(file) != record.sha256:
            raise CheckpointCorruptError(
                f"checkpoint {path}: {rel} does not match its checksum; it is corrupt and cannot be "
                "restored. Restore an earlier checkpoint (`belayer-envckpt ls`) or restart the trajectory"
            )
    extra = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - set(checkpoint.files)
    if extra - {MANIFEST}:
        raise CheckpointCorruptError(
            f"checkpoint {path} holds files its manifest does not list: {sorted(extra)}"
        )
    return checkpoint


def _lock_path(partial: Path) -> Path:
    return partial.with_name(partial.name + ".lock")


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


@attrs.define
class CheckpointStore:
    """A directory of checkpoints, grouped by trajectory."""

    root: Path = attrs.field(converter=Path)
    _held: dict[Path, int] = attrs.field(factory=dict, init=False, repr=False)

    def trajectory_dir(self, trajectory: str) -> Path:
        """Where one trajectory's checkpoints live."""
        return self.root / validate_id(trajectory, "trajectory")

    def begin(self, trajectory: str, checkpoint_id: str) -> Path:
        """Create the private working directory of a checkpoint in progress.

        The directory is paired with a lock file held (flock) until `publish`, `abort` or
        `abandon`: `gc` never takes a checkpoint that some process is still writing for a leftover,
        and a process that dies releases its lock with its file descriptors.
        """
        validate_id(checkpoint_id, "checkpoint")
        tmp = self.trajectory_dir(trajectory) / f"{PARTIAL}{checkpoint_id}"
        tmp.mkdir(parents=True)
        fd = os.open(_lock_path(tmp), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._held[tmp] = fd
        return tmp

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
        """Write the manifest, make everything durable, then rename into place (the ready point)."""
        final = tmp.parent / checkpoint.checkpoint_id
        if final.exists():
            raise CheckpointCorruptError(f"checkpoint {final} already exists; refusing to overwrite it")
        manifest = tmp / MANIFEST
        with manifest.open("w") as handle:
            json.dump(checkpoint.to_manifest(), handle, indent=1, sort_keys=True)
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_path(final.parent)
        self._release(tmp, unlink=True)
        return attrs.evolve(checkpoint, path=final)

    def list(self, trajectory: str | None = None) -> builtins.list[Checkpoint]:
        """Ready checkpoints (published, manifest readable), oldest first."""
        dirs = [self.trajectory_dir(trajectory)] if trajectory is not None else self._trajectory_dirs()
        found: builtins.list[Checkpoint] = []
        for tdir in dirs:
            if not tdir.is_dir():
                continue
            for entry in tdir.iterdir():
                if entry.is_dir() and not entry.name.startswith(PARTIAL):
                    try:
                        found.append(Checkpoint.load(entry))
                    except CheckpointCorruptError:
                        continue
        return sorted(found, key=lambda c: (c.created_ns, c.checkpoint_id))

    def leftovers(self, trajectory: str | None = None) -> builtins.list[Path]:
        """Partial checkpoints no process is writing, and published directories without a manifest."""
        dirs = [self.trajectory_dir(trajectory)] if trajectory is not None else self._trajectory_dirs()
        bad: builtins.list[Path] = []
        for tdir in dirs:
            if not tdir.is_dir():
                continue
            for entry in tdir.iterdir():
                if not entry.is_dir():
                    continue
                if entry.name.startswith(PARTIAL):
                    if not _in_progress(entry):
                        bad.append(entry)
                    continue
                try:
                    Checkpoint.load(entry)
                except CheckpointCorruptError:
                    bad.append(entry)
        return sorted(bad)

    def latest_ready(self, trajectory: str) -> Checkpoint | None:
        """The most recently published checkpoint of ``trajectory``, or None."""
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
        """Check a checkpoint's manifest and every file's size and sha256."""
        return verify_checkpoint(checkpoint.path if isinstance(checkpoint, Checkpoint) else Path(checkpoint))

    def gc(self, trajectory: str | None = None, *, keep: int | None = None) -> builtins.list[Path]:
        """Remove leftovers and kept CRIU logs of failed checkpoints; with ``trajectory``, only that
        trajectory's, and also its checkpoints (all, or all but the newest ``keep``).  Checkpoints
        in progress are never touched.
        """
        removed = list(self.leftovers(trajectory))
        if trajectory is not None:
            ready = self.list(trajectory)
            doomed = ready if not keep else ready[:-keep]
            removed += [c.path for c in doomed]
        elif keep:
            for tdir in self._trajectory_dirs():
                removed += [c.path for c in self.list(tdir.name)[:-keep]]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
            _lock_path(path).unlink(missing_ok=True)
        for tdir in self._trajectory_dirs():
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
            for folder in [*area.iterdir(), area]:
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        return logs

    def _trajectory_dirs(self) -> builtins.list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
