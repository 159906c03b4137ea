"""The resume loop: stream a request from a worker and, when the stream breaks, continue it.

On a break (connection error, malformed event, stale epoch, retired worker) the request waits up
to ``resume_wait_s`` seconds for its slot's replacement and resumes there with prompt + every
token generated so far; if the slot is unhealthy or the wait runs out, it goes to the healthy
slot with the fewest outstanding requests.  A stream cut because its slot is held out (weight
version) resumes at once on a current slot, waiting up to ``resume_wait_s`` for one; one cut by a
pause (``keep``) waits for the resume, then resumes the same way (``abort``: it ends there,
``finish_reason`` ``"abort"``).  Tokens reach the client through ``emit``, which is
synchronous, so fencing check, journal append and emit happen with no await in between.

Two transports reach a worker (`_worker`): its multiplexed link when it registered with one, else
one ``POST /generate`` per attempt (NDJSON).
"""

from __future__ import annotations

import secrets
from collections.abc import Coroutine, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
import attrs
import httpx
import orjson

from belayer_router._core._emit import Emit
from belayer_router._core._journal import Journal, RequestRecord
from belayer_router._core._metrics import Metrics
from belayer_router._core._registry import Registry, Worker
from belayer_router._core._tokenizer import Tokenizer
from belayer_router._errors import NoHealthyWorkerError, WorkerStreamError
from belayer_router._wire._protocol import (
    MAX_FRAME_BYTES,
    FinishEvent,
    TokenEvent,
    WorkerFinish,
    WorkerTokens,
    parse_worker_event,
    worker_request_body,
)
from belayer_router._worker._link import Entry, LinkAttempt, LinkPool, Stop
from belayer_router._worker._stream import stream_lines

__all__ = ["Dispatcher", "new_seed"]

_T = TypeVar("_T")


def new_seed() -> int:
    """A seed for a request that came without one, so that a resume stays deterministic."""
    return secrets.randbits(63)


