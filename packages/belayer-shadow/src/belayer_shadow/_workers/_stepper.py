"""`Stepper`: the thread that owns an `EngineService`'s engine and steps it back to back.

The event loop only queues additions and aborts (`add`, `abort`: thread-safe, never blocking);
the stepping thread applies them between steps, steps while the engine has work, and hands every
step's outputs to the event loop without waiting for it (`loop.call_soon_threadsafe`), so the
next step starts as soon as the last one returns. (Before, every step went step thread -> event
loop -> step thread: two thread wake-ups per step on the critical path, measured in session 5 at
~10% of the wall clock at 28M on a loaded 2-core machine, more at 1M where steps take a few ms.)

Each output is tagged with the submission (`_Job`) the engine was serving under its request id,
so tokens of an aborted job that a step in flight still produced never reach a job resubmitted
under the same id: the old job is marked finished by the event loop at the abort and its tokens
are dropped; the engine drops the old job (between steps) before it takes the new one.

A delivery that fails (a bug in the event loop's handler) is logged and the rest of the batch is
still delivered: a stranded delivery would stall other clients' streams once the engine idles.
`stop` waits for the step in progress at most `stop_timeout_s`: a hung `engine.step()` (a CUDA/NCCL
hang) is logged and left behind in the daemon thread, so the process can still exit.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from belayer_shadow._engine._sequence import StepOutput
from belayer_shadow._errors import RequestError, WorkerError
from belayer_shadow._workers._events import EventLog
from belayer_shadow._workers._heartbeat import Heartbeat

if TYPE_CHECKING:
    from belayer_shadow._workers._service import Engine, _Job

__all__ = ["Delivery", "Stepper"]

_log = logging.getLogger(__name__)


@attrs.frozen
class Delivery:
    """What one stepping-thread iteration hands to the event loop: the requests the engine refused
    (job, reason), then the step's outputs, each with the job it belongs to."""

    rejected: list[tuple[_Job, str]]
    outputs: list[tuple[_Job, StepOutput]]


