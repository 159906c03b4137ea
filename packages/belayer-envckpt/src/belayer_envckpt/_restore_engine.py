"""Which engine restores a checkpoint, and how: the line `belayer-envckpt doctor` prints."""

from __future__ import annotations

import shutil

from ._restore_images import CRIU_CONFS, _engine_roots, dedup_configured


def restore_engine_line(docker_version: str) -> str:
    """Docker restores every checkpoint; say how its page images reach CRIU, and what a Podman
    found beside it would change.

    Docker 20.10 streams the image folder into containerd's content store and unpacks it again
    (most of a 200 MB restore: `benchmarks/profile_restore.py`); belayer-envckpt hands it links
    to the store's page images instead where containerd sees the store (`_restore_images`), so
    CRIU reads them in place, as Podman does.  belayer-envckpt has no Podman backend, so a Podman
    on PATH is named but not used.
    """
    used = f"docker {docker_version}"
    if dedup_configured():
        pages = (
            "page images copied through containerd's content store: auto-dedup in "
            f"{' or '.join(str(c) for c in CRIU_CONFS)} would punch them out of the checkpoint store"
        )
    elif not _engine_roots():
        pages = (
            "page images copied through containerd's content store: no containerd process is visible "
            "here to check that it sees the checkpoint store"
        )
    else:
        pages = (
            "page images read in place from the checkpoint store where containerd sees it at the "
            "same path (checked on every restore), else copied through containerd's content store"
        )
    podman = shutil.which("podman")
    if podman is None:
        return f"{used}, {pages} (podman is not installed)"
    return (
        f"{used}, {pages} (podman at {podman} is present but not used: belayer-envckpt has no "
        "Podman backend, its sandboxes and checkpoints are Docker's)"
    )
