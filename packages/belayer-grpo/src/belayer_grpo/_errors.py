"""The one error hierarchy of belayer-grpo, rooted at `BelayerGrpoError`, and the CLI's exit codes."""

from __future__ import annotations

import enum
import traceback
from pathlib import Path

__all__ = [
    "BelayerGrpoError",
    "CheckpointError",
    "DataError",
    "ExitCode",
    "GrpoConfigError",
    "RolloutError",
    "SandboxCommandError",
    "SandboxImageError",
    "SystemStartError",
    "TaskFormatError",
    "TrajectoryFailedError",
    "UnrecoverableTrajectoryError",
    "describe_error",
]


class ExitCode(enum.IntEnum):
    """The exit codes of the root README's CLI contract, the same in every Belayer command."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNHEALTHY = 3
    INTERRUPTED = 130


class BelayerGrpoError(Exception):
    """Base class of every error raised by belayer-grpo."""


class GrpoConfigError(BelayerGrpoError, ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key {key!r}: {message}")
        self.key = key


class DataError(BelayerGrpoError, ValueError):
    """A data set file is missing or malformed; the message names the file and the record."""


class CheckpointError(BelayerGrpoError):
    """A training checkpoint cannot be written, read or resumed from."""


class RolloutError(BelayerGrpoError):
    """Rollouts could not be produced (the router or every worker is unreachable)."""


class SystemStartError(BelayerGrpoError):
    """A part of the system (router, engine slot, sandbox pool) did not start; see the message."""


class TaskFormatError(DataError):
    """A task file (SWE-Gym style jsonl) is missing or malformed; the message names file and line."""


class SandboxImageError(BelayerGrpoError):
    """The task sandbox image cannot be built (base image missing, container engine unreachable)."""


class TrajectoryFailedError(RolloutError):
    """A trajectory could not be completed (for example more sandbox failures than allowed)."""


class SandboxCommandError(BelayerGrpoError):
    """A command belayer-grpo runs in a sandbox besides the agent's actions (the repository hash)
    failed; the trajectory treats it as a sandbox failure and recovers."""


class UnrecoverableTrajectoryError(TrajectoryFailedError):
    """One trajectory cannot be recovered (more sandbox failures than ``rollout.max_recoveries``,
    a restart from the image that fails twice, a checkpoint that fails verification with no
    earlier one); ``rollout.on_unrecoverable`` decides what becomes of its group."""

    def __init__(self, trajectory_id: str, message: str) -> None:
        super().__init__(f"trajectory {trajectory_id}: {message}")
        self.trajectory_id = trajectory_id


def describe_error(error: BaseException, _depth: int = 0) -> str:
    """``Type (file:line in function): message``: the error's type and where it was raised, so an
    error whose text is empty still says what it is; the innermost frame of its traceback, and
    the chain of causes it was raised from."""
    kind = type(error)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    text = str(error) or repr(error)
    cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    described = f"{name}{where}: {text}"
    if cause is not None and cause is not error and _depth < 4:
        described += f" <- {describe_error(cause, _depth + 1)}"
    return described
