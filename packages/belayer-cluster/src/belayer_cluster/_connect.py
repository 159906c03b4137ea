"""Joining an existing Ray cluster and leaving it, for callers that must not import ray."""

from __future__ import annotations

import logging

import ray

from belayer_cluster._errors import ClusterStartError

__all__ = ["connect", "disconnect"]


def connect(address: str) -> None:
    """Connect this process to the Ray cluster at `address` (its GCS, HOST:PORT)."""
    if ray.is_initialized():
        raise ClusterStartError("this process is already connected to Ray; disconnect() first")
    try:
        ray.init(address=address, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterStartError(
            f"could not join the Ray cluster at {address!r}: {exc}; check the address `ray status` prints"
        ) from exc


def disconnect() -> None:
    """Leave the Ray cluster this process is connected to (nothing if none)."""
    if ray.is_initialized():
        ray.shutdown()
