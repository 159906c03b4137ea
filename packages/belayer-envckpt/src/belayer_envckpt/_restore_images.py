"""The CRIU images a full restore hands to the engine: the page images read in place, or copied.

Docker 20.10 takes no image folder on start: the images go into the container's checkpoint
folder, the engine streams that folder as a tar into containerd's content store, and containerd
unpacks it into a ``ctrd-checkpoint*`` folder for runc and CRIU (`benchmarks/profile_restore.py`:
most of a 200 MB restore).  The page images are almost all of those bytes, and CRIU only reads
them.  So each ``pages-*.img`` goes in as a symbolic link to the store's file instead: the tar
carries the link, containerd unpacks the link, and CRIU reads the store's file in place.

The link is relative and climbs to the root first (``../`` more times than any folder is deep,
then the store's absolute path, symbolic links resolved): CRIU opens the images relative to the
image folder it was given, after it has entered the new container's root, where an absolute
target (or an absolute symbolic link on the way) would name a path inside the container.  A climb
past the top of the mount tree stays at its root, wherever containerd unpacks the folder.

A link is used only where it resolves to the same file for containerd (and so for the runc and
CRIU it starts): the store's path through ``/proc/<containerd>/root`` names the same inode, which
is false for a store in a private mount (a node of belayer-cluster's `IsolatedRayCluster` keeps
its /tmp to itself).  And never when CRIU is told ``auto-dedup`` (it punches the pages it restored
out of the images: the store's).  Otherwise the images are hard-linked (same filesystem) or
copied, as before.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ._criu import RUNC_CONF, runc_conf_options
from ._procfs import host_proc

IN_PLACE = "in-place"
COPIED = "copied"
# Deeper than any path the engine unpacks into: extra steps up stay at the root.
_UP = "../" * 64
# CRIU's configuration files that runc's CRIU reads (``auto-dedup`` in either rules links out).
CRIU_CONFS = (RUNC_CONF, Path("/etc/criu/default.conf"))
ENGINE_COMMANDS = ("containerd",)


def _engine_roots() -> list[Path]:
    """``/proc/<pid>/root`` of every containerd on the host (runc and CRIU run in its mounts)."""
    proc = host_proc()
    roots = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        try:
            comm = Path(proc, pid, "comm").read_text().strip()
        except OSError:
            continue
        if comm in ENGINE_COMMANDS:
            roots.append(Path(proc, pid, "root"))
    return roots


def engine_sees(path: Path) -> bool:
    """True when every containerd on the host finds the very file ``path`` at the same path
    (same device and inode through its root); False where none is found or one cannot look."""
    path = Path(os.path.realpath(path))  # the path the links name (`stage_images`)
    try:
        ours = path.stat()
    except OSError:
        return False
    roots = _engine_roots()
    if not roots:
        return False
    for root in roots:
        try:
            theirs = Path(str(root) + str(path)).stat()
        except OSError:
            return False
        if (theirs.st_dev, theirs.st_ino) != (ours.st_dev, ours.st_ino):
            return False
    return True


def dedup_configured() -> bool:
    """True when a CRIU configuration file asks for ``auto-dedup`` (restore would punch holes)."""
    return any(
        option.lstrip("-").startswith("auto-dedup")
        for conf in CRIU_CONFS
        for option in runc_conf_options(conf)
    )


def link_or_copy(src: str, dst: str) -> None:
    """Hard-link an image file into the engine's folder (nothing reads it but the engine's tar);
    copy it where the store lies on another mount than the engine's data root (EXDEV)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def stage_images(images: Path, target: Path, *, in_place: bool) -> str:
    """Put the CRIU ``images`` into the engine's ``target`` folder; `IN_PLACE` when the page
    images went in as links to the store's files, else `COPIED` (hard links or copies)."""
    linked = in_place and not dedup_configured() and engine_sees(images)

    def place(src: str, dst: str) -> None:
        if linked and os.path.basename(src).startswith("pages-"):
            # The real path: CRIU would resolve an absolute symbolic link on the way (a store under
            # /var/run -> /run, a /home -> /data/home) against the new container's root.
            os.symlink(_UP + os.path.realpath(src).lstrip("/"), dst)
        else:
            link_or_copy(src, dst)

    shutil.copytree(images, target, copy_function=place)
    return IN_PLACE if linked else COPIED
