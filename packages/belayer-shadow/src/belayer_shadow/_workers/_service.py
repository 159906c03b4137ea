"""`EngineService`: the router's worker protocol over one `LLMEngine`, and the scheduling loop.

A stepping thread owns the engine (`_stepper.Stepper`): HTTP handlers only queue additions and
aborts, which it applies between steps; it steps back to back while the engine has work and hands
each step's outputs to the event loop without waiting for it, and the event loop streams them.
The heartbeat is touched once per stepping-thread iteration in which the event loop has run too
(also when idle: at least every `idle_tick_s` or so). Every event a worker streams carries its
epoch, so the router can fence a stale worker.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from belayer_router import InvalidRequestError
from belayer_router.worker import (
    LINK_PATH,
    encode_reject,
    encode_step,
    encode_worker_finish,
    encode_worker_tokens,
    read_json,
)
from belayer_shadow._engine._sequence import SamplingParams, StepOutput
from belayer_shadow._errors import RequestError
from belayer_shadow._workers._events import EventLog
from belayer_shadow._workers._heartbeat import Heartbeat
from belayer_shadow._workers._link import LinkConn, serve_link
from belayer_shadow._workers._stepper import Delivery, Stepper

__all__ = ["Engine", "EngineService", "ResumeMode"]

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ResumeMode = Literal["continue", "regenerate"]

if TYPE_CHECKING:
    import torch


class Engine(Protocol):
    """What the workers drive: `LLMEngine`, or the vLLM engine (`belayer_shadow._vllm.VllmEngine`)."""

    device: torch.device

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def step(self) -> list[StepOutput]: ...
    def abort(self, request_id: str) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def warmup(self, num_requests: int = 4) -> None: ...
    def flush_kv(self) -> None: ...
    def refresh_weights(self) -> bool: ...
    def release_weights(self) -> None: ...
    def bind_kv(self) -> None: ...
    def private_weights(self) -> list[str]: ...
    def close(self) -> None: ...


def _line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


@attrs.define(eq=False)
class _Job:
    """One request being served: where its events go, and how many leading tokens to hide.

    A request of ``POST /generate`` streams NDJSON into ``events``; one of a link (``link`` set)
    goes out in its link's STEP frames under ``handle``.
    """

    request_id: str
    prompt: list[int]
    params: SamplingParams
    events: MemoryObjectSendStream[bytes] | None
    num_hidden: int = 0  # regenerate mode: tokens the client already has, generated again
    expected: tuple[int, ...] = ()
    finished: bool = False
    link: LinkConn | None = None
    handle: int = 0


def _parse_job(body: Any, mode: ResumeMode, events: MemoryObjectSendStream[bytes] | None) -> _Job:
    """Validate a router -> worker body (see belayer_router.worker_request_body)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    try:
        request_id = body["request_id"]
        prompt = list(body["prompt_token_ids"])
        generated = tuple(body.get("generated_token_ids") or ())
        max_tokens = body["max_tokens"]
    except (KeyError, TypeError) as exc:
        raise RequestError(
            f"missing or malformed field {exc}; send belayer_router.worker_request_body"
        ) from exc
    if not isinstance(request_id, str) or not request_id:
        raise RequestError("field 'request_id' must be a non-empty string")
    common = {
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "seed": body.get("seed"),
        "stop_token_ids": tuple(body.get("stop_token_ids") or ()),
    }
    if mode == "regenerate" and generated:
        # The conventional baseline: start over from the prompt, hide what the client already has.
        params = SamplingParams(max_tokens=max_tokens + len(generated), **common)
        return _Job(request_id, prompt, params, events, num_hidden=len(generated), expected=generated)
    params = SamplingParams(max_tokens=max_tokens, generated_token_ids=generated, **common)
    return _Job(request_id, prompt, params, events)


async def _read_body(receive: Receive) -> Any:
    """The request's JSON body (belayer-router's reader: bounded size, typed errors)."""
    try:
        return await read_json(receive)
    except InvalidRequestError as exc:
        raise RequestError(str(exc)) from exc


