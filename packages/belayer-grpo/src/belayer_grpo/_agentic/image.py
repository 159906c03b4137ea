"""Build the task sandbox image locally: the base image plus the shipped task repositories.

No registry and no network: belayer-envckpt's `Engine.commit_archive` creates a container (never
started) from the local base image, copies the repositories in and commits it.  Each
repository lands twice: at ``/workspace/<name>`` (where the agent works) and at
``/opt/belayer-tasks/<name>`` (a pristine copy the test command restores test files from).  The
tag is a hash of the base image id and every file, so an unchanged task set is built once.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
from collections.abc import Sequence
from pathlib import Path

from belayer_envckpt import BelayerEnvckptError, Engine, ImageNotFoundError
from belayer_grpo._agentic.swegym import PRISTINE_ROOT, WORKSPACE_ROOT, SweTask
from belayer_grpo._errors import SandboxImageError

__all__ = ["DEFAULT_BASE_IMAGE", "TASK_IMAGE_REPOSITORY", "build_task_image"]

DEFAULT_BASE_IMAGE = "belayer/debian-python:latest"
TASK_IMAGE_REPOSITORY = "belayer/grpo-swe-tasks"
BUILD_LABEL = "belayer.grpo.image-build"


def _files(tasks: Sequence[SweTask]) -> list[tuple[str, Path]]:
    """(name inside the image's repository folders, host path) for every file, sorted."""
    out: list[tuple[str, Path]] = []
    for task in tasks:
        if task.source_dir is None:
            continue
        for path in sorted(p for p in task.source_dir.rglob("*") if p.is_file()):
            if "__pycache__" in path.parts:
                continue
            out.append((f"{task.source_dir.name}/{path.relative_to(task.source_dir).as_posix()}", path))
    return sorted(set(out))


def _archive(files: list[tuple[str, Path]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        dirs: set[str] = set()
        for root in (WORKSPACE_ROOT, PRISTINE_ROOT):
            for name, path in files:
                member = f"{root.strip('/')}/{name}"
                parts = member.split("/")
                for depth in range(1, len(parts)):
                    folder = "/".join(parts[:depth])
                    if folder not in dirs:
                        dirs.add(folder)
                        info = tarfile.TarInfo(folder)
                        info.type, info.mode = tarfile.DIRTYPE, 0o755
                        tar.addfile(info)
                data = path.read_bytes()
                info = tarfile.TarInfo(member)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def build_task_image(
    engine: Engine,
    tasks: Sequence[SweTask],
    *,
    base_image: str = DEFAULT_BASE_IMAGE,
    repository: str = TASK_IMAGE_REPOSITORY,
) -> str:
    """Build (or reuse) the image holding every ``source`` task's repository; return its tag."""
    try:
        base_id = engine.image_id(base_image)
    except ImageNotFoundError as error:
        raise SandboxImageError(
            f"base image {base_image!r} is not present; build it locally with `bash scripts/setup-system` "
            "(there is no registry to pull from)"
        ) from error
    except BelayerEnvckptError as error:
        raise SandboxImageError(f"cannot inspect base image {base_image!r}: {error}") from error
    files = _files(tasks)
    digest = hashlib.sha256(base_id.encode())
    for name, path in files:
        digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    tag = f"{repository}:{digest.hexdigest()[:16]}"
    try:
        if engine.has_image(tag):
            return tag
        engine.commit_archive(
            base_image, _archive(files), repository=repository, tag=tag.rsplit(":", 1)[1],
            labels={BUILD_LABEL: "1"},
        )  # fmt: skip
    except BelayerEnvckptError as error:
        raise SandboxImageError(f"building task image {tag} failed: {error}") from error
    return tag
