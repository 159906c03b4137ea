"""The error hierarchy of belayer-policy: everything raised on purpose derives from one root."""

from __future__ import annotations

__all__ = ["BelayerPolicyError", "PolicyArgumentError", "PolicyStateError", "TraceFormatError"]


class BelayerPolicyError(Exception):
    """Root of every error that belayer-policy raises on purpose."""


class PolicyArgumentError(BelayerPolicyError, ValueError):
    """An argument is out of range or malformed; the message names the argument and what it accepts."""


class TraceFormatError(PolicyArgumentError):
    """A JSONL trace is empty or malformed; the message names the file and line."""


class PolicyStateError(BelayerPolicyError):
    """A callback arrived out of order (for example a ready checkpoint that was never decided)."""
