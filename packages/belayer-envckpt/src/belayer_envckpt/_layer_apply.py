"""Apply a checkpoint's layer archive to a RUNNING container through its merged root.

A normal restore extracts the archive (an overlay upper directory: whiteouts, opaque directories)
into a new container's upper directory before it starts.  A spare container (`_spares.py`) is
already started, so its upper directory belongs to a mounted overlay and must not be written
directly; instead the archive is replayed as ordinary file operations on the overlay's merged
directory on the host, which gives the same merged view:

- a whiteout (character device 0/0) at P: P is removed (overlay records the deletion itself);
- an opaque directory D: D is removed whole and recreated by tar (overlay makes it opaque);
- a file, symlink, hard link or fifo: whatever the merged root holds at its path is removed first
  (tar never writes through an image's symlink); a directory over a non-directory likewise;
- everything else is extracted by GNU tar with the same modes, owners, times, ACLs and xattrs,
  except the ``trusted.overlay.*`` xattrs, which overlay keeps to itself.

`plan_apply` decides from the archive alone whether this is exact; anything it cannot vouch for
(overlay redirects or metacopy, an entry whose parent directory is not in the archive, a change
to what the init's start reads: its executables, libraries, users, working directory) answers
None and the caller takes the normal path.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

import attrs

from ._host_commands import run_command
from ._layer import _TAR_FLAGS

_XATTR = "SCHILY.xattr."
_OPAQUE = "trusted.overlay.opaque"
# overlay's own bookkeeping, made again at every copy-up; none changes what the merged root shows.
_BOOKKEEPING = frozenset({"trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.uuid"})
# Read when a container starts (the init's executable and libraries, its user, the loader).
_START_DIRS = (
    "bin",
    "sbin",
    "lib",
    "lib32",
    "lib64",
    "libx32",
    "usr/bin",
    "usr/sbin",
    "usr/lib",
    "usr/lib32",
    "usr/lib64",
    "usr/libx32",
    "usr/local/bin",
    "usr/local/sbin",
    "usr/local/lib",
)
_START_FILES = ("etc/passwd", "etc/group", "etc/ld.so.cache", "etc/ld.so.preload", "etc/ld.so.conf")


@attrs.frozen
class ApplyPlan:
    """What to do to the merged root: removals in archive order, then one tar extraction."""

    removals: tuple[
        tuple[str, str], ...
    ]  # (relative path, why: whiteout | opaque | not-a-directory | replace)
    whiteouts: tuple[str, ...]  # archive member names tar must skip
    directories: frozenset[str]  # normalised relative paths of the archive's directories


def _norm(name: str) -> str:
    norm = posixpath.normpath(name)
    return "" if norm == "." else norm


def _is_whiteout(member: tarfile.TarInfo) -> bool:
    return member.ischr() and member.devmajor == 0 and member.devminor == 0


def _start_paths(
    command: Sequence[str], working_dir: str, path_env: str
) -> tuple[set[str], set[str], set[str]]:
    """(directories whose contents the start reads, files it reads, folders that must stay folders)."""
    dirs = set(_START_DIRS) | {_norm(d.lstrip("/")) for d in path_env.split(":") if d.startswith("/")}
    files = set(_START_FILES)
    if command and command[0].startswith("/"):
        files.add(_norm(command[0].lstrip("/")))
    folders: set[str] = set()
    for path in (*dirs, *files, _norm(working_dir.lstrip("/"))):
        parts = path.split("/")
        folders |= {"/".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return dirs - {""}, files, (folders - files) - {""}


def plan_apply(
    members: Sequence[tarfile.TarInfo], *, command: Sequence[str], working_dir: str, path_env: str = ""
) -> ApplyPlan | None:
    """The operations that replay ``members`` on a merged root exactly, or None when unsure.

    ``members`` must have passed `check_layer_archive` (no escapes, no devices but whiteouts).
    """
    start_dirs, start_files, folders = _start_paths(command, working_dir, path_env)
    seen_dirs: set[str] = {""}
    removals: list[tuple[str, str]] = []
    whiteouts: list[str] = []
    for member in members:
        rel = _norm(member.name)
        if "\n" in member.name:
            return None  # tar's exclude list is one name a line
        xattrs = {k[len(_XATTR) :] for k in member.pax_headers if k.startswith(_XATTR)}
        if any(x.startswith("trusted.overlay.") and x not in _BOOKKEEPING | {_OPAQUE} for x in xattrs):
            return None  # redirect / metacopy / origin: an overlay feature not replayed here
        if not rel:
            continue
        if posixpath.dirname(rel) not in seen_dirs:
            return None  # tar lists a directory before its entries; without it nothing is vouched for
        plain_dir = member.isdir() and _OPAQUE not in xattrs
        if (
            rel in start_files
            or any(rel.startswith(d + "/") for d in start_dirs)
            or (rel in folders and not plain_dir)
        ):
            return None  # the spare's init started with the old files: a normal start reads the new
        if _is_whiteout(member):
            removals.append((rel, "whiteout"))
            whiteouts.append(member.name)
        elif member.isdir():
            seen_dirs.add(rel)
            removals.append((rel, "opaque" if _OPAQUE in xattrs else "not-a-directory"))
        else:
            removals.append((rel, "replace"))
    return ApplyPlan(tuple(removals), tuple(whiteouts), frozenset(seen_dirs))


def _remove(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def apply_layer(archive: Path, merged: Path, plan: ApplyPlan) -> None:
    """Replay ``archive`` on the running container's ``merged`` root, as ``plan`` says."""
    for rel, why in plan.removals:
        path = merged / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # nothing there (a parent already removed, or absent below as well)
        is_dir = stat.S_ISDIR(st.st_mode)
        # A non-directory entry is always removed first: tar then creates it anew and never
        # writes through what the image held there (an absolute symlink would lead to the host).
        if why in ("whiteout", "opaque", "replace") or (why == "not-a-directory" and not is_dir):
            _remove(path)
    with tempfile.NamedTemporaryFile("w", prefix="belayer-whiteouts-", suffix=".txt") as excludes:
        excludes.write("".join(f"{name}\n" for name in plan.whiteouts))
        excludes.flush()
        run_command(
            [
                "tar",
                "--extract",
                "--file",
                str(archive),
                "--directory",
                str(merged),
                "--same-permissions",
                "--same-owner",
                *_TAR_FLAGS,
                "--xattrs-exclude=trusted.overlay.*",
                "--no-wildcards",
                "--anchored",
                f"--exclude-from={excludes.name}",
            ],
            hint="applying the checkpoint's layer to a spare container failed",
        )
