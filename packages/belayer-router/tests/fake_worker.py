"""`FakeWorker`: a real HTTP worker (uvicorn on loopback) that speaks the worker protocol.

It stands in for the inference engine (belayer-shadow), which is outside this package.  Its
"sampling" is a pure function of ``(seed, index)``, so a resumed request must continue with
exactly the tokens an uninterrupted one would have produced.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs

from belayer_router import serving

POISON = 999_999


def token_at(seed: int, index: int) -> int:
    """The token a seeded request samples at completion index ``index``."""
    return ((seed * 6364136223846793005 + (index + 1) * 1442695040888963407) >> 20) % 32_000


def logprob_of(token_id: int) -> float:
    return -(token_id % 997) / 100.0


def expected_tokens(seed: int, max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """What an uninterrupted request returns."""
    out: list[int] = []
    for index in range(max_tokens):
        out.append(token_at(seed, index))
        if out[-1] in stop_token_ids:
            break
    return out


class WorkerKilled(Exception):
    """Raised inside the ASGI app: uvicorn drops the connection mid-body, like a dying engine."""


@attrs.define
class FakeWorker:
    """Streams deterministic tokens; can die, pause, lie about its epoch, or turn into a zombie."""

    epoch: int
    token_delay: float = 0.0
    die_after: int | None = None  # every stream dies after sending this many tokens
    pause_at: int | None = None  # streams pause before completion index pause_at until resumed
    poison_after_pause: bool = False  # after the pause, stream POISON tokens (a zombie)
    claimed_epoch: int | None = None  # epoch written into events (default: the real one)
    dead: bool = False
    gate: anyio.Event = attrs.field(factory=anyio.Event)
    died: anyio.Event = attrs.field(factory=anyio.Event)
    num_paused: int = 0
    num_tokens_sent: int = 0
    requests: list[dict[str, Any]] = attrs.field(factory=list)

    def kill(self) -> None:
        """Die: every open stream breaks at its next token and new requests fail."""
        self.dead = True
        self.died.set()

    def resume(self) -> None:
        """Let paused streams continue."""
        self.gate.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.dead:
            raise WorkerKilled
        request = json.loads(body)
        self.requests.append(request)
        if request["epoch"] != self.epoch:
            await self._reply(send, 409, b'{"error":"stale epoch"}')
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson")],
            }
        )
        await self._stream(request, send)

    async def _reply(self, send: Any, status: int, body: bytes) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, request: dict[str, Any], send: Any) -> None:
        epoch = self.epoch if self.claimed_epoch is None else self.claimed_epoch
        start = len(request["generated_token_ids"])
        poisoned = False
        reason = "length"
        for index in range(start, start + request["max_tokens"]):
            if index == self.pause_at:
                self.num_paused += 1
                await self.gate.wait()
                poisoned = self.poison_after_pause
            if self.dead or (self.die_after is not None and index - start >= self.die_after):
                self.died.set()
                raise WorkerKilled
            token = POISON if poisoned else token_at(request["seed"], index)
            event = {"type": "token", "epoch": epoch, "index": index, "token_id": token}
            event["logprob"] = logprob_of(token)
            await send(
                {"type": "http.response.body", "body": json.dumps(event).encode() + b"\n", "more_body": True}
            )
            self.num_tokens_sent += 1
            if token in request["stop_token_ids"]:
                reason = "stop"
                break
            await anyio.sleep(self.token_delay)
        final = json.dumps({"type": "finish", "epoch": epoch, "finish_reason": reason}).encode() + b"\n"
        await send({"type": "http.response.body", "body": final, "more_body": False})


@asynccontextmanager
async def running_worker(epoch: int = 1, **options: Any) -> AsyncIterator[tuple[str, FakeWorker]]:
    """A `FakeWorker` served on loopback for the block: ``(url, worker)``."""
    worker = FakeWorker(epoch, **options)
    async with serving(worker, log_level="critical") as url:
        yield url, worker


async def wait_until(predicate: Callable[[], bool], limit: float = 30.0) -> None:
    """Poll ``predicate`` (a test-side condition on worker counters) for at most ``limit`` s."""
    with anyio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110  (the counters have no event to wait on)
            await anyio.sleep(0.01)
