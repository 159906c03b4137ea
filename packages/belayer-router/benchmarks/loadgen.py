"""The load of ``bench_router.py``: the paced worker, the floor and the client processes.

    python benchmarks/loadgen.py worker [--step-ms 30] [--frame-tokens 1] [--events link]
    python benchmarks/loadgen.py floor [--step-ms 30] [--frame-tokens 1]
    python benchmarks/loadgen.py client        (driven by `ClientPool` over stdin/stdout)

The worker prints its URL and serves ``POST /generate`` (``token`` lines or ``tokens`` frames) and
the router's worker link (``POST /link``: one ``STEP`` frame per step for all its requests).  A
client process streams the requests it is given over raw HTTP/1.1 connections (an asyncio protocol
and httptools' C parser, uvloop when installed: the generator must not be the bottleneck) and
returns its token count, first/last times and inter-token gaps; `ClientPool` runs several of them
at once, starts them together and merges their results.  Requests to a ``/generate`` URL get a
connection each; those to a router's ``/client-link`` go on client links (``--streams-per-link``
streams per link; by default each client process's whole share on ONE link): the client OPENs
them and reads the ``TOKENS``/``FINISH`` frames (`_wire.FrameBuffer`, `_wire.decode_tokens`);
those to a worker's ``/link`` go on worker links (``SUBMIT``, ``STEP``): the generator's own
ceiling on the link path.  Every entry of a frame gets the frame's arrival time; each stream is
checked (indices contiguous from 0, each entry's first token the worker's, ends at max_tokens).

The floor (`serve_floor`) is the least a Python process can do to stream the router's tokens to
its clients: it answers the router's ``POST /generate`` (one JSON parse per request) with the
router's response head and, every ``--step-ms``, writes each stream the bytes of the router's
``tokens`` (or ``token``) event, chunk-framed, with one ``transport.write`` per stream per step
(uvloop, an asyncio Protocol, httptools).  No worker, no journal, no parsing per token: its CPU
per token is what one write per token per client connection costs on this machine.  The same
process answers ``POST /client-link`` (the client link's floor): it takes the OPENs and, every
step, writes each link ONE ``TOKENS`` frame (`_wire.pack_tokens`) with an entry per stream (then
the ``FINISH`` frames of those that ended): the least CPU that protocol costs here.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import anyio
import httptools
import orjson

from belayer_router import bind_socket, serve_asgi
from belayer_router._wire._frames import (  # the client link's codec (the benchmark is the package's own)
    CLIENT_LINK_PATH,
    FINISH,
    OPEN,
    STEP,
    TOKENS,
    FrameBuffer,
    decode_step,
    decode_tokens,
    encode_finish,
    encode_open,
    pack_tokens,
)
from belayer_router.worker import LINK_PATH, LinkSubmit, encode_step, encode_submit, read_link_frames

CLIENT_TIMEOUT_S = 900.0  # a pass that takes longer has hung: the client process fails
READY_TIMEOUT_S = 120.0  # a client process that has not parsed its share by then is stuck


def token_id(seed: int, index: int) -> int:
    return (seed * 7919 + index * 104729) % 32000


class PacedWorker:
    """The engine stand-in: deterministic tokens, ``frame`` per stream every ``step`` s; can break/hang."""

    def __init__(
        self,
        epoch: int,
        step: float,
        break_at: int | None = None,
        hang: bool = False,
        frame: int = 1,
        events: str = "token",
    ) -> None:
        self.epoch, self.step, self.break_at, self.hang, self.frame = epoch, step, break_at, hang, frame
        self.events = events  # "token": one line per token; "tokens": one frame per step; "link"
        self.broken = anyio.Event()
        self.break_time = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == LINK_PATH:
            await self._link(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x-ndjson")]}
        )
        start = len(request["generated_token_ids"])
        end = start + request["max_tokens"]
        seed = request["seed"]
        for index in range(start, end, self.frame):
            if self.break_at is not None and index <= self.break_at < index + self.frame:
                self.break_time = time.monotonic()
                self.broken.set()
                if self.hang:
                    await anyio.sleep_forever()
                raise ConnectionAbortedError("worker died (benchmark)")
            if self.events == "token":
                line = b"".join(
                    f'{{"type":"token","epoch":{self.epoch},"index":{i},"token_id":{token_id(seed, i)},"logprob":-1.0}}\n'.encode()
                    for i in range(index, min(index + self.frame, end))
                )
            else:
                count = min(self.frame, end - index)
                tokens = [token_id(seed, i) for i in range(index, index + count)]
                frame = {"type": "tokens", "epoch": self.epoch, "index": index, "token_ids": tokens}
                line = orjson.dumps(frame | {"logprobs": [-1.0] * count}, option=orjson.OPT_APPEND_NEWLINE)
            await send({"type": "http.response.body", "body": line, "more_body": True})
            await anyio.sleep(self.step)  # sleep(0) unpaced: a checkpoint, so other streams run
        final = f'{{"type":"finish","epoch":{self.epoch},"finish_reason":"length"}}\n'.encode()
        await send({"type": "http.response.body", "body": final, "more_body": False})

    async def _link(self, receive: Any, send: Any) -> None:
        """The multiplexed link: every ``step`` s ONE frame with ``frame`` tokens per running request."""
        await send({"type": "http.response.start", "status": 200, "headers": []})
        active: dict[int, list[int]] = {}  # handle -> [seed, next index, end]
        submitted = anyio.Event()

        async def stepper() -> None:
            nonlocal submitted
            while True:
                if not active:  # idle: wait for a submission (no busy loop when unpaced)
                    await submitted.wait()
                    submitted = anyio.Event()
                    continue
                entries, finished = [], []
                for handle, state in list(active.items()):
                    seed, index, end = state
                    count = min(self.frame, end - index)
                    tokens = [token_id(seed, i) for i in range(index, index + count)]
                    entries.append((handle, index, tokens, [-1.0] * count))
                    state[1] = index + count
                    if index + count >= end:
                        finished.append((handle, "length"))
                        del active[handle]
                body = encode_step(self.epoch, entries, finished)
                await send({"type": "http.response.body", "body": body, "more_body": True})
                await anyio.sleep(self.step)

        async with anyio.create_task_group() as group:
            group.start_soon(stepper)
            async for message in read_link_frames(receive):
                if isinstance(message, LinkSubmit):
                    request = message.body
                    start = len(request["generated_token_ids"])
                    active[message.handle] = [request["seed"], start, start + request["max_tokens"]]
                    submitted.set()
                else:
                    active.pop(message.handle, None)
            group.cancel_scope.cancel()


def serve_worker(step: float, frame: int, events: str) -> None:
    sock = bind_socket("127.0.0.1", 0)
    print(f"worker listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    anyio.run(serve_asgi, PacedWorker(1, step, frame=frame, events=events), sock, "critical")


# The floor: the router's client side with nothing behind it.

_FLOOR_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
)  # what the router's own server answers a streamed /generate of a `Connection: close` client
_FLOOR_LINK_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-belayer-link\r\ntransfer-encoding: chunked\r\n\r\n"
)
_FLOOR_FINISH = (
    b'{"type":"finish","request_id":"%b","finish_reason":"length","num_prompt_tokens":%d,'
    b'"num_generated_tokens":%d,"num_resumes":0}\n'
)


class _FloorStream:
    """One client stream of the floor: its transport, seed, next index, end, event kind."""

    __slots__ = ("end", "frames", "index", "num_prompt", "request_id", "seed", "transport")

    def __init__(self, transport: asyncio.Transport, request: dict[str, Any]) -> None:
        self.transport = transport
        self.seed, self.index, self.end = request.get("seed") or 0, 0, int(request["max_tokens"])
        self.frames = bool(request.get("frames", False))
        self.request_id = str(request.get("request_id") or id(self)).encode()
        self.num_prompt = len(request["prompt_token_ids"])


class _FloorLink:
    """One client link of the floor: its transport and its streams ``[handle, seed, next index, end,
    request id, prompt length]``; ``closing`` once the client ended its request body."""

    __slots__ = ("closing", "frames", "streams", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.frames = FrameBuffer()
        self.streams: list[list[Any]] = []
        self.closing = False

    def open(self, payload: memoryview) -> None:
        (handle,) = struct.unpack_from("<I", payload)
        request = orjson.loads(payload[4:])
        request_id = str(request.get("request_id") or f"floor-{id(self)}-{handle}")
        seed, end = request.get("seed") or 0, int(request["max_tokens"])
        self.streams.append([handle, seed, 0, end, request_id, len(request["prompt_token_ids"])])


class _FloorConnection(asyncio.Protocol):
    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.url = b""
        self.transport: asyncio.Transport | None = None
        self.stream: _FloorStream | None = None
        self.link: _FloorLink | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the router's server

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_headers_complete(self) -> None:
        if self.url == CLIENT_LINK_PATH.encode():  # answered at once, before any OPEN (the spec)
            assert self.transport is not None
            self.transport.write(_FLOOR_LINK_HEAD)
            self.link = _FloorLink(self.transport)
            self.floor.links[self.link] = None

    def on_body(self, body: bytes) -> None:
        if self.link is None:
            self.body.append(body)
            return
        for kind, payload in self.link.frames.feed(body):
            if kind != OPEN:
                raise ValueError(f"the floor takes only OPEN frames, got kind {kind}")
            self.link.open(payload)
        self.floor.wake_up()

    def on_message_complete(self) -> None:
        assert self.transport is not None
        if self.link is not None:  # no more OPENs: the link ends once its streams have
            self.link.closing = True
            self.floor.wake_up()
            return
        self.transport.write(_FLOOR_HEAD)
        self.stream = _FloorStream(self.transport, orjson.loads(b"".join(self.body)))
        self.floor.add(self.stream)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.floor.streams.pop(self.stream, None)
        if self.link is not None:
            self.floor.links.pop(self.link, None)


class Floor:
    """Every ``step`` s (a fixed schedule; as fast as it can when behind or unpaced) one chunk per
    running ``/generate`` stream with its next ``frame`` tokens' event, and one chunk per client
    link with ONE ``TOKENS`` frame for all its streams (then their ``FINISH`` frames)."""

    def __init__(self, step: float, frame: int) -> None:
        self.step, self.frame = step, frame
        self.streams: dict[_FloorStream, None] = {}  # insertion ordered, O(1) removal
        self.links: dict[_FloorLink, None] = {}
        self.wake: asyncio.Future[None] | None = None

    def add(self, stream: _FloorStream) -> None:
        self.streams[stream] = None
        self.wake_up()

    def wake_up(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _line(self, stream: _FloorStream, index: int, count: int) -> bytes:
        seed = stream.seed
        if count == 1:
            if stream.frames:
                return b'{"type":"tokens","index":%d,"token_ids":[%d],"logprobs":[-1.0]}\n' % (
                    index,
                    (seed * 7919 + index * 104729) % 32000,
                )
            return b'{"type":"token","index":%d,"token_id":%d,"logprob":-1.0}\n' % (
                index,
                (seed * 7919 + index * 104729) % 32000,
            )
        ids = b",".join([b"%d" % token_id(seed, i) for i in range(index, index + count)])
        if stream.frames:
            logprobs = b",".join([b"-1.0"] * count)
            return b'{"type":"tokens","index":%d,"token_ids":[%b],"logprobs":[%b]}\n' % (index, ids, logprobs)
        return b"".join(
            b'{"type":"token","index":%d,"token_id":%d,"logprob":-1.0}\n' % (i, token_id(seed, i))
            for i in range(index, index + count)
        )

    def _link_step(self, link: _FloorLink) -> None:
        """ONE write for the link: a TOKENS frame with an entry per stream, then the FINISH frames."""
        frame = self.frame
        handles, firsts, counts, token_ids = [], [], [], []
        finished = False
        for state in link.streams:
            handle, seed, index, end = state[0], state[1], state[2], state[3]
            count = min(frame, end - index)
            handles.append(handle)
            firsts.append(index)
            counts.append(count)
            if count == 1:
                token_ids.append((seed * 7919 + index * 104729) % 32000)
            else:
                token_ids.extend([token_id(seed, i) for i in range(index, index + count)])
            state[2] = index + count
            finished = finished or state[2] >= end
        body = pack_tokens(handles, firsts, counts, token_ids, [-1.0] * len(token_ids)) if handles else b""
        if finished:
            running = []
            for state in link.streams:
                if state[2] < state[3]:
                    running.append(state)
                    continue
                payload = {"request_id": state[4], "finish_reason": "length", "num_prompt_tokens": state[5]}
                body += encode_finish(
                    state[0], payload | {"num_generated_tokens": state[3], "num_resumes": 0}
                )
            link.streams = running
        end = b"0\r\n\r\n" if link.closing and not link.streams else b""
        if body or end:
            link.transport.write(b"%x\r\n%b\r\n%b" % (len(body), body, end) if body else end)
        if end:
            link.transport.close()
            del self.links[link]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        frame, streams, links = self.frame, self.streams, self.links
        deadline = loop.time()
        while True:
            if not streams and not any(link.streams or link.closing for link in links):
                self.wake = loop.create_future()
                await self.wake
                deadline = loop.time()
                continue
            deadline += self.step  # a fixed step: the writes' own time does not stretch it
            for stream in list(streams):
                index = stream.index
                count = min(frame, stream.end - index)
                line = self._line(stream, index, count)
                transport = stream.transport
                transport.write(b"%x\r\n%b\r\n" % (len(line), line))  # ONE write per stream per step
                stream.index = index + count
                if stream.index >= stream.end:
                    last = _FLOOR_FINISH % (stream.request_id, stream.num_prompt, stream.end)
                    transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last))
                    transport.close()
                    del streams[stream]
            for link in list(links):
                self._link_step(link)
            delay = deadline - loop.time()
            if delay < 0:  # behind (or unpaced): no catching up in bursts
                deadline, delay = loop.time(), 0.0
            await asyncio.sleep(delay)


def serve_floor(step: float, frame: int) -> None:
    """Serve the floor on a free loopback port; print its URL (the first stdout line)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)
    print(f"floor listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)

    async def main() -> None:
        floor = Floor(step, frame)
        loop = asyncio.get_running_loop()
        await loop.create_server(lambda: _FloorConnection(floor), sock=sock, backlog=4096)
        await floor.run()

    _loop_run()(main())


def _loop_run() -> Any:
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


class _Stream(asyncio.Protocol):
    """One streamed ``/generate`` request on its own connection; counts tokens, records gaps."""

    def __init__(
        self, request: bytes, done: asyncio.Future[int], gaps: list[float], firsts: list[float]
    ) -> None:
        self.request, self.done, self.gaps, self.firsts = request, done, gaps, firsts
        self.parser = httptools.HttpResponseParser(self)
        self.pending = b""
        self.count = 0
        self.last = self.now = time.monotonic()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.now = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(error)

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() != 200:
            self._fail(RuntimeError(f"HTTP {self.parser.get_status_code()}"))

    def on_body(self, body: bytes) -> None:
        *lines, self.pending = (self.pending + body).split(b"\n")
        for line in lines:
            if line.startswith(b'{"type":"token'):
                event = orjson.loads(line)
                size = len(event["token_ids"]) if event["type"] == "tokens" else 1
                if self.count:
                    self.gaps.append(self.now - self.last)
                else:
                    self.firsts.append(self.now)  # the stream's first token (time.monotonic)
                if size > 1:
                    self.gaps.extend([0.0] * (size - 1))
                self.last, self.count = self.now, self.count + size
            elif line.startswith(b'{"type":"error'):
                self._fail(RuntimeError(line.decode()))

    def on_message_complete(self) -> None:
        if not self.done.done():
            self.done.set_result(self.count)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError("closed before the response ended"))

    def _fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class _LinkStreams(asyncio.Protocol):
    """The streams of one client link (``POST /client-link``: ``OPEN`` each, read ``TOKENS`` and
    ``FINISH`` frames) or of one worker link (``POST /link``: ``SUBMIT`` each, read ``STEP`` frames:
    the generator's ceiling on the link path).  Checks, per stream, that the indices are contiguous
    from 0, that each entry's first token is the paced worker's and that it ends at its max_tokens;
    every entry of a frame gets the frame's arrival time."""

    def __init__(
        self,
        request: bytes,
        seeds: list[int],
        ends: list[int],
        done: asyncio.Future[int],
        gaps: list[float],
        firsts: list[float],
    ) -> None:
        self.request, self.seeds, self.ends = request, seeds, ends
        self.done, self.gaps, self.firsts = done, gaps, firsts
        self.next = [0] * len(seeds)
        self.last = [0.0] * len(seeds)
        self.open = len(seeds)
        self.count = 0
        self.frames = FrameBuffer()
        self.parser = httptools.HttpResponseParser(self)
        self.now = time.monotonic()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.now = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(error.__context__ or error)  # a callback's own error, if it raised one

    def on_headers_complete(self) -> None:
        if self.parser.get_status_code() != 200:
            raise RuntimeError(f"HTTP {self.parser.get_status_code()} on the link")

    def on_body(self, body: bytes) -> None:
        for kind, payload in self.frames.feed(body):
            if kind == TOKENS:
                tokens = decode_tokens(payload)
                self._entries(tokens.handles, tokens.firsts, tokens.counts, tokens.token_ids)
            elif kind == FINISH:
                self._finish(struct.unpack_from("<I", payload)[0])
            elif kind == STEP:
                step = decode_step(payload)
                self._entries(step.handles, step.firsts, step.counts, step.token_ids)
                for handle in step.finished:
                    self._finish(handle)
            else:  # ERROR, LINK_ERROR, REJECT: the run is void
                raise RuntimeError(f"link frame kind {kind}: {bytes(payload[:300])!r}")

    def _entries(
        self, handles: list[int], firsts: list[int], counts: list[int], token_ids: list[int]
    ) -> None:
        now, following, last, seeds, gaps = self.now, self.next, self.last, self.seeds, self.gaps
        offset = 0
        for handle, first, count in zip(handles, firsts, counts, strict=True):
            if first != following[handle]:
                raise RuntimeError(
                    f"stream {handle}: tokens from index {first}, expected {following[handle]}"
                )
            if token_ids[offset] != (seeds[handle] * 7919 + first * 104729) % 32000:
                raise RuntimeError(
                    f"stream {handle}: token {token_ids[offset]} at index {first} is not the worker's"
                )
            if first:
                gaps.append(now - last[handle])
            else:
                self.firsts.append(now)  # the stream's first token (time.monotonic)
            if count > 1:
                gaps.extend([0.0] * (count - 1))
            last[handle] = now
            following[handle] = first + count
            offset += count
        self.count += offset

    def _finish(self, handle: int) -> None:
        if self.next[handle] != self.ends[handle]:
            raise RuntimeError(
                f"stream {handle} finished at index {self.next[handle]} of {self.ends[handle]}"
            )
        self.open -= 1
        if self.open == 0 and not self.done.done():
            self.done.set_result(self.count)
            assert self.transport is not None
            self.transport.write(b"0\r\n\r\n")  # the end of the request body: no more OPENs

    def on_message_complete(self) -> None:
        if not self.done.done():
            self._fail(RuntimeError(f"the link ended with {self.open} streams open"))
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionError(f"the link closed with {self.open} streams open"))

    def _fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()


