"""Conventional recovery, the baseline the shadow worker is measured against, behind the same supervisor.

Detection by remote health checks (`GET /health` every `health_interval_s`; failed after
`health_misses` misses in a row; defaults like common trainers, 10 s x 3). Recovery from scratch:
kill what is left of the worker, release and allocate the memory again, reload the weights from
the checkpoint file, start a new worker (which warms up and registers at epoch + 1), and
regenerate interrupted requests from the start (the worker's `regenerate` resume mode hides the
tokens the client already has, but computes them again).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import attrs
import httpx

if TYPE_CHECKING:
    from belayer_shadow._slot import SlotSupervisor

__all__ = ["ConventionalRecovery"]


@attrs.define(eq=False)
class ConventionalRecovery:
    """Probes the main worker remotely and restarts it from scratch after enough misses."""

    supervisor: SlotSupervisor
    num_misses: int = 0
    next_probe: float = attrs.field(factory=time.monotonic)
    _http: httpx.Client = attrs.field(factory=lambda: httpx.Client(timeout=1.0))

    def poll(self) -> None:
        """Called by the supervisor's monitor thread; probes when a probe is due."""
        config = self.supervisor.config
        now = time.monotonic()
        if now < self.next_probe:
            return
        self.next_probe = now + config.health_interval_s
        url = self.supervisor.main_url
        if url is not None and self._probe(url):
            self.num_misses = 0
            return
        self.num_misses += 1
        self.supervisor.log.emit("conventional.miss", num_misses=self.num_misses, url=url)
        if self.num_misses >= config.health_misses:
            self.num_misses = 0
            self.restart()

    def _probe(self, url: str) -> bool:
        try:
            return self._http.get(f"{url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def restart(self) -> None:
        """Recover from scratch: new memory (weights reloaded from the file), new worker, warm-up."""
        supervisor = self.supervisor
        config = supervisor.config
        log = supervisor.log
        log.emit(
            "conventional.detect",
            health_interval_s=config.health_interval_s,
            health_misses=config.health_misses,
        )
        if supervisor.second_failure():
            return
        supervisor.last_handover = time.monotonic()
        with log.step("conventional.restart"):
            with supervisor._lock:
                residual = supervisor.main
                if residual is not None and residual.alive():
                    residual.kill()
                    log.emit("residual.killed", pid=residual.pid)
                with log.step("conventional.reallocate"):
                    supervisor.stop_memory_servers()
                    supervisor.start_memory_servers()
            main = supervisor.spawn_main(resume_mode="regenerate")
            main.wait_state({"serving"}, config.start_timeout_s)
        supervisor.num_handovers += 1
        self.next_probe = time.monotonic() + config.health_interval_s

    def close(self) -> None:
        """Close the probe's connections."""
        self._http.close()
