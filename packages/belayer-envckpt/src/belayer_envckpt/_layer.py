"""The container's writable overlay layer: archived with GNU tar, checked, installed.

GNU tar is used because it round-trips what overlayfs stores in the upper directory: whiteouts
(character devices 0/0), opaque directories (the ``trusted.overlay.opaque`` xattr), modes, numeric
ownership and other xattrs.  Python's tarfile only reads the archive, to check its members before
anything is extracted.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import tarfile
from pathlib import Path

from ._errors import CheckpointCorruptError, UnsafeArchiveError
from ._host_commands import run_command

_TAR_FLAGS = ("--xattrs", "--xattrs-include=*", "--numeric-owner", "--acls")


def capture_layer(upper_dir: Path, archive: Path) -> None:
    """Archive ``upper_dir`` (the container must be frozen) into ``archive``."""
    run_command(
        [
            "tar",
            "--create",
            "--file",
            str(archive),
            "--directory",
            str(upper_dir),
            "--sparse",
            *_TAR_FLAGS,
            ".",
        ],
        hint="the container's overlay upper directory could not be archived",
    )


def layer_digest(upper_dir: Path) -> str:
    """A digest of the writable layer's metadata: equal digests mean an unchanged layer.

    Every entry's path, inode, type and mode, owner, size, link count, device, mtime and ctime
    (a write, a deletion, a rename, a chmod or an xattr change moves the ctime of the entry or of
    its directory, and no process can set a ctime back).  No file is read: it costs one walk of
    the layer, as the disk cap's measurement does.
    """
    digest = hashlib.sha256()
    todo = [""]
    while todo:
        rel = todo.pop()
        path = os.path.join(upper_dir, rel) if rel else str(upper_dir)
        st = os.stat(path, follow_symlinks=False)
        digest.update(f"{rel}\0{st.st_ino} {st.st_mode} {st.st_uid} {st.st_gid} {st.st_size} ".encode())
        digest.update(f"{st.st_nlink} {st.st_rdev} {st.st_mtime_ns} {st.st_ctime_ns}\n".encode())
        if stat.S_ISDIR(st.st_mode):
            with os.scandir(path) as entries:
                todo.extend(sorted((os.path.join(rel, e.name) for e in entries), reverse=True))
    return digest.hexdigest()


def _inside(path: str) -> bool:
    """Whether a relative archive path stays inside the root once normalised."""
    norm = posixpath.normpath(path)
    return not (norm == ".." or norm.startswith("../") or posixpath.isabs(path))


def _through(norm: str, symlinks: set[str]) -> bool:
    """Whether the path ``norm`` lies under one of ``symlinks`` (a link to the symlink itself is fine)."""
    parts = norm.split("/")
    return any("/".join(parts[:depth]) in symlinks for depth in range(1, len(parts)))


def check_layer_archive(archive: Path) -> int:
    """Refuse members that would escape the root on extraction; return the member count."""
    return len(checked_members(archive))


def checked_members(archive: Path) -> list[tarfile.TarInfo]:
    """The archive's members, once `check_layer_archive`'s rules hold for every one.

    Refused: absolute names, ``..`` components, hard links to outside the archive root, symlinks
    whose relative target climbs above the root, members written through a symlink of the same
    archive, hard links whose target goes through such a symlink, and device nodes other
    than overlay whiteouts (character devices 0/0).
    """
    try:
        with tarfile.open(archive, "r:") as tar:
            members = tar.getmembers()
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CheckpointCorruptError(
            f"layer archive {archive} is unreadable ({exc}); take a new checkpoint"
        ) from exc
    symlinks: set[str] = set()
    for member in members:
        name = member.name
        if posixpath.isabs(name) or not _inside(name) or ".." in name.split("/"):
            raise UnsafeArchiveError(
                f"layer archive member {name!r} escapes the root; refusing to install it"
            )
        norm = posixpath.normpath(name)
        parts = norm.split("/")
        for depth in range(1, len(parts)):
            if "/".join(parts[:depth]) in symlinks:
                raise UnsafeArchiveError(
                    f"layer archive member {name!r} would be written through the symlink "
                    f"{'/'.join(parts[:depth])!r}; refusing to install it"
                )
        if member.islnk() and (posixpath.isabs(member.linkname) or not _inside(member.linkname)):
            raise UnsafeArchiveError(f"hard link {name!r} -> {member.linkname!r} points outside the layer")
        if member.islnk() and _through(posixpath.normpath(member.linkname), symlinks):
            raise UnsafeArchiveError(
                f"hard link {name!r} -> {member.linkname!r} goes through a symlink of the archive; "
                "refusing to install it"
            )
        if member.issym():
            symlinks.add(norm)
            target = member.linkname
            if not posixpath.isabs(target) and not _inside(posixpath.join(posixpath.dirname(norm), target)):
                raise UnsafeArchiveError(f"symlink {name!r} -> {target!r} points outside the root")
        if (member.ischr() or member.isblk()) and not (
            member.ischr() and member.devmajor == 0 and member.devminor == 0
        ):
            raise UnsafeArchiveError(
                f"device node {name!r} ({member.devmajor}:{member.devminor}) is not an overlay whiteout"
            )
    return members


def install_layer(archive: Path, upper_dir: Path) -> None:
    """Check ``archive`` and extract it into a fresh (not yet started) container's upper dir."""
    check_layer_archive(archive)
    run_command(
        [
            "tar",
            "--extract",
            "--file",
            str(archive),
            "--directory",
            str(upper_dir),
            "--same-permissions",
            "--same-owner",
            *_TAR_FLAGS,
        ],
        hint="installing the checkpoint's layer into the new container failed",
    )
