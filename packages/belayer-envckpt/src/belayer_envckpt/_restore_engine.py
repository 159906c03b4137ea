"""Which engine restores a checkpoint, and why: the line `belayer-envckpt doctor` prints."""

from __future__ import annotations

import shutil


def restore_engine_line(docker_version: str) -> str:
    """Docker restores every checkpoint; say so, and what a Podman found beside it would change.

    Podman restores a CRIU checkpoint from the image folder in place, where Docker 20.10 first
    streams the whole folder into containerd's content store and unpacks it again (most of a
    200 MB restore: `benchmarks/profile_restore.py`).  belayer-envckpt has no Podman backend, so a
    Podman on PATH is named but not used.
    """
    podman = shutil.which("podman")
    used = f"docker {docker_version}"
    if podman is None:
        return (
            f"{used} (the only engine found: podman is not installed; Docker's restore streams the CRIU "
            "images through containerd's content store: benchmarks/profile_restore.py)"
        )
    return (
        f"{used} (podman at {podman} is present but not used: belayer-envckpt has no Podman backend, "
        "its sandboxes and checkpoints are Docker's)"
    )
