"""The restart baselines the shadow worker is measured against, behind the same supervisor.

Both recover from scratch: kill what is left of the worker, release and allocate the memory again,
reload the weights from the checkpoint file, start a new worker (which warms up and registers at
epoch + 1). They differ in detection and resume:

- `conventional` (the paper's baseline): remote health checks (`GET /health` every
  `health_interval_s`; failed after `health_misses` misses in a row; defaults like common
  trainers, 10 s x 3), and interrupted requests are regenerated from the start (the worker's
  `regenerate` resume mode hides the tokens the client already has, but computes them again).
- `restart` (the strongest restart baseline): the supervisor's instant `waitpid` detection (the
  reaper thread, as for the shadow), and token-level resume through the router (`continue`: the
  new worker prefills prompt + streamed tokens, nothing is regenerated).

The supervisor does the restart itself (`Restarter.restart_from_scratch`); a baseline only decides
when. It never sees the supervisor's lock or counters.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import attrs
import httpx

__all__ = ["ConventionalRecovery", "Restarter"]


class Restarter(Protocol):
    """What a restart baseline needs from the slot supervisor, and nothing more."""

    @property
    def main_url(self) -> str | None:
        """The URL the current main worker registered (None while there is none)."""
        ...

    def emit(self, event: str, **fields: Any) -> None:
        """Append an event to the slot's event log."""
        ...

    def restart_from_scratch(self, cause: str, *, resume_mode: str) -> None:
        """Kill the main, reallocate memory, reload weights, start a new main; blocks until it serves."""
        ...


@attrs.define(eq=False)
class ConventionalRecovery:
    """Probes the main worker remotely and has it restarted from scratch after enough misses."""

    restarter: Restarter
    health_interval_s: float
    health_misses: int
    num_misses: int = 0
    next_probe: float = attrs.field(factory=time.monotonic)
    _http: httpx.Client = attrs.field(factory=lambda: httpx.Client(timeout=1.0))

    def poll(self) -> None:
        """Called by the supervisor's monitor thread; probes when a probe is due."""
        now = time.monotonic()
        if now < self.next_probe:
            return
        self.next_probe = now + self.health_interval_s
        url = self.restarter.main_url
        if url is not None and self._probe(url):
            self.num_misses = 0
            return
        self.num_misses += 1
        self.restarter.emit("conventional.miss", num_misses=self.num_misses, url=url)
        if self.num_misses >= self.health_misses:
            self.num_misses = 0
            self.restarter.emit(
                "conventional.detect",
                health_interval_s=self.health_interval_s,
                health_misses=self.health_misses,
            )
            self.restarter.restart_from_scratch("conventional", resume_mode="regenerate")
            self.next_probe = time.monotonic() + self.health_interval_s

    def _probe(self, url: str) -> bool:
        try:
            return self._http.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def close(self) -> None:
        """Close the probe's connections."""
        self._http.close()
