"""The load of ``bench_router.py``: the paced worker and the client processes.

    python benchmarks/loadgen.py worker [--step-ms 30] [--frame-tokens 1] [--events link]
    python benchmarks/loadgen.py floor [--step-ms 30] [--frame-tokens 1]
    python benchmarks/loadgen.py client        (driven by `ClientPool` over stdin/stdout)

The worker prints its URL and serves ``POST /generate`` (``token`` lines or ``tokens`` frames) and
the router's worker link (``POST /link``: one ``STEP`` frame per step for all its requests).  A
client process streams the requests it is given over raw HTTP/1.1 connections (an asyncio protocol
and httptools' C parser, uvloop when installed: the generator must not be the bottleneck) and
returns its token count, first/last times and inter-token gaps; `ClientPool` runs several of them
at once, starts them together and merges their results.

The floor (`serve_floor`) is the least a Python process can do to stream the router's tokens to
its clients: it answers the router's ``POST /generate`` (one JSON parse per request) with the
router's response head and, every ``--step-ms``, writes each stream the bytes of the router's
``tokens`` (or ``token``) event, chunk-framed, with one ``transport.write`` per stream per step
(uvloop, an asyncio Protocol, httptools).  No worker, no journal, no parsing per token: its CPU
per token is what one write per token per client connection costs on this machine.
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
from belayer_router.worker import LINK_PATH, LinkSubmit, encode_step, read_link_frames

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


class _FloorConnection(asyncio.Protocol):
    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.stream: _FloorStream | None = None

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

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        self.transport.write(_FLOOR_HEAD)
        self.stream = _FloorStream(self.transport, orjson.loads(b"".join(self.body)))
        self.floor.add(self.stream)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.floor.streams.pop(self.stream, None)


class Floor:
    """Every ``step`` s (a fixed schedule; as fast as it can when behind or unpaced) one chunk per
    running stream with its next ``frame`` tokens' event."""

    def __init__(self, step: float, frame: int) -> None:
        self.step, self.frame = step, frame
        self.streams: dict[_FloorStream, None] = {}  # insertion ordered, O(1) removal
        self.wake: asyncio.Future[None] | None = None

    def add(self, stream: _FloorStream) -> None:
        self.streams[stream] = None
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

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        frame, streams = self.frame, self.streams
        deadline = loop.time()
        while True:
            if not streams:
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


def _request(url: str, body: dict[str, Any]) -> tuple[str, int, bytes]:
    parts = urlsplit(url)
    payload = orjson.dumps(body)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    return parts.hostname or "127.0.0.1", parts.port or 80, head.encode() + payload


async def _stream_all(requests: list[tuple[str, int, bytes]]) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    firsts: list[float] = []

    async def one(host: str, port: int, request: bytes) -> int:
        done: asyncio.Future[int] = loop.create_future()
        await loop.create_connection(lambda: _Stream(request, done, gaps, firsts), host, port)
        return await done

    began = time.monotonic()
    counts = await asyncio.wait_for(asyncio.gather(*(one(*r) for r in requests)), CLIENT_TIMEOUT_S)
    ended = time.monotonic()
    return {
        "began": began,
        "ended": ended,
        "tokens": sum(counts),
        "firsts": firsts,
        "gaps": array.array("f", gaps),
    }


def client_main() -> None:
    """Serve jobs from stdin: ``{"requests": [[url, body], ...], "gaps": path}``, then ``go``; write
    the gaps (float32) to the path, answer one JSON line with the times and the token count."""
    run = _loop_run()
    for line in sys.stdin:
        job = json.loads(line)
        requests = [_request(url, body) for url, body in job["requests"]]
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        result = run(_stream_all(requests))
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

    def run(self, requests: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
        """Stream ``requests`` (``(url, body)``, split round robin) at once; tokens/s and gaps."""
        shares = [requests[i :: len(self.processes)] for i in range(len(self.processes))]
        busy = [(p, share) for p, share in zip(self.processes, shares, strict=True) if share]
        for number, (process, share) in enumerate(busy):
            assert process.stdin is not None
            job = {"requests": share, "gaps": str(Path(self.folder.name) / f"gaps-{number}")}
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