@attrs.define(eq=False)
class Stepper:
    """The stepping thread of one engine (`start` it from the event loop, `stop` it from any thread)."""

    engine: Engine
    heartbeat: Heartbeat
    log: EventLog
    idle_tick_s: float
    weight_refresh_s: float
    stop_timeout_s: float = 10.0  # how long `stop` waits for the step in progress
    num_steps: int = 0
    step_s: float = 0.0  # wall seconds inside engine.step()
    gap_s: float = 0.0  # wall seconds between back-to-back steps (queue, bookkeeping, hand-off)
    error: BaseException | None = None  # what ended the thread, if anything did
    _ops: list[tuple[bool, _Job]] = attrs.field(factory=list)  # (add?, job), in arrival order
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _kick: threading.Event = attrs.field(factory=threading.Event)
    _stopping: bool = False
    _running: dict[str, _Job] = attrs.field(factory=dict)  # the job the engine serves per request id
    _deliveries: collections.deque[Delivery] = attrs.field(factory=collections.deque)
    _delivery_posted: bool = False
    _loop_ticks: int = 0
    _last_refresh: float = 0.0
    _thread: threading.Thread | None = None
    _deliver: Callable[[Delivery], None] | None = None
    _post: Callable[[Callable[[], None]], object] | None = None

    # Event-loop side.

    def add(self, job: _Job) -> None:
        """Queue `job` for the engine (applied before the next step)."""
        with self._lock:
            self._ops.append((True, job))
        self._kick.set()

    def abort(self, job: _Job) -> None:
        """Queue the abort of `job` (the engine drops it before the next step; mark it finished first)."""
        with self._lock:
            self._ops.append((False, job))
        self._kick.set()

    def tick(self) -> None:
        """The event loop ran: the next heartbeat touch may go out (it proves both threads alive)."""
        self._loop_ticks += 1

    def start(self, deliver: Callable[[Delivery], None]) -> None:
        """Start stepping; `deliver` runs on this (asyncio) event loop for every non-empty iteration."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise WorkerError(
                "EngineService.run_loop needs anyio's asyncio backend (the workers serve through uvicorn)"
            ) from None
        if self.in_step:
            raise WorkerError(
                "the previous stepping thread is still inside engine.step(); this engine cannot be "
                "stepped again: restart the worker"
            )
        self._stopping = False
        self.error = None
        self._deliver, self._post = deliver, loop.call_soon_threadsafe
        self._thread = threading.Thread(target=self._run, name="belayer-step", daemon=True)
        self._thread.start()

    @property
    def in_step(self) -> bool:
        """Whether the stepping thread still runs (after `stop`: a step that did not return)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop stepping and wait for the thread (the step in progress), at most `stop_timeout_s`.
        Blocking. A step still running then is logged and left to the daemon thread (`in_step`
        stays True); the engine must not be used again, and the process may exit."""
        self._stopping = True
        self._kick.set()
        if self._thread is None:
            return
        self._thread.join(self.stop_timeout_s)
        if self._thread.is_alive():
            _log.error(
                "engine.step() did not return within %.1f s of the stop; the stepping thread is "
                "left behind (a daemon: it does not keep the process alive)",
                self.stop_timeout_s,
            )
            self.log.emit("stepper.stop_timed_out", timeout_s=self.stop_timeout_s)

    def _drain(self) -> None:  # on the event loop
        self._delivery_posted = False  # first: an iteration appending from now on posts again
        self.tick()
        assert self._deliver is not None
        while self._deliveries:
            delivery = self._deliveries.popleft()
            try:
                self._deliver(delivery)
            except Exception:  # one failed delivery must not strand the ones behind it
                _log.exception("delivering a step's outputs failed; the next deliveries go on")

    # Stepping thread.

    def _run(self) -> None:
        try:
            self._step_forever()
        except BaseException as exc:  # the event loop re-raises it (EngineService.run_loop)
            self.error = exc

    def _step_forever(self) -> None:
        seen_ticks = -1
        last_end: float | None = None
        while not self._stopping:
            if seen_ticks != self._loop_ticks:
                seen_ticks = self._loop_ticks
                self.heartbeat.touch()
            with self._lock:
                ops, self._ops = self._ops, []
            if not self.engine.has_unfinished() and (
                any(add for add, _ in ops) or time.monotonic() - self._last_refresh > self.weight_refresh_s
            ):
                self._refresh_weights()  # new weights take effect before the next batch starts
            rejected = self._apply(ops)
            if not self.engine.has_unfinished():
                if rejected:
                    self._hand_off(Delivery(rejected, []))
                last_end = None
                self._kick.wait(self.idle_tick_s)
                self._kick.clear()  # ops queued before this are taken at the top of the loop
                continue
            start = time.perf_counter()
            if last_end is not None:
                self.gap_s += start - last_end
            outputs = self.engine.step()
            last_end = time.perf_counter()
            self.step_s += last_end - start
            self.num_steps += 1
            tagged: list[tuple[_Job, StepOutput]] = []
            for out in outputs:
                job = self._running.get(out.request_id)
                if job is None:
                    continue
                tagged.append((job, out))
                if out.finish_reason is not None:
                    del self._running[out.request_id]
            if tagged or rejected:
                self._hand_off(Delivery(rejected, tagged))

    def _refresh_weights(self) -> None:
        self._last_refresh = time.monotonic()
        if self.engine.refresh_weights():
            self.log.emit("weights.refreshed")

    def _apply(self, ops: list[tuple[bool, _Job]]) -> list[tuple[_Job, str]]:
        rejected: list[tuple[_Job, str]] = []
        for add, job in ops:
            if not add:
                if self._running.get(job.request_id) is job:
                    del self._running[job.request_id]
                    self.engine.abort(job.request_id)
                continue
            if job.finished:  # aborted before it started (its abort follows in `ops` or came before)
                continue
            try:
                self.engine.add_request(job.request_id, job.prompt, job.params)
            except RequestError as exc:
                rejected.append((job, str(exc)))
                continue
            self._running[job.request_id] = job
        return rejected

    def _hand_off(self, delivery: Delivery) -> None:
        self._deliveries.append(delivery)
        if not self._delivery_posted:
            self._delivery_posted = True
            assert self._post is not None
            self._post(self._drain)