def _request(url: str, body: dict[str, Any]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    payload = orjson.dumps(body)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return parts.hostname or "127.0.0.1", parts.port or 80, head.encode() + payload


def _link_request(url: str, bodies: list[dict[str, Any]]) -> tuple[str, int, bytes]:
    """A link's head and its first body chunk: an OPEN (to a worker's ``/link``: a SUBMIT) per body."""
    parts = urlsplit(url)
    encode = encode_open if parts.path.endswith(CLIENT_LINK_PATH) else encode_submit
    frames = b"".join(encode(handle, orjson.dumps(body)) for handle, body in enumerate(bodies))
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/x-belayer-link\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    return (
        parts.hostname or "127.0.0.1",
        parts.port or 80,
        head.encode() + b"%x\r\n%b\r\n" % (len(frames), frames),
    )


def _links(requests: list[tuple[str, dict[str, Any]]], per_link: int) -> list[tuple[Any, ...]]:
    """The links of a share: per URL, ``per_link`` streams each (0: all of that URL's on one link);
    each ``(host, port, request, seeds, max_tokens)``."""
    by_url: dict[str, list[dict[str, Any]]] = {}
    for url, body in requests:
        by_url.setdefault(url, []).append(body)
    links = []
    for url, bodies in by_url.items():
        size = per_link or len(bodies)
        for start in range(0, len(bodies), size):
            group = bodies[start : start + size]
            seeds, ends = [b.get("seed") or 0 for b in group], [int(b["max_tokens"]) for b in group]
            links.append((*_link_request(url, group), seeds, ends))
    return links


async def _stream_all(requests: list[tuple[str, int, bytes]], links: list[tuple[Any, ...]]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    firsts: list[float] = []

    async def one(host: str, port: int, request: bytes) -> int:
        done: asyncio.Future[int] = loop.create_future()
        await loop.create_connection(lambda: _Stream(request, done, gaps, firsts), host, port)
        return await done

    async def link(host: str, port: int, request: bytes, seeds: list[int], ends: list[int]) -> int:
        done: asyncio.Future[int] = loop.create_future()
        await loop.create_connection(
            lambda: _LinkStreams(request, seeds, ends, done, gaps, firsts), host, port
        )
        return await done

    began = time.monotonic()
    calls = [one(*r) for r in requests] + [link(*spec) for spec in links]
    counts = await asyncio.wait_for(asyncio.gather(*calls), CLIENT_TIMEOUT_S)
    ended = time.monotonic()
    return {
        "began": began,
        "ended": ended,
        "tokens": sum(counts),
        "firsts": firsts,
        "gaps": array.array("f", gaps),
    }


def client_main() -> None:
    """Serve jobs from stdin: ``{"requests": [[url, body], ...], "gaps": path, "streams_per_link":
    k}``, then ``go``; write the gaps (float32) to the path, answer one JSON line with the times
    and the token count.  A URL ending in ``/generate`` is one connection per request; one ending
    in ``/client-link`` (or a worker's ``/link``) is a link per ``k`` of its requests (0: one)."""
    run = _loop_run()
    for line in sys.stdin:
        job = json.loads(line)
        paths = (LINK_PATH, CLIENT_LINK_PATH)
        http = [(url, body) for url, body in job["requests"] if not url.endswith(paths)]
        linked = [(url, body) for url, body in job["requests"] if url.endswith(paths)]
        requests = [_request(url, body) for url, body in http]
        links = _links(linked, job.get("streams_per_link", 0))
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        result = run(_stream_all(requests, links))
        Path(job["gaps"]).write_bytes(result.pop("gaps").tobytes())
        print(json.dumps(result), flush=True)


class ClientPool:
    """``size`` client processes; `run` spreads requests over them and merges their results."""

    def __init__(self, size: int) -> None:
        self.folder = tempfile.TemporaryDirectory(prefix="bench-router-")  # the clients' gaps
        argv = [sys.executable, str(Path(__file__)), "client"]
        self.processes = [
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for _ in range(size)
        ]

    def run(self, requests: list[tuple[str, dict[str, Any]]], streams_per_link: int = 0) -> dict[str, Any]:
        """Stream ``requests`` (``(url, body)``, split round robin) at once; tokens/s and gaps.
        Link URLs (``/client-link``, ``/link``): ``streams_per_link`` streams per link (0: each
        client's whole share of a URL on one link)."""
        shares = [requests[i :: len(self.processes)] for i in range(len(self.processes))]
        busy = [(p, share) for p, share in zip(self.processes, shares, strict=True) if share]
        for number, (process, share) in enumerate(busy):
            assert process.stdin is not None
            gaps = str(Path(self.folder.name) / f"gaps-{number}")
            job = {"requests": share, "gaps": gaps, "streams_per_link": streams_per_link}
            process.stdin.write(json.dumps(job) + "\n")
            process.stdin.flush()
        for process, _ in busy:  # every client has parsed its share: start them together
            if self._readline(process, READY_TIMEOUT_S).strip() != "ready":
                raise RuntimeError("a client process died before it was ready (its traceback is above)")
        for process, _ in busy:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        results = []
        for process, _ in busy:
            line = self._readline(process, CLIENT_TIMEOUT_S + 60)
            if not line:
                raise RuntimeError("a client process died mid-run (its traceback is above)")
            results.append(json.loads(line))
        for number, result in enumerate(results):
            result["gaps"] = (Path(self.folder.name) / f"gaps-{number}").read_bytes()
        return merge(results)

    def _readline(self, process: subprocess.Popen[str], timeout_s: float) -> str:
        """The client's next stdout line; its clients are killed if none comes within ``timeout_s``."""
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout_s)  # one line per exchange:
        if not ready:  # nothing is left in Python's buffer between two exchanges
            for each in self.processes:
                each.kill()
                each.wait()
            raise RuntimeError(f"client process {process.pid} gave no answer within {timeout_s:g} s (killed)")
        return process.stdout.readline()

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def close(self) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in self.processes:
            process.wait(timeout=30)
        self.folder.cleanup()


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One pass's tokens/s (first start to last end over all clients) and pooled gap percentiles."""
    gaps = array.array("f")
    for result in results:
        gaps.frombytes(result["gaps"])
    began = min(r["began"] for r in results)
    wall = max(r["ended"] for r in results) - began
    tokens = sum(r["tokens"] for r in results)
    values = sorted(gaps)
    firsts = sorted(f - began for r in results for f in r.get("firsts", []))  # CLOCK_MONOTONIC: one clock
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "first_token_p50_ms": statistics.median(firsts) * 1e3 if firsts else 0.0,
        "first_token_max_ms": firsts[-1] * 1e3 if firsts else 0.0,
        "itl_mean_ms": statistics.fmean(values) * 1e3 if values else 0.0,
        "itl_p50_ms": statistics.median(values) * 1e3 if values else 0.0,
        "itl_p99_ms": values[min(len(values) - 1, int(len(values) * 0.99))] * 1e3 if values else 0.0,
        "gaps": values,
    }


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU time of a process so far (``/proc/PID/stat``, 10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    return sum(cpu_split(pid))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", choices=["worker", "client", "floor"])
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--frame-tokens", type=int, default=1)
    parser.add_argument("--events", choices=["token", "tokens", "link"], default="token")
    args = parser.parse_args()
    if args.role == "worker":
        serve_worker(args.step_ms / 1e3, args.frame_tokens, args.events)
    elif args.role == "floor":
        serve_floor(args.step_ms / 1e3, args.frame_tokens)
    else:
        client_main()


if __name__ == "__main__":
    main()
