"""`FakeWorker`: a real HTTP worker (uvicorn on loopback) that speaks the worker protocol.

It stands in for the inference engine (belayer-shadow), which is outside this package, in the
router's tests and benchmarks and in the tests of packages that drive a router.  What it streams
is a pure function of the request, so a resumed request must continue with exactly the tokens an
uninterrupted one would have produced:

- by default, pseudo-random tokens keyed by ``(seed, index)`` (`token_at`);
- with ``script``, the tokens ``script(prompt_token_ids, seed)`` returns, then ``finish: stop``
  (`text_script` makes one from a text -> text function and a tokenizer).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import anyio
import attrs

from belayer_router._core._tokenizer import Tokenizer
from belayer_router._server._asgi import Receive, Send
from belayer_router._server._serve import serving
from belayer_router._wire._frames import LINK_PATH, LinkAbort, encode_reject, encode_step, read_link_frames
from belayer_router._wire._protocol import encode_worker_finish, encode_worker_token, encode_worker_tokens

__all__ = [
    "POISON",
    "FakeWorker",
    "Script",
    "WorkerKilled",
    "expected_tokens",
    "logprob_of",
    "running_worker",
    "text_script",
    "token_at",
    "wait_until",
]

POISON = 999_999
Script = Callable[[list[int], int], Sequence[int]]


def token_at(seed: int, index: int) -> int:
    """The token a seeded request samples at completion index ``index`` (no script)."""
    return ((seed * 6364136223846793005 + (index + 1) * 1442695040888963407) >> 20) % 32_000


def logprob_of(token_id: int) -> float:
    """The logprob the fake worker reports for ``token_id``."""
    return -(token_id % 997) / 100.0


def expected_tokens(seed: int, max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """What an uninterrupted unscripted request returns."""
    out: list[int] = []
    for index in range(max_tokens):
        out.append(token_at(seed, index))
        if out[-1] in stop_token_ids:
            break
    return out


def text_script(tokenizer: Tokenizer, respond: Callable[[str], str], end_token_id: int) -> Script:
    """A script answering the decoded prompt with ``respond(prompt)`` and then ``end_token_id``."""

    def script(prompt_token_ids: list[int], seed: int) -> list[int]:
        del seed  # a script is deterministic in the prompt alone
        return [*tokenizer.encode(respond(tokenizer.decode(prompt_token_ids))), end_token_id]

    return script


class WorkerKilled(Exception):
    """Raised inside the ASGI app: uvicorn drops the connection mid-body, like a dying engine."""


@attrs.define
class FakeWorker:
    """Streams deterministic tokens; can die, pause, lie about its epoch, or turn into a zombie."""

    epoch: int
    script: Script | None = None
    token_delay_s: float = 0.0
    die_after: int | None = None  # every stream dies after sending this many tokens
    die_after_total: int | None = None  # the worker dies for good after this many tokens in all
    pause_at: int | None = None  # streams pause before completion index pause_at until resumed
    poison_after_pause: bool = False  # after the pause, stream POISON tokens (a zombie)
    claimed_epoch: int | None = None  # epoch written into events (default: the real one)
    frame_tokens: int = 1  # > 1: send ``tokens`` frames of up to this many tokens
    link: bool = False  # also serve the multiplexed link (``POST /link``); register it with link=True
    num_links: int = 0  # links the router opened
    num_aborts: int = 0  # link requests the router aborted while they ran
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

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """ASGI entry point: ``POST /generate`` with a router -> worker body."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self.link and scope["path"].rstrip("/") == LINK_PATH:
            await self._link(receive, send)
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
            await send({"type": "http.response.start", "status": 409, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error":"stale epoch"}'})
            return
        headers = [(b"content-type", b"application/x-ndjson")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._stream(request, send)

    def _die_now(self, sent_in_stream: int) -> bool:
        if self.die_after_total is not None and self.num_tokens_sent >= self.die_after_total:
            self.dead = True
        return self.dead or (self.die_after is not None and sent_in_stream >= self.die_after)

    async def _frames(self, request: dict[str, Any]) -> AsyncGenerator[tuple[int, list[int]] | str]:
        """What a request streams: ``(first index, tokens)`` frames, then its finish reason."""
        start = len(request["generated_token_ids"])
        end = start + request["max_tokens"]
        scripted: Sequence[int] | None = None
        if self.script is not None:
            scripted = self.script(request["prompt_token_ids"], request["seed"])
            end = min(end, len(scripted))
        poisoned = False
        reason = "length" if scripted is None or end < len(scripted) else "stop"
        frame: list[int] = []
        for index in range(start, end):
            if index == self.pause_at:
                self.num_paused += 1
                await self.gate.wait()
                poisoned = self.poison_after_pause
            if self._die_now(index - start):
                self.died.set()
                raise WorkerKilled
            token = POISON if poisoned else token_at(request["seed"], index)
            if scripted is not None and not poisoned:
                token = scripted[index]
            frame.append(token)
            self.num_tokens_sent += 1
            stop = token in request["stop_token_ids"]
            if stop or len(frame) >= self.frame_tokens or index == end - 1:
                yield index - len(frame) + 1, frame
                frame = []
            if stop:
                reason = "stop"
                break
            await anyio.sleep(self.token_delay_s)
        yield reason

    async def _stream(self, request: dict[str, Any], send: Send) -> None:
        epoch = self.epoch if self.claimed_epoch is None else self.claimed_epoch
        async with aclosing(self._frames(request)) as frames:
            async for item in frames:
                if isinstance(item, str):
                    final = encode_worker_finish(epoch, item)
                    await send({"type": "http.response.body", "body": final, "more_body": False})
                else:
                    body = self._line(epoch, item[0], item[1])
                    await send({"type": "http.response.body", "body": body, "more_body": True})

    def _line(self, epoch: int, first: int, frame: list[int]) -> bytes:
        if self.frame_tokens == 1:
            return encode_worker_token(epoch, first, frame[0], logprob_of(frame[0]))
        return encode_worker_tokens(epoch, first, frame, [logprob_of(t) for t in frame])

    # The multiplexed link (``link=True``): every request of the link in one connection.

    async def _link(self, receive: Receive, send: Send) -> None:
        if self.dead:
            raise WorkerKilled
        self.num_links += 1
        outbox, outgoing = anyio.create_memory_object_stream[bytes](math.inf)
        running: dict[int, anyio.CancelScope] = {}
        headers = [(b"content-type", b"application/x-belayer-link")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def write() -> None:
            async for first in outgoing:
                batch = [first]
                while True:
                    try:
                        batch.append(outgoing.receive_nowait())
                    except anyio.WouldBlock:
                        break
                await send({"type": "http.response.body", "body": b"".join(batch), "more_body": True})

        async def generate(handle: int, request: dict[str, Any]) -> None:
            epoch = self.epoch if self.claimed_epoch is None else self.claimed_epoch
            with running.setdefault(handle, anyio.CancelScope()):
                async with aclosing(self._frames(request)) as frames:
                    async for item in frames:
                        if isinstance(item, str):
                            outbox.send_nowait(encode_step(epoch, [], [(handle, item)]))
                        else:
                            logprobs = [logprob_of(t) for t in item[1]]
                            outbox.send_nowait(encode_step(epoch, [(handle, item[0], item[1], logprobs)]))
            running.pop(handle, None)

        async with anyio.create_task_group() as group:
            group.start_soon(write)
            async for message in read_link_frames(receive):
                if isinstance(message, LinkAbort):
                    if message.handle in running:
                        self.num_aborts += 1
                        running[message.handle].cancel()
                    continue
                self.requests.append(message.body)
                if message.body.get("epoch") != self.epoch:
                    outbox.send_nowait(encode_reject(message.handle, "stale epoch"))
                    continue
                group.start_soon(generate, message.handle, message.body)
            group.cancel_scope.cancel()  # the router closed the link


@asynccontextmanager
async def running_worker(epoch: int = 1, **options: Any) -> AsyncIterator[tuple[str, FakeWorker]]:
    """A `FakeWorker` served on loopback for the block: ``(url, worker)``."""
    worker = FakeWorker(epoch, **options)
    async with serving(worker, log_level="critical") as url:
        yield url, worker


async def wait_until(predicate: Callable[[], bool], limit_s: float = 30.0) -> None:
    """Poll ``predicate`` (a test-side condition on worker counters) for at most ``limit_s``."""
    with anyio.fail_after(limit_s):
        while not predicate():  # noqa: ASYNC110  (the counters have no event to wait on)
            await anyio.sleep(0.01)
