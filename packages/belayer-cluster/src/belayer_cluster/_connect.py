"""Joining an existing Ray cluster and leaving it, for callers that must not import ray."""

from __future__ import annotations

import logging
import socket

from belayer_cluster._errors import ClusterConfigError, ClusterStartError

__all__ = ["check_address", "connect", "disconnect"]


def check_address(address: str, timeout_s: float = 10.0) -> None:
    """Raise `ClusterConfigError` naming `address` unless it is HOST:PORT and something listens there.

    Ray's own `ray.init(address=...)` retries an address where nothing answers for minutes; this
    check makes a wrong address a clear error within `timeout_s`.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ClusterConfigError(f"the Ray address must be HOST:PORT (got {address!r})")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ClusterConfigError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}); start one (`ray start --head`) "
            "or pass the GCS address `ray status` prints"
        ) from exc


def connect(address: str, connect_timeout_s: float = 10.0) -> None:
    """Connect this process to the Ray cluster at `address` (its GCS, HOST:PORT).

    A malformed address or one where nothing answers is a `ClusterConfigError` that names it;
    a cluster that answers but cannot be joined is a `ClusterStartError`.
    """
    check_address(address, connect_timeout_s)
    import ray

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
    import ray

    if ray.is_initialized():
        ray.shutdown()
