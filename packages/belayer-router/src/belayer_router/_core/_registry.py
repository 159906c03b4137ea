"""Engine slots, worker epochs (fencing), slot health, weight versions and least-outstanding routing.

Pure bookkeeping on the event loop: no I/O.  A worker is *retired* the moment a newer epoch
registers for its slot, it is unregistered, or its slot is marked unhealthy; retiring cancels
every stream the router is reading from it, so nothing it sends afterwards reaches a client.

The weight-version gate: once a version is required (`Registry.require_version`), a slot whose
committed version (`Registry.set_slot_version`) is another one is *held out*: its worker's
streams are cut like a retired worker's (the requests resume elsewhere), and it gets no request
until it reports the required version; then it is back in rotation, same worker, same epoch.

Pausing (the control plane's ``/pause``): while `paused`, no worker is picked and the waits for
one do not run out (a paused router holds requests, it does not fail them); modes ``keep`` and
``abort`` also cut every running stream at once (counted in the worker's ``num_pause_cuts``, not as
its failure); ``wait`` lets them finish.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import attrs

from belayer_router._errors import (
    InvalidRequestError,
    NotFoundError,
    StaleEpochError,
    WeightVersionError,
)

__all__ = ["Registry", "Slot", "Worker"]


@attrs.define(eq=False)
class Worker:
    """One registered worker: the process serving a slot at one epoch."""

    slot: str
    url: str
    epoch: int
    retired: bool = False
    held_out: bool = False  # its slot's weight version is not the required one (for now)
    num_version_cuts: int = 0  # times its streams were cut for that
    num_pause_cuts: int = 0  # times its streams were cut by a pause (keep / abort)
    link: bool = False  # it serves the multiplexed link (``POST /link``) beside ``POST /generate``
    scopes: set[anyio.CancelScope] = attrs.field(factory=set, repr=False)
    links: set[anyio.CancelScope] = attrs.field(factory=set, repr=False)  # its open link's task

    @property
    def key(self) -> tuple[str, int]:
        """``(slot, epoch)``: identifies this worker for exclusion after a failure."""
        return (self.slot, self.epoch)


@attrs.define
class Slot:
    """An engine slot: at most one active worker, the highest epoch ever seen, its health."""

    name: str
    max_epoch: int = -1
    worker: Worker | None = None
    healthy: bool = True
    num_outstanding: int = 0
    num_assigned: int = 0
    weight_version: int | None = None  # the committed weight version it last reported
    num_stream_failures: int = 0  # its workers' streams that broke (worker side), every epoch
    last_stream_failure_at: float | None = None  # ``time.time()`` of the last one
    unhealthy_since: float | None = None  # ``time.time()`` it was marked unhealthy
    vacant_since: float | None = None  # ``time.time()`` its worker was unregistered (none since)


def _check_version(version: int) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise InvalidRequestError(f"a weight version must be a non-negative integer, got {version!r}")


_SLOT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def _check_slot_name(slot: str) -> str:
    if not isinstance(slot, str) or not _SLOT_NAME.fullmatch(slot):
        raise InvalidRequestError(f"slot name must match [A-Za-z0-9_.:-]{{1,128}}, got {slot!r}")
    return slot


@attrs.define
class Registry:
    """All slots of one router; methods are called from the router's event loop only."""

    slots: dict[str, Slot] = attrs.field(factory=dict)
    num_handovers: int = 0
    required_version: int | None = None  # None: no gate, every healthy slot serves
    paused: str | None = None  # the pause mode ("wait", "keep", "abort") while paused
    _changed: anyio.Event | None = attrs.field(default=None, alias="_changed")

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _retire(self, worker: Worker) -> None:
        worker.retired = True
        for scope in (*worker.scopes, *worker.links):
            scope.cancel()

    def _behind(self, state: Slot) -> bool:
        return self.required_version is not None and state.weight_version != self.required_version

    def _gate(self, state: Slot) -> None:
        """Hold the slot's worker out (cutting its streams) or bring it back, per its version."""
        worker = state.worker
        if worker is None:
            return
        worker.held_out = self._behind(state)
        if worker.held_out and worker.scopes:
            worker.num_version_cuts += 1
            for scope in worker.scopes:
                scope.cancel()

    def set_slot_version(self, slot: str, version: int) -> None:
        """Record the weight version the slot has committed (and serves new requests with).

        Reporting the same version again is a no-op.  Raise `NotFoundError` for an unknown slot
        and `WeightVersionError` for a version below the one it reported before.
        """
        state = self._slot(slot)
        _check_version(version)
        if state.weight_version is not None and version < state.weight_version:
            raise WeightVersionError(
                f"slot {slot!r} has reported weight version {state.weight_version}; a slot's version "
                f"only moves forward (got {version}); register a restarted engine on a new slot"
            )
        state.weight_version = version
        self._gate(state)
        self._notify()

    def require_version(self, version: int) -> None:
        """Serve only from slots whose committed version is ``version`` (the step's version).

        Slots with another version are held out at once, streams included, until they report
        it.  Requiring the same version again is a no-op; a lower one raises `WeightVersionError`.
        """
        _check_version(version)
        if self.required_version is not None and version < self.required_version:
            raise WeightVersionError(
                f"the router already requires weight version {self.required_version}; the required "
                f"version only moves forward (got {version})"
            )
        self.required_version = version
        for state in self.slots.values():
            self._gate(state)
        self._notify()

    def pause(self, mode: str) -> None:
        """Start no request from now on; ``keep`` / ``abort`` also cut every running stream now."""
        self.paused = mode
        if mode != "wait":
            for state in self.slots.values():
                worker = state.worker
                if worker is not None and worker.scopes:
                    worker.num_pause_cuts += 1
                    for scope in worker.scopes:
                        scope.cancel()
        self._notify()

    def resume(self) -> None:
        """Serve again: held requests are picked up (their waits start over)."""
        self.paused = None
        self._notify()

    def num_running(self) -> int:
        """Streams running on workers now, over every slot."""
        return sum(state.num_outstanding for state in self.slots.values())

    async def wait_idle(self) -> None:
        """Return once no stream runs on any worker."""
        while self.num_running():
            await self._wait_change(anyio.current_time() + 0.05)

    def register(self, slot: str, url: str, epoch: int, link: bool = False) -> Worker:
        """Make ``url`` the slot's worker at ``epoch``; a lower-epoch worker is retired.

        ``link``: the worker serves the multiplexed link; the router then runs its requests on one
        persistent connection (else one ``POST /generate`` per request).

        Re-registering the same ``(slot, url, epoch)`` is a no-op.  Raise `StaleEpochError` for an
        epoch at or below the slot's highest one, and for an unhealthy slot.
        """
        state = self.slots.get(_check_slot_name(slot))
        if state is None:
            state = self.slots[slot] = Slot(slot)
        current = state.worker
        if current is not None and current.epoch == epoch and current.url == url:
            current.link = link
            return current
        if not state.healthy:
            raise StaleEpochError(f"slot {slot!r} is marked unhealthy; register the worker on a new slot")
        if epoch <= state.max_epoch:
            raise StaleEpochError(
                f"slot {slot!r} has already seen epoch {state.max_epoch}; register with epoch "
                f">= {state.max_epoch + 1} (got {epoch})"
            )
        if current is not None:
            self._retire(current)
            self.num_handovers += 1
        state.worker = Worker(slot, url, epoch, link=link)
        state.max_epoch = epoch
        state.vacant_since = None
        self._gate(state)
        self._notify()
        return state.worker

    def unregister(self, slot: str, epoch: int) -> None:
        """Remove the slot's worker of ``epoch``; older epochs are refused, repeats are no-ops."""
        state = self._slot(slot)
        if epoch < state.max_epoch:
            raise StaleEpochError(f"slot {slot!r} is at epoch {state.max_epoch}; epoch {epoch} is stale")
        if epoch > state.max_epoch:
            raise NotFoundError(f"slot {slot!r} has no worker of epoch {epoch} (latest {state.max_epoch})")
        if state.worker is not None:
            self._retire(state.worker)
            state.worker = None
            state.vacant_since = time.time()
            self._notify()

    def mark_unhealthy(self, slot: str) -> None:
        """Take the slot out of service for good: its worker is retired and its requests move."""
        state = self._slot(slot)
        if state.healthy:
            state.unhealthy_since = time.time()
        state.healthy = False
        if state.worker is not None:
            self._retire(state.worker)
            state.worker = None
        self._notify()

    def _slot(self, slot: str) -> Slot:
        state = self.slots.get(slot)
        if state is None:
            raise NotFoundError(f"unknown slot {slot!r}; GET /workers lists the slots")
        return state

    def is_current(self, worker: Worker) -> bool:
        """Whether ``worker`` is still its slot's active worker (the fencing check)."""
        return not worker.retired

    def slot_available(self, slot: str) -> bool:
        """Whether the slot is healthy (it may be waiting for a replacement worker)."""
        state = self.slots.get(slot)
        return state is not None and state.healthy

    def pick(self, exclude: frozenset[tuple[str, int]] = frozenset()) -> Worker | None:
        """The active worker of the healthy slot with the fewest outstanding requests (none while
        paused)."""
        if self.paused is not None:
            return None
        best: Slot | None = None
        for state in self.slots.values():
            worker = state.worker
            if worker is None or not state.healthy or worker.held_out or worker.key in exclude:
                continue
            if best is None or (state.num_outstanding, state.num_assigned) < (
                best.num_outstanding,
                best.num_assigned,
            ):
                best = state
        return None if best is None else best.worker

    async def _wait_change(self, deadline: float) -> bool:
        remaining = deadline - anyio.current_time()
        if remaining <= 0:
            return False
        if self._changed is None:
            self._changed = anyio.Event()
        with anyio.move_on_after(remaining):
            await self._changed.wait()
            return True
        return False

    async def wait_for_replacement(self, slot: str, after_epoch: int, max_wait: float) -> Worker | None:
        """Wait up to ``max_wait`` s for ``slot`` to get a worker newer than ``after_epoch``.

        Return None at once when the slot is unhealthy, or when the wait runs out; a replacement
        that is held out (weight version) is waited for until it is current.
        """
        deadline = anyio.current_time() + max_wait
        while True:
            state = self.slots.get(slot)
            if state is None or not state.healthy:
                return None
            worker = state.worker
            if self.paused is not None:
                await self._wait_change(float("inf"))  # held while paused: the wait starts over after
                deadline = anyio.current_time() + max_wait
                continue
            if worker is not None and worker.epoch > after_epoch and not worker.held_out:
                return worker
            if not await self._wait_change(deadline):
                return None

    async def wait_for_any(self, exclude: frozenset[tuple[str, int]], max_wait: float) -> Worker | None:
        """Like `pick`, waiting up to ``max_wait`` s for a worker to register if none is usable."""
        deadline = anyio.current_time() + max_wait
        while True:
            if self.paused is not None:
                await self._wait_change(float("inf"))  # held while paused: the wait starts over after
                deadline = anyio.current_time() + max_wait
                continue
            worker = self.pick(exclude)
            if worker is not None or not await self._wait_change(deadline):
                return worker

    @contextmanager
    def attempt(self, worker: Worker) -> Iterator[anyio.CancelScope]:
        """Count one outstanding stream on ``worker``; the scope is cancelled if it is retired."""
        state = self.slots[worker.slot]
        scope = anyio.CancelScope()
        if worker.retired or worker.held_out:
            scope.cancel()
        worker.scopes.add(scope)
        state.num_outstanding += 1
        state.num_assigned += 1
        try:
            yield scope
        finally:
            worker.scopes.discard(scope)
            state.num_outstanding -= 1

    def stream_failed(self, worker: Worker) -> None:
        """Count a stream of ``worker`` that broke on the worker's side, on its slot.

        A stream the router cut itself (``worker`` retired or held out) is not counted; the count
        is the slot's, so it survives the slot's re-registrations.
        """
        state = self.slots.get(worker.slot)
        if state is None or worker.retired or worker.held_out:
            return
        state.num_stream_failures += 1
        state.last_stream_failure_at = time.time()

    def unavailable_reason(self) -> str:
        """Why no worker can take a request now, slot by slot (for the 503 a client gets)."""
        if not self.slots:
            return "no slot has registered a worker (POST /workers/register)"
        now = time.time()
        reasons = []
        for state in self.slots.values():
            name = f"slot {state.name!r}"
            if not state.healthy:
                since = _since(state.unhealthy_since, now)
                reasons.append(f"{name} is unhealthy since {since} (its GPU failed; it is not restarted)")
            elif state.worker is None:
                since = _since(state.vacant_since, now)
                reasons.append(f"{name} is restarting: no worker since {since}")
            elif state.worker.held_out:
                reasons.append(
                    f"{name} is held out: weight version {state.weight_version}, required "
                    f"{self.required_version}"
                )
            elif state.last_stream_failure_at is not None:
                since = _since(state.last_stream_failure_at, now)
                reasons.append(f"{name} is recovering: its worker's stream broke at {since}")
            else:
                reasons.append(f"{name} has a worker (epoch {state.worker.epoch}) that this request tried")
        return "; ".join(reasons)

    def snapshot(self) -> list[dict[str, Any]]:
        """The slots as JSON-ready dicts, for ``GET /workers``."""
        return [
            {
                "slot": s.name,
                "url": None if s.worker is None else s.worker.url,
                "epoch": None if s.worker is None else s.worker.epoch,
                "link": s.worker is not None and s.worker.link,
                "max_epoch": s.max_epoch,
                "healthy": s.healthy,
                "num_outstanding": s.num_outstanding,
                "weight_version": s.weight_version,
                "current": not self._behind(s),
                "num_stream_failures": s.num_stream_failures,
                "last_stream_failure_at": s.last_stream_failure_at,
                "unhealthy_since": s.unhealthy_since,
                "vacant_since": s.vacant_since,
            }
            for s in self.slots.values()
        ]


def _since(at: float | None, now: float) -> str:
    """``at`` as UTC ISO 8601 with its age, e.g. ``2026-12-04T22:50:01Z (3.2 s ago)``."""
    if at is None:
        return "the router started"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f"{stamp} ({max(0.0, now - at):.1f} s ago)"