async def _send_json(send: Send, status: int, payload: Any) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@attrs.define(eq=False)
class EngineService:
    """Serves one engine at one epoch: an ASGI app plus the scheduling loop (`run_loop`)."""

    engine: Engine
    heartbeat: Heartbeat
    log: EventLog
    epoch: int = 0
    resume_mode: ResumeMode = "continue"
    idle_tick_s: float = 0.05
    weight_refresh_s: float = 0.2
    stop_timeout_s: float = 10.0  # how long stopping waits for a step in progress (then leaves it)
    num_tokens: int = 0
    num_tokens_regenerated: int = 0
    num_link_frames: int = 0  # STEP frames sent on router links (at most one per step and link)
    _jobs: dict[str, _Job] = attrs.field(factory=dict)
    _stepper: Stepper = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._stepper = Stepper(
            self.engine,
            self.heartbeat,
            self.log,
            self.idle_tick_s,
            self.weight_refresh_s,
            stop_timeout_s=self.stop_timeout_s,
        )

    @property
    def num_steps(self) -> int:
        """Engine steps taken so far."""
        return self._stepper.num_steps

    @property
    def step_in_progress(self) -> bool:
        """Whether the stepping thread still runs: after `run_loop` ended, a step that did not return
        within `stop_timeout_s` (the engine must then not be used or closed)."""
        return self._stepper.in_step

    # The scheduling loop.

    async def run_loop(self) -> None:
        """Step the engine in the stepping thread until cancelled (then wait for its step in progress);
        re-raises what ended the stepping thread."""
        self._stepper.start(self._deliver)
        try:
            while self._stepper.error is None:
                self._stepper.tick()
                await anyio.sleep(self.idle_tick_s)
            raise self._stepper.error
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._stepper.stop)

    def _deliver(self, delivery: Delivery) -> None:
        for job, reason in delivery.rejected:
            if job.finished:
                continue
            if job.link is not None:
                self._end_link_job(job)
                self._send_link(job.link, encode_reject(job.handle, reason))
            else:
                self._finish(job, _line({"type": "error", "epoch": self.epoch, "message": reason}))
        if delivery.outputs:
            self._dispatch(delivery.outputs)

    def _dispatch(self, outputs: list[tuple[_Job, StepOutput]]) -> None:
        """Send a step's outputs: per job one ``tokens`` frame (the visible tokens), then its finish line;
        for the jobs of a link, ONE STEP frame per link with all of them. Outputs of a job that is
        finished (aborted while the step ran) are dropped, even if its id was submitted again."""
        frames: dict[str, tuple[_Job, int, list[int], list[float]]] = {}  # job, first index, ids, logprobs
        finished: list[tuple[_Job, str]] = []
        for job, out in outputs:
            if job.finished:
                continue
            if out.index < job.num_hidden:
                self.num_tokens_regenerated += 1
            else:
                self.num_tokens += 1
                _job, _first, token_ids, logprobs = frames.setdefault(
                    out.request_id, (job, out.index, [], [])
                )
                token_ids.append(out.token_id)
                logprobs.append(out.logprob)
            if out.finish_reason is not None:
                finished.append((job, out.finish_reason))
        steps: dict[
            int, tuple[LinkConn, list[tuple[int, int, list[int], list[float]]], list[tuple[int, str]]]
        ] = {}
        for job, first_index, token_ids, logprobs in frames.values():
            if job.link is None:
                self._send_job(job, encode_worker_tokens(self.epoch, first_index, token_ids, logprobs))
            else:
                steps.setdefault(id(job.link), (job.link, [], []))[1].append(
                    (job.handle, first_index, token_ids, logprobs)
                )
        for job, finish_reason in finished:
            if job.finished:
                continue
            if job.link is None:
                self._finish(job, encode_worker_finish(self.epoch, finish_reason))
            else:
                steps.setdefault(id(job.link), (job.link, [], []))[2].append((job.handle, finish_reason))
                self._end_link_job(job)
        for link, entries, done in steps.values():
            if self._send_link(link, encode_step(self.epoch, entries, done)):
                self.num_link_frames += 1

    def _send_job(self, job: _Job, line: bytes) -> None:
        """Queue ``line`` on the stream of ``job``; a stream already closed ends that job only."""
        assert job.events is not None
        try:
            job.events.send_nowait(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._abandon(job)

    def _send_link(self, link: LinkConn, frame: bytes) -> bool:
        """Queue ``frame`` on ``link``; a link already closed ends its jobs (and nothing else)."""
        try:
            link.outbox.send_nowait(frame)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            for job in list(link.jobs.values()):
                self._abandon(job)
            return False
        return True

    def _abandon(self, job: _Job) -> None:
        """Its client is gone before the job was aborted: finish it and abort it in the engine."""
        if job.finished:
            return
        job.finished = True
        if self._jobs.get(job.request_id) is job:
            del self._jobs[job.request_id]
        if job.link is not None:
            job.link.jobs.pop(job.handle, None)
        self._stepper.abort(job)

    def _end_link_job(self, job: _Job) -> None:
        job.finished = True
        self._jobs.pop(job.request_id, None)
        if job.link is not None:
            job.link.jobs.pop(job.handle, None)

    def _finish(self, job: _Job, last: bytes) -> None:
        self._send_job(job, last)
        job.finished = True
        assert job.events is not None
        job.events.close()

    # HTTP.

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """ASGI entry point: `POST /generate`, `GET /health`, `GET /metrics`."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"].rstrip("/"))
        if route == ("POST", "/generate"):
            await self._generate(receive, send)
        elif route == ("POST", LINK_PATH):
            await serve_link(self, receive, send)
        elif route == ("GET", "/health"):
            status = "ok" if self.epoch > 0 else "standby"
            payload = {"status": status, "epoch": self.epoch, "num_running": len(self._jobs)}
            await _send_json(send, 200, {**payload, "num_steps": self.num_steps})
        elif route == ("GET", "/metrics"):
            text = self._metrics().encode()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
            )
            await send({"type": "http.response.body", "body": text})
        else:
            await _send_json(
                send, 404, {"error": f"no route {route[0]} {route[1]}; see the belayer-shadow README"}
            )

    def _metrics(self) -> str:
        counters = {
            "steps_total": self.num_steps,
            "tokens_total": self.num_tokens,
            "tokens_regenerated_total": self.num_tokens_regenerated,
            "epoch": self.epoch,
            # The stepping thread's wall clock: inside engine.step(), and between back-to-back steps.
            "step_seconds_total": round(self._stepper.step_s, 6),
            "between_steps_seconds_total": round(self._stepper.gap_s, 6),
        }
        lines = [f"belayer_shadow_{name} {value}" for name, value in counters.items()]
        return "\n".join(lines) + "\n" + self.log.render_metrics()

    def submit_link(self, link: LinkConn, handle: int, body: Any) -> str | None:
        """Queue a request that came on ``link``; the reason to reject it, or None."""
        try:
            job = _parse_job(body, self.resume_mode, None)
        except RequestError as exc:
            return str(exc)
        if body.get("epoch") != self.epoch:
            return f"this worker serves epoch {self.epoch}, not {body.get('epoch')}"
        if job.request_id in self._jobs:
            return f"request {job.request_id!r} is already running here"
        job.link, job.handle = link, handle
        link.jobs[handle] = job
        self._jobs[job.request_id] = job
        self._stepper.add(job)
        return None

    def abort_link(self, link: LinkConn, handle: int) -> None:
        """The router no longer wants request ``handle`` of ``link`` (also for every job of a closed link)."""
        job = link.jobs.get(handle)
        if job is not None and not job.finished:
            self._end_link_job(job)  # its tokens from a step in flight are dropped (`_dispatch`)
            self._stepper.abort(job)

    async def _generate(self, receive: Receive, send: Send) -> None:
        events, stream = anyio.create_memory_object_stream[bytes](math.inf)
        try:
            body = await _read_body(receive)
            job = _parse_job(body, self.resume_mode, events)
        except RequestError as exc:
            await _send_json(send, 400, {"error": str(exc)})
            return
        if body.get("epoch") != self.epoch:
            await _send_json(
                send, 409, {"error": f"this worker serves epoch {self.epoch}, not {body.get('epoch')}"}
            )
            return
        if job.request_id in self._jobs:
            await _send_json(send, 409, {"error": f"request {job.request_id!r} is already running here"})
            return
        self._jobs[job.request_id] = job
        self._stepper.add(job)
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")],
                }
            )
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_disconnect, receive, group.cancel_scope)
                await self._stream(stream, send)
                group.cancel_scope.cancel()
        finally:
            self._jobs.pop(job.request_id, None)
            if not job.finished:
                job.finished = True
                self._stepper.abort(job)
            events.close()
            stream.close()

    async def _stream(self, stream: MemoryObjectReceiveStream[bytes], send: Send) -> None:
        async for first in stream:
            chunk = [first]
            while True:  # one body chunk per wake-up: whatever the loop queued meanwhile
                try:
                    chunk.append(stream.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            await send({"type": "http.response.body", "body": b"".join(chunk), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        scope.cancel()
