"""Injected rollout-worker failures: at given steps (mid-rollout), at given times, or at a rate.

A kill is a SIGKILL of a slot's main worker (`SlotSupervisor.kill_main`); the recovery is whatever
the slot does about it (the shadow takes over, or a conventional restart). Each failure is kept
as a `FailureRecord`, completed with its recovery time once the slot reports the handover.
Sandbox kills of the agentic workload are a probability passed to the agent loop
(``chaos.sandbox_kill_p``), not scheduled here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs

from belayer_grpo._config import ChaosConfig

__all__ = ["FailureRecord", "WorkerChaos", "match_recoveries"]


@attrs.define
class FailureRecord:
    """One injected worker failure and, once known, its recovery."""

    slot: str
    step: int
    killed_at: float  # wall-clock seconds (time.time())
    trigger: str  # "step", "time" or "rate"
    recovered_at: float | None = None
    recovery: str | None = None  # "shadow" / "restart" / "conventional"
    # A kill aimed at a slot with responses in flight (the agentic rollouts'): how many it had,
    # and how many interrupted streams the router resumed from the kill to the step's end.
    requests_in_flight: int | None = None
    requests_resumed: int | None = None

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the kill to the replacement serving, when recovered."""
        return None if self.recovered_at is None else self.recovered_at - self.killed_at

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the metrics file and the report."""
        return {**attrs.asdict(self), "recovery_s": self.recovery_s}


KillFunction = Callable[[int], tuple[str, float]]  # slot index -> (slot name, kill time)


@attrs.define
class WorkerChaos:
    """Decides when to kill a worker; ``kill`` does it (slot index -> (slot name, time))."""

    config: ChaosConfig
    kill: KillFunction
    num_slots: int
    failures: list[FailureRecord] = attrs.field(factory=list)
    names: Sequence[str] = ()  # the slots' names, by index (`index_of`)
    current_step: int = 0
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.config.seed)

    def wants_kill_at_step(self, step: int) -> bool:
        """Whether a worker is to be killed during the rollout of ``step``."""
        return step in self.config.kill_worker_at_steps

    def kill_now(self, trigger: str, slot_index: int | None = None) -> FailureRecord:
        """Kill the main worker of slot ``slot_index`` (default: a randomly chosen one; blocking,
        call from a thread)."""
        if slot_index is None:
            slot_index = self._rng.randrange(self.num_slots)
        slot, killed_at = self.kill(slot_index)
        record = FailureRecord(slot=slot, step=self.current_step, killed_at=killed_at, trigger=trigger)
        self.failures.append(record)
        return record

    def index_of(self, slot: str) -> int | None:
        """The index of the slot named ``slot``; None when unknown (`kill_now` then picks one)."""
        return list(self.names).index(slot) if slot in self.names else None

    def timed_kills(self, started_at: float, horizon_s: float) -> list[float]:
        """Offsets (seconds after ``started_at``) of the time- and rate-triggered kills up to ``horizon_s``."""
        offsets = list(self.config.kill_worker_at_s)
        rate = self.config.kill_worker_rate_per_min / 60.0
        if rate > 0:
            t = 0.0
            while True:
                t += self._rng.expovariate(rate)
                if t > horizon_s:
                    break
                offsets.append(t)
        return sorted(offsets)

    async def run_timed(self, started_at: float, horizon_s: float = 24 * 3600.0) -> None:
        """Background task: kill at the configured times and rate until cancelled."""
        fixed = set(self.config.kill_worker_at_s)
        for offset in self.timed_kills(started_at, horizon_s):
            await anyio.sleep(max(0.0, started_at + offset - time.time()))
            trigger = "time" if offset in fixed else "rate"
            await anyio.to_thread.run_sync(self.kill_now, trigger)


def match_recoveries(failures: Sequence[FailureRecord], events: Sequence[dict[str, Any]]) -> None:
    """Fill in each failure's recovery from the slots' event logs (``handover.complete`` and the
    restart baselines' ``restart.restart`` / ``conventional.restart``), first match after the kill."""
    used: set[int] = set()
    for failure in failures:
        if failure.recovered_at is not None:
            continue
        for index, event in enumerate(events):
            name = str(event.get("event", ""))
            if index in used or event.get("slot") != failure.slot:
                continue
            if float(event.get("time", 0.0)) < failure.killed_at:
                continue
            if name == "handover.complete":
                failure.recovery = "shadow"
            elif name in ("restart.restart", "conventional.restart"):
                failure.recovery = name.partition(".")[0]
            else:
                continue
            failure.recovered_at = float(event["time"])
            used.add(index)
            break
