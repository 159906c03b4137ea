"""Errors of the agentic workload; all derive from `belayer_grpo.errors.BelayerGrpoError`."""

from __future__ import annotations

from belayer_grpo.errors import BelayerGrpoError, DataError, RolloutError

__all__ = ["SandboxImageError", "TaskFormatError", "TrajectoryFailedError"]


class TaskFormatError(DataError):
    """A task file (SWE-Gym style jsonl) is missing or malformed; the message names file and line."""


class SandboxImageError(BelayerGrpoError):
    """The task sandbox image cannot be built (base image missing, Docker unreachable)."""


class TrajectoryFailedError(RolloutError):
    """A trajectory could not be completed (for example more sandbox failures than allowed)."""
