"""The one error hierarchy of belayer-grpo, rooted at `BelayerGrpoError`, and the CLI's exit codes."""

from __future__ import annotations

import enum

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