@attrs.define
class Dispatcher:
    """Runs requests against the registry's workers, journaling and resuming them."""

    registry: Registry
    journal: Journal
    metrics: Metrics
    client: httpx.AsyncClient
    resume_wait_s: float = 5.0
    tokenizer: Tokenizer | None = None
    max_attempts: int = 32
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0
    max_sessions: int = 100_000
    sessions: dict[str, str] = attrs.field(factory=dict)  # X-Session-ID -> slot, oldest first
    links: LinkPool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.links = LinkPool(self._check_frame, self._apply_step, self._stale)

    def _stale(self) -> None:
        self.metrics.num_stale_events += 1

    async def run(self, record: RequestRecord, emit: Emit, num_received: int = 0) -> None:
        """Drive ``record`` to completion, emitting every token with index >= ``num_received``."""
        for index in range(num_received, len(record.token_ids)):
            emit(TokenEvent(index, record.token_ids[index], record.logprobs[index]))
        self.metrics.num_tokens += max(0, len(record.token_ids) - num_received)
        try:
            if record.finish_reason is None:
                await self._generate(record, emit, num_received)
            else:
                record.in_flight = False
        finally:
            if record.in_flight:
                self.journal.release(record)
        emit(
            FinishEvent(
                request_id=record.request_id,
                finish_reason=record.finish_reason or "length",
                num_prompt_tokens=len(record.request.prompt_token_ids),
                num_generated_tokens=len(record.token_ids),
                num_resumes=record.num_resumes,
            )
        )

    def _natural_finish(self, record: RequestRecord) -> str | None:
        request = record.request
        if record.token_ids and record.token_ids[-1] in request.stop_token_ids:
            return "stop"
        if len(record.token_ids) >= request.max_tokens:
            return "length"
        return None

    async def _first_worker(self, record: RequestRecord) -> Worker | None:
        """The session's slot while it is healthy (waiting for its replacement after a
        handover), else the least loaded; a session moves only when its slot is out."""
        session = record.session_id
        slot = None if session is None else self.sessions.get(session)
        worker = None
        if slot is not None and self.registry.slot_available(slot):
            worker = await self._wait(self.registry.wait_for_replacement(slot, -1, self.resume_wait_s))
        if worker is None:
            worker = await self._wait(self.registry.wait_for_any(frozenset(), self.resume_wait_s))
        return worker

    def _remember(self, record: RequestRecord, worker: Worker) -> None:
        session = record.session_id
        if session is None:
            return
        self.sessions.pop(session, None)
        self.sessions[session] = worker.slot  # most recent last: the oldest goes first
        while len(self.sessions) > self.max_sessions:
            del self.sessions[next(iter(self.sessions))]

    async def _generate(self, record: RequestRecord, emit: Emit, num_received: int) -> None:
        excluded: set[tuple[str, int]] = set()
        worker = await self._first_worker(record)
        for _ in range(self.max_attempts):
            if worker is None:
                break
            self._remember(record, worker)
            reason = self._natural_finish(record)
            if reason is None:
                cuts, pauses = worker.num_version_cuts, worker.num_pause_cuts
                try:
                    reason = await self._attempt(worker, record, emit, num_received)
                except WorkerStreamError:
                    if worker.num_pause_cuts != pauses and self.registry.paused == "abort":
                        self.journal.finish(record, "abort")  # /pause?mode=abort: ends as it is
                        return
                    record.num_resumes += 1
                    self.metrics.num_resumes += 1
                    if worker.num_pause_cuts != pauses and not worker.retired:  # held by a pause
                        self.metrics.num_pause_resumes += 1
                        worker = await self._wait(
                            self.registry.wait_for_any(frozenset(excluded), self.resume_wait_s)
                        )
                        continue
                    held_out = worker.held_out or worker.num_version_cuts != cuts
                    if held_out and not worker.retired:  # not the worker's fault: its version
                        self.metrics.num_version_resumes += 1
                        worker = await self._wait(
                            self.registry.wait_for_any(frozenset(excluded), self.resume_wait_s)
                        )
                        continue
                    excluded.add(worker.key)
                    worker = await self._next_worker(worker, frozenset(excluded))
                    continue
            self.journal.finish(record, reason)
            return
        raise NoHealthyWorkerError(
            f"request {record.request_id!r}: no healthy worker within {self.resume_wait_s:g} s "
            f"after {record.num_resumes} resumes ({self.registry.unavailable_reason()}); retry "
            "with the same request_id to resume from the tokens already streamed",
            retry_after_s=self.resume_wait_s,
        )

    async def _next_worker(self, failed: Worker, excluded: frozenset[tuple[str, int]]) -> Worker | None:
        replacement = await self._wait(
            self.registry.wait_for_replacement(failed.slot, failed.epoch, self.resume_wait_s)
        )
        if replacement is not None:
            return replacement
        return await self._wait(self.registry.wait_for_any(excluded, self.resume_wait_s))

    async def _wait(self, waiting: Coroutine[Any, Any, _T]) -> _T:
        self.metrics.num_waiting += 1
        try:
            return await waiting
        finally:
            self.metrics.num_waiting -= 1

    async def _attempt(self, worker: Worker, record: RequestRecord, emit: Emit, num_received: int) -> str:
        body = worker_request_body(
            record.request, record.request_id, record.seed, record.token_ids, worker.epoch
        )
        finish: str | None = None
        with self.registry.attempt(worker) as scope, scope:
            try:
                if worker.link and self.links.group is not None and worker.url.startswith("http://"):
                    finish = await self._linked(worker, orjson.dumps(body), record, emit, num_received)
                else:
                    finish = await self._stream(worker, body, record, emit, num_received)
            except (httpx.HTTPError, OSError, anyio.BrokenResourceError) as error:
                self.registry.stream_failed(worker)
                raise WorkerStreamError(f"stream from {worker.url} broke: {error!r}") from error
            except WorkerStreamError:
                self.registry.stream_failed(worker)  # not counted if the router cut it (retired/held out)
                raise
        if scope.cancelled_caught or finish is None:
            why = "held out (weight version)" if worker.held_out and not worker.retired else "retired"
            why = "paused" if self.registry.paused is not None and not worker.retired else why
            raise WorkerStreamError(f"worker {worker.url} (slot {worker.slot}) was {why} mid-stream")
        return finish

    async def _linked(
        self, worker: Worker, body: bytes, record: RequestRecord, emit: Emit, num_received: int
    ) -> str | None:
        """Run the attempt as one request on the worker's link; the link's reader feeds it."""
        link = await self.links.get(worker, self.connect_timeout_s, self.read_timeout_s)
        attempt = link.submit(body, record, emit, num_received)
        try:
            await attempt.done.wait()
        finally:
            link.abort(attempt)  # a no-op once it finished; else the worker stops generating it
        if attempt.error is not None:
            raise attempt.error
        return attempt.finish

    def _apply_step(self, worker: Worker, live: list[Entry], stop: Stop) -> None:
        """Journal and emit a checked link frame's entries (synchronously, from the link's reader);
        an attempt a stop string ended goes to ``stop`` at once.  The common entry (no stop strings,
        nothing regenerated) costs one journal extend and one ``frame`` call; the token counter
        moves once per frame (also when an entry fails half-way through the frame)."""
        extend = self.journal.extend
        num_tokens = 0
        try:
            for attempt, first, token_ids, logprobs in live:
                record = attempt.record
                if record.request.stop or first < attempt.num_received:  # the general path
                    reason = self._apply_link(worker, attempt, first, token_ids, logprobs)
                    if reason is not None:
                        stop(attempt, reason)
                    continue
                extend(record, token_ids, logprobs)
                num_tokens += len(token_ids)
                attempt.frame(first, token_ids, logprobs)
        finally:
            self.metrics.num_tokens += num_tokens

    def _apply_link(
        self, worker: Worker, attempt: LinkAttempt, first: int, token_ids: list[int], logprobs: list[float]
    ) -> str | None:
        """Journal and emit a checked link entry (synchronously, from the link's reader)."""
        record, emit, num_received = attempt.record, attempt.emit, attempt.num_received
        if not record.request.stop:
            self._frame(record, emit, num_received, first, token_ids, logprobs)
            return None
        for offset, token_id in enumerate(token_ids):
            reason = self._token(
                worker, record, emit, num_received, first + offset, token_id, logprobs[offset]
            )
            if reason is not None:
                return reason
        return None

    async def _stream(
        self, worker: Worker, body: dict[str, object], record: RequestRecord, emit: Emit, num_received: int
    ) -> str:
        """The attempt as one ``POST /generate``: read its NDJSON lines until the finish."""
        lines = stream_lines(self.client, worker.url, body, MAX_FRAME_BYTES)
        async with aclosing(lines):  # leaving early closes the connection: the worker stops
            async for batch in lines:
                for line in batch:
                    finish = self._handle(worker, line, record, emit, num_received)
                    if finish is not None:
                        return finish
        raise WorkerStreamError(f"worker {worker.url} ended its stream without a finish event")

    def _handle(
        self, worker: Worker, line: bytes, record: RequestRecord, emit: Emit, num_received: int
    ) -> str | None:
        event = parse_worker_event(line)
        if worker.retired or worker.held_out or event.epoch != worker.epoch:
            if worker.retired or event.epoch != worker.epoch:
                self.metrics.num_stale_events += 1
            state = (
                " (retired)" if worker.retired else " (held out: weight version)" if worker.held_out else ""
            )
            raise WorkerStreamError(
                f"event of epoch {event.epoch} from {worker.url}; slot {worker.slot} expects epoch "
                f"{worker.epoch}{state}"
            )
        if isinstance(event, WorkerFinish):
            return event.finish_reason
        if isinstance(event, WorkerTokens):
            self._check_frame(worker, record, event.index, event.token_ids)
            if not record.request.stop:
                self._frame(record, emit, num_received, event.index, event.token_ids, event.logprobs)
                return None
            for offset, token_id in enumerate(event.token_ids):
                index = event.index + offset
                reason = self._token(
                    worker, record, emit, num_received, index, token_id, event.logprobs[offset]
                )
                if reason is not None:
                    return reason
            return None
        return self._token(worker, record, emit, num_received, event.index, event.token_id, event.logprob)

    @staticmethod
    def _check_frame(worker: Worker, record: RequestRecord, first: int, token_ids: Sequence[int]) -> None:
        """A frame is used whole or not at all: index, room left, no stop token before its end."""
        index, request = len(record.token_ids), record.request
        if first != index or index + len(token_ids) > request.max_tokens:
            raise WorkerStreamError(
                f"worker {worker.url} sent a frame of {len(token_ids)} tokens at index "
                f"{first}; expected index {index} and at most {request.max_tokens - index} tokens"
            )
        stops = request.stop_token_ids
        if stops and len(token_ids) > 1 and any(t in stops for t in token_ids[:-1]):
            raise WorkerStreamError(f"worker {worker.url} sent tokens after a stop token in one frame")

    def _frame(
        self,
        record: RequestRecord,
        emit: Emit,
        num_received: int,
        start: int,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
    ) -> None:
        """Journal a checked frame whole and hand the tokens the client does not have to its emit."""
        self.journal.extend(record, token_ids, logprobs)
        skip = min(len(token_ids), max(0, num_received - start))  # regenerated: the client has them
        self.metrics.num_tokens_regenerated += skip
        self.metrics.num_tokens += len(token_ids) - skip
        if skip == len(token_ids):
            return
        if skip:
            token_ids, logprobs = token_ids[skip:], logprobs[skip:]
        emit.frame(start + skip, token_ids, logprobs)

    def _token(
        self,
        worker: Worker,
        record: RequestRecord,
        emit: Emit,
        num_received: int,
        at: int,
        token_id: int,
        logprob: float,
    ) -> str | None:
        index = len(record.token_ids)
        if at != index or index >= record.request.max_tokens:
            raise WorkerStreamError(f"worker {worker.url} sent token index {at}, expected {index}")
        self.journal.append(record, token_id, logprob)
        if index >= num_received:
            self.metrics.num_tokens += 1
            emit(TokenEvent(index, token_id, logprob))
        else:
            self.metrics.num_tokens_regenerated += 1
        if record.request.stop and self._stop_string_ends(record):
            return "stop"  # leaving the stream closes it: the worker stops generating
        return None

    def _stop_string_ends(self, record: RequestRecord) -> bool:
        """Whether the text now contains a stop string that the last token completed."""
        if self.tokenizer is None:
            return False
        longest = max(len(s) for s in record.request.stop)
        window = 4 * longest + 4  # a character is at most 4 byte-level tokens
        text = self.tokenizer.decode(record.token_ids[-window:])
        return any(s in text for s in record.request.stop)
