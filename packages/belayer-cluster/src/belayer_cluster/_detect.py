"""How `RolloutCluster` sees a node go: Ray's node table, and the router's broken streams.

Both are polled by the watcher; whichever names a node first decides `NodeLoss.detected_by`, and
the time each first named it is kept (`Detections`), so a report can say which came first and by
how much. The router's side uses belayer-router's public HTTP API only:

- ``GET /metrics``: ``belayer_router_resumes_total`` rises when a worker's stream breaks (the
  router resumes the request elsewhere); the router has no per-slot count, so
- ``GET /workers`` names each slot's registered worker; a slot whose worker refuses connections
  while streams broke is the suspect, and its node is lost when its slot host does not answer
  either (a handover also breaks streams and leaves the worker away for a moment, but its host
  answers).

A slot whose worker is gone without a broken stream (no request was on it) is still found, as
``"worker probe"``.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx

__all__ = ["DETECTORS", "Detections", "RouterStreams", "reachable"]

# The detectors, in the order a tie (same poll) is broken.
DETECTORS = ("ray", "router broken streams", "worker probe")
_RESUMES = re.compile(r"^belayer_router_resumes_total\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


class RouterStreams:
    """The router's broken streams, read from its `/metrics` and `/workers`."""

    def __init__(self, router_url: str, admin_token: str | None, *, window_s: float = 10.0) -> None:
        self.router_url = router_url.rstrip("/")
        self.headers = {} if admin_token is None else {"Authorization": f"Bearer {admin_token}"}
        self.window_s = window_s  # a break counts for this long (its node may be confirmed later)
        self._last: float | None = None
        self._broke_at: float | None = None

    def poll(self) -> bool:
        """Read the resume counter; True while a stream broke within the last `window_s`."""
        try:
            text = httpx.get(f"{self.router_url}/metrics", timeout=5.0).text
        except httpx.HTTPError:
            return self._recent()
        match = _RESUMES.search(text)
        if match is not None:
            value = float(match.group(1))
            if self._last is not None and value > self._last:
                self._broke_at = time.monotonic()
            self._last = value
        return self._recent()

    def _recent(self) -> bool:
        return self._broke_at is not None and time.monotonic() - self._broke_at <= self.window_s

    def workers(self) -> dict[str, str | None] | None:
        """Each slot's registered worker URL, or None when the router does not answer."""
        try:
            answer = httpx.get(f"{self.router_url}/workers", headers=self.headers, timeout=5.0)
            return {w["slot"]: w["url"] for w in answer.raise_for_status().json()["slots"]}
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None


class Detections:
    """When each detector first named each node (`time.time()`), kept after the node is handled."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def saw(self, node_id: str, detector: str, at: float) -> None:
        """Record `detector` naming `node_id` at `at` (only its first time counts)."""
        with self._lock:
            self._seen.setdefault(node_id, {}).setdefault(detector, at)

    def of(self, node_id: str) -> dict[str, float]:
        """Every detector that named the node so far, with its time."""
        with self._lock:
            return dict(self._seen.get(node_id, {}))

    def first(self, node_id: str) -> str:
        """The detector that named the node first (ties: `DETECTORS` order)."""
        seen = self.of(node_id)
        return min(seen, key=lambda name: (seen[name], DETECTORS.index(name)))


def reachable(url: str | None) -> bool:
    """True when something accepts TCP connections at the worker URL's host and port."""
    if not url:
        return False
    parsed = httpx.URL(url)
    try:
        with socket.create_connection((parsed.host, parsed.port or 80), timeout=2.0):
            return True
    except OSError:
        return False
