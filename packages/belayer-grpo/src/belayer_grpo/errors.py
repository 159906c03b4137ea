"""The one error hierarchy of belayer-grpo, rooted at `BelayerGrpoError`."""

from __future__ import annotations

__all__ = [
    "BelayerGrpoError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "RolloutError",
    "SystemStartError",
]


class BelayerGrpoError(Exception):
    """Base class of every error raised by belayer-grpo."""


class ConfigError(BelayerGrpoError, ValueError):
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
