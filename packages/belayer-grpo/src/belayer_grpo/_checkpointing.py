"""Training checkpoints: model, optimizer and data position in one file, written atomically."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from belayer_grpo._errors import CheckpointError

__all__ = ["find_latest", "load_checkpoint", "save_checkpoint"]

_NAME = re.compile(r"step_(\d+)\.pt$")


def save_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as ``directory/step_<step>.pt`` (temp file, fsync, rename, fsync the folder)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step:06d}.pt"
    tmp = directory / f".{path.name}.tmp"
    try:
        with tmp.open("wb") as file:
            torch.save({"step": step, **state}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"cannot write checkpoint {path}: {error}") from error
    return path


def find_latest(directory: Path) -> Path | None:
    """The checkpoint with the highest step in ``directory``, or None."""
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.search(p.name))]
    return max(found)[1] if found else None


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; give a step_*.pt file or 'latest'")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises many kinds on a torn or foreign file
        raise CheckpointError(f"cannot read checkpoint {path}: {error}") from error
    if not isinstance(state, dict) or not {"step", "model", "optimizer", "sampler"} <= set(state):
        raise CheckpointError(
            f"{path} is not a belayer-grpo checkpoint (needs step, model, optimizer, sampler)"
        )
    return state
