"""The rollout host's lease: which trainer owns the rollout side of a run folder, if any.

``RUN_DIR/rollout-host/lease`` holds the pid of the trainer that owns the rollout host, or
``reaped`` once a guardian gave up waiting for a new trainer.  Every read and write happens under
an exclusive ``flock`` of the file, so a guardian whose grace period runs out and a resumed
trainer that adopts the host (`take_lease`) cannot both win: the guardian reaps only a lease that
no live trainer other than the dead one holds (`claim_for_reap`), and a trainer adopts only a
lease that is not ``reaped``, of a host that still runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "REAPED",
    "adopted_by",
    "claim_for_reap",
    "host_dir",
    "host_info",
    "pid_alive",
    "set_lease",
    "take_lease",
]

REAPED = "reaped"


def host_dir(run_dir: Path) -> Path:
    """The rollout host's folder: ``spec.json``, ``host.json``, ``control.sock``, ``lease``, ``host.log``."""
    return run_dir / "rollout-host"


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def host_info(run_dir: Path) -> dict[str, Any] | None:
    """``host.json`` of a rollout host that still runs (its pid alive), else None."""
    try:
        info = json.loads((host_dir(run_dir) / "host.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not pid_alive(int(info.get("pid", 0))):
        return None
    return info


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[int]:
    folder = host_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / "lease", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases the lock


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 64).decode(errors="replace").strip()


def _write(fd: int, text: str) -> None:
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    os.write(fd, text.encode())
    os.fsync(fd)


def take_lease(run_dir: Path, trainer_pid: int) -> bool:
    """Make ``trainer_pid`` the owner of the run folder's rollout side, so that no guardian of an
    earlier trainer reaps it (or the folder) any more; True when a live rollout host is there to
    adopt, False when there is none or a guardian has already begun to reap it."""
    if not host_dir(run_dir).is_dir():
        return False  # no rollout host ever ran in this folder: no guardian waits for one
    with _locked(run_dir) as fd:
        if _read(fd) == REAPED:
            return False
        _write(fd, str(trainer_pid))
        return host_info(run_dir) is not None


def set_lease(run_dir: Path, trainer_pid: int) -> None:
    """``trainer_pid`` owns the rollout host it is starting (a new host: any earlier mark goes)."""
    with _locked(run_dir) as fd:
        _write(fd, str(trainer_pid))


def adopted_by(run_dir: Path, dead_pid: int) -> int | None:
    """The live trainer other than ``dead_pid`` that holds the lease, if one does."""
    with _locked(run_dir) as fd:
        text = _read(fd)
    if text.isdigit() and int(text) != dead_pid and pid_alive(int(text)):
        return int(text)
    return None


def claim_for_reap(run_dir: Path, dead_pid: int) -> bool:
    """Mark the lease ``reaped`` unless a live trainer other than ``dead_pid`` holds it (then False:
    that trainer owns the host now, its own guardian covers it)."""
    with _locked(run_dir) as fd:
        text = _read(fd)
        if text.isdigit() and int(text) != dead_pid and pid_alive(int(text)):
            return False
        _write(fd, REAPED)
        return True
