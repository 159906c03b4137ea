"""How `RolloutCluster` sees a node go: Ray's node table, and the router's broken streams.

Both are polled by the watcher; whichever names a node first decides `NodeLoss.detected_by`, and
the time each first named it is kept (`Detections`), so a report can say which came first and by
how much. The router's side uses belayer-router's `RouterAdmin` only: its ``workers()`` gives,
per slot, ``num_stream_failures`` (streams of that slot's workers that broke on the worker's side;
the router does not count a stream it cut itself) and ``last_stream_failure_at``. A slot whose
count rose since the watcher last looked is a suspect; its `SlotHost` is then pinged: a host that
answers is on a live node (a handover or a crashed worker its shadow replaces, also breaking
streams), one that does not has lost its node (`RolloutCluster` does the ping: it owns the hosts).
"""

from __future__ import annotations

import threading

import attrs

from belayer_cluster._errors import RouterAccessError
from belayer_router import RouterAdmin, RouterClientError, RouterUnreachableError

__all__ = ["DETECTORS", "Detections", "RouterStreams", "SlotStreams"]

# The detectors, in the order a tie (same poll) is broken.
DETECTORS = ("ray", "router broken streams")


@attrs.frozen
class SlotStreams:
    """A slot's broken streams as the router counts them (`GET /workers`)."""

    slot: str
    num_stream_failures: int
    last_stream_failure_at: float | None  # time.time() of the last one, None before any


class RouterStreams:
    """Each slot's broken streams, read from the router's `GET /workers`.

    `rises()` returns the slots whose count rose since it was last acknowledged (`acknowledge`):
    the watcher acknowledges a slot once its host answered (a live node), so the next break of the
    same slot is a new suspect. A slot's first count (when the watcher first sees it, at its start)
    is its baseline: breaks before the watcher ran are not counted.
    """

    def __init__(self, router_url: str, admin_token: str | None) -> None:
        self.router_url = router_url.rstrip("/")
        self.admin_token = admin_token
        self._baseline: dict[str, int] = {}

    def read(self) -> dict[str, SlotStreams] | None:
        """Each slot's broken streams now, or None when the router does not answer (a router that
        does not count them per slot gives 0 for every slot: only Ray's detector then works).
        `RouterAccessError` when the router refuses the read (a 4xx): that is a setting to fix,
        not a router away."""
        try:
            with RouterAdmin(self.router_url, self.admin_token, timeout_s=5.0) as admin:
                workers = admin.workers()
        except RouterUnreachableError:
            return None
        except RouterClientError as exc:
            if 400 <= exc.status < 500 and exc.status not in (408, 429):
                fix = (
                    "pass the router's admin token (RolloutCluster admin_token)"
                    if exc.status in (401, 403)
                    else "check router_url: it must be the belayer-router's base URL"
                )
                raise RouterAccessError(
                    f"the router at {self.router_url} refused to list its slots ({exc}): {fix}"
                ) from exc
            return None
        return {
            s.slot: SlotStreams(s.slot, s.num_stream_failures, s.last_stream_failure_at)
            for s in workers.slots
        }

    def rises(self) -> dict[str, SlotStreams]:
        """The slots whose broken-stream count rose since acknowledged (empty if the router is away;
        `RouterAccessError` if it refuses the read)."""
        now = self.read()
        if now is None:
            return {}
        for slot, streams in now.items():
            self._baseline.setdefault(slot, streams.num_stream_failures)
        return {slot: s for slot, s in now.items() if s.num_stream_failures > self._baseline[slot]}

    def acknowledge(self, streams: SlotStreams) -> None:
        """The slot's breaks up to `streams` are explained (its host answered)."""
        self._baseline[streams.slot] = max(self._baseline.get(streams.slot, 0), streams.num_stream_failures)


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
