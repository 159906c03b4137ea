"""The router's own HTTP/1.1 server (``server="belayer"``): bad HTTP gets a clean 4xx and a
closed connection, never a crashed server; keep-alive, pipelining, both body framings; the
``belayer.write`` extension writes a streamed response directly and falls back to ``send``
under back-pressure without reordering anything."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import httpx
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter, exchange, read_stderr

from belayer_router import ExitCode, RouterClient, RouterConfig, bind_socket, running_router, serving
from belayer_router.asgi import Receive, Send
from belayer_router.testing import expected_tokens, running_worker, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
async def router() -> AsyncIterator[tuple[str, int]]:
    """A router on the belayer server with one worker registered; ``(host, port)``."""
    config = RouterConfig(max_body_bytes=4096)
    async with (
        running_router(config, server="belayer") as (url, _),
        running_worker(1) as (worker_url, _),
        RouterClient(url) as client,
    ):
        await client.register("s", worker_url, 1)
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port)


async def _still_serving(address: tuple[str, int]) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.get(f"http://{address[0]}:{address[1]}/health")
    assert response.status_code == 200


def _statuses(data: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NOT HTTP AT ALL\r\n\r\n", 400),
        (b"GET /health HTTP/9.7\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
        (b"GET /" + b"p" * 70_000 + b" HTTP/1.1\r\n\r\n", 431),
        (b"POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n", 400),
    ],
    ids=["garbage", "bad-version", "big-header", "big-url", "bad-chunk"],
)
async def test_malformed_http_gets_a_4xx_and_a_closed_connection(
    router: tuple[str, int], request_bytes: bytes, status: int
) -> None:
    answer = await exchange(router, request_bytes)
    assert _statuses(answer) == [status]
    assert b"connection: close" in answer.lower()
    await _still_serving(router)


async def test_an_upgrade_request_is_served_as_plain_http_and_closed(router: tuple[str, int]) -> None:
    upgrade = (
        b"GET /health HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\nGET /x HTTP/1.1\r\n\r\n"
    )
    answer = await exchange(router, upgrade)
    assert _statuses(answer) == [200]
    assert b"connection: close" in answer.lower()
    await _still_serving(router)


async def test_an_oversized_body_is_a_413_and_the_rest_is_not_read(router: tuple[str, int]) -> None:
    body = b'{"prompt_token_ids": [' + b"1," * 100_000 + b"1]}"
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
    answer = await exchange(router, head + body)
    assert _statuses(answer) == [413]
    assert b"max_body_bytes" in answer
    await _still_serving(router)


async def test_a_truncated_body_and_a_vanished_client_leave_the_server_serving(
    router: tuple[str, int],
) -> None:
    with anyio.fail_after(60):
        for partial in (
            b'POST /generate HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{"prompt',
            b'POST /generate HTTP/1.1\r\nContent-Length: 500\r\n\r\n{"prompt_token_ids"',
            b"GET /hea",
        ):
            async with await anyio.connect_tcp(*router) as stream:
                await stream.send(partial)
    await _still_serving(router)


async def test_pipelined_requests_are_answered_in_order_on_one_connection(router: tuple[str, int]) -> None:
    generate = json.dumps({"prompt_token_ids": [1], "max_tokens": 5, "seed": 2, "stream": False}).encode()
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(generate), generate)
    data = (
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(generate), generate)
        + b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        + b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked
        + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    answer = await exchange(router, data)
    assert _statuses(answer) == [200, 200, 404, 200, 200]
    assert answer.count(b'"token_ids":%s' % json.dumps(expected_tokens(2, 5)).replace(" ", "").encode()) == 2


async def test_keep_alive_serves_many_requests_and_streams_on_one_client_connection(
    router: tuple[str, int],
) -> None:
    url = f"http://{router[0]}:{router[1]}"
    limits = httpx.Limits(max_connections=1)
    async with RouterClient(url) as client, httpx.AsyncClient(timeout=60, limits=limits) as http:
        for seed in range(5):
            body = {"prompt_token_ids": [1], "max_tokens": 8, "seed": seed}
            async with http.stream("POST", f"{url}/generate", json=body) as response:
                assert response.headers["transfer-encoding"] == "chunked"
                lines = [json.loads(line) async for line in response.aiter_lines() if line]
            assert [e["token_id"] for e in lines if e["type"] == "token"] == expected_tokens(seed, 8)
            assert (await http.get(f"{url}/health")).status_code == 200
            assert (await client.generate([1], 8, seed=seed)).token_ids == expected_tokens(seed, 8)


async def test_an_app_error_is_a_500_and_an_unfinished_response_closes_the_connection() -> None:
    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["path"] == "/raise":
            raise RuntimeError("the app broke")
        if scope["path"] == "/read-then-raise":
            while (await receive())["type"] != "http.disconnect":
                pass
            raise RuntimeError("the app broke after its client's body went bad")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})

    async with serving(app, server="belayer") as url:
        address = url.removeprefix("http://").rsplit(":", 1)
        host, port = address[0], int(address[1])
        assert _statuses(await exchange((host, port), b"GET /raise HTTP/1.1\r\n\r\n")) == [500]
        bad_body = b"POST /read-then-raise HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZ\r\n"
        assert _statuses(await exchange((host, port), bad_body)) == [400]  # and no 500 after it
        cut = await exchange((host, port), b"GET /cut HTTP/1.1\r\n\r\n")
        assert _statuses(cut) == [200]
        assert cut.endswith(b"7\r\npartial\r\n")  # no terminating chunk: the client sees it cut


async def test_direct_writes_fall_back_to_send_under_back_pressure_in_order() -> None:
    """Every event rendered exactly once, in order, by a stateful renderer (like the OpenAI ones:
    a line carries how many events it has rendered so far), direct writes and refused ones mixed."""
    from belayer_router._server._asgi import direct_writer, stream_response

    num_events, size = 5000, 4000
    counts = {"direct": 0, "refused": 0}
    rendered: list[int] = []
    refused = anyio.Event()

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        write = direct_writer(scope)
        assert write is not None
        assert write(b"x") is False

        def counting(body: bytes) -> bool:
            written = write(body)
            counts["direct" if written else "refused"] += 1
            if not written:
                refused.set()
            return written

        async def produce(emit: Any) -> None:
            for index in range(num_events):
                emit(index)
                if index % 50 == 0:
                    await anyio.lowlevel.checkpoint()

        def render(events: list[int]) -> bytes:
            lines = []
            for i in events:
                rendered.append(i)
                lines.append(b"%06d:%06d:%s\n" % (i, len(rendered), b"y" * size))
            return b"".join(lines)

        await stream_response(receive, send, produce, render, lambda e: b"", "text/plain", counting)

    async with serving(app, server="belayer") as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with anyio.fail_after(120):
            async with await anyio.connect_tcp(host, int(port)) as stream:
                await stream.send(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
                with anyio.fail_after(60):  # read nothing until 20 MB filled the buffers
                    await refused.wait()
                pieces: list[bytes] = []
                while True:
                    try:
                        pieces.append(await stream.receive(1 << 20))
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
    _head, _, body = b"".join(pieces).partition(b"\r\n\r\n")
    chunks, at = [], 0
    while True:  # undo the chunked encoding
        end = body.index(b"\r\n", at)
        length = int(body[at:end], 16)
        chunks.append(body[end + 2 : end + 2 + length])
        at = end + 4 + length
        if length == 0:
            break
    assert at == len(body)
    lines = b"".join(chunks).split(b"\n")[:-1]
    assert [int(line[:6]) for line in lines] == list(range(num_events))
    assert [int(line[7:13]) for line in lines] == list(range(1, num_events + 1))  # rendered once each
    assert rendered == list(range(num_events))
    assert counts["direct"] > 0
    assert counts["refused"] > 0


async def _assert_no_traceback(process: anyio.abc.Process) -> None:
    stderr = await read_stderr(process)
    assert b"Traceback" not in stderr, stderr.decode(errors="replace")
    assert b"CancelledError" not in stderr, stderr.decode(errors="replace")


@pytest.mark.parametrize("server", ["uvicorn", "belayer"])
async def test_sigterm_stops_a_router_process_with_an_open_stream_cleanly(
    tmp_path: Path, router_process: StartRouter, monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    monkeypatch.setenv("BELAYER_ROUTER_SERVER", server)
    journal = tmp_path / "router.jsonl"
    process, url = await router_process(journal)
    async with (
        running_worker(1, token_delay_s=0.05) as (worker_url, _),
        RouterClient(url, admin_token=ADMIN_TOKEN) as client,
        httpx.AsyncClient(timeout=60) as http,
    ):
        await client.register("s", worker_url, 1)
        body = {"prompt_token_ids": [1], "max_tokens": 100_000, "seed": 1, "request_id": "open"}
        with anyio.fail_after(60):
            async with http.stream("POST", f"{url}/generate", json=body) as response:
                lines = response.aiter_lines()
                for _ in range(3):
                    await lines.__anext__()
                process.send_signal(signal.SIGTERM)
                with contextlib.suppress(httpx.HTTPError):
                    async for _ in lines:  # the stream ends: the server cut it at shutdown
                        pass
            assert await process.wait() == ExitCode.INTERRUPTED
    # uvicorn cancelled a stream still open 1 s into its shutdown and logged its CancelledError as
    # an "Exception in ASGI application" traceback; the router now cuts it before that.
    await _assert_no_traceback(process)
    ops = [json.loads(line) for line in journal.read_text().splitlines()]
    assert any(op.get("request_id") == "open" for op in ops)  # journaled, file closed whole


@pytest.mark.parametrize("server", ["uvicorn", "belayer"])
async def test_sigterm_with_a_client_that_stopped_reading_logs_no_traceback(
    tmp_path: Path, router_process: StartRouter, monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    """A cut stream's last chunk waited for room on a connection whose client no longer reads,
    until uvicorn cancelled it and logged a traceback; the cut now gives up on it after a moment."""
    monkeypatch.setenv("BELAYER_ROUTER_SERVER", server)
    process, url = await router_process(tmp_path / "router.jsonl")
    host, port = url.removeprefix("http://").split(":")
    async with (
        running_worker(1) as (worker_url, worker),
        RouterClient(url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", worker_url, 1)
        body = json.dumps({"prompt_token_ids": [1], "max_tokens": 10_000_000, "seed": 1}).encode()
        head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
        with anyio.fail_after(120):
            async with await anyio.connect_tcp(host, int(port)) as stream:
                await stream.send(head + body)
                await stream.receive()  # the head and a first chunk; then this client stops reading
                # Enough tokens for the socket buffers to be full: the router's writes wait.
                await wait_until(lambda: worker.num_tokens_sent > 200_000, limit_s=120)
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == ExitCode.INTERRUPTED
    await _assert_no_traceback(process)


@pytest.mark.parametrize("server", ["uvicorn", "belayer"])
async def test_sigterm_with_open_worker_links_logs_no_traceback(
    tmp_path: Path, router_process: StartRouter, monkeypatch: pytest.MonkeyPatch, server: str
) -> None:
    """The lifespan ends only after the links' tasks: uvicorn logged their CancelledError as an
    "Exception in 'lifespan' protocol" traceback when the shutdown completed before them."""
    monkeypatch.setenv("BELAYER_ROUTER_SERVER", server)
    process, url = await router_process(tmp_path / "router.jsonl")
    async with (
        running_worker(1, link=True, token_delay_s=0.05) as (first_url, _),
        running_worker(1, link=True, token_delay_s=0.05) as (second_url, _),
        RouterClient(url, admin_token=ADMIN_TOKEN) as client,
        httpx.AsyncClient(timeout=60) as http,
    ):
        await client.register("a", first_url, 1, link=True)
        await client.register("b", second_url, 1, link=True)
        with anyio.fail_after(60):
            async with contextlib.AsyncExitStack() as streams:
                for seed in range(4):  # requests on both links
                    body = {"prompt_token_ids": [1], "max_tokens": 100_000, "seed": seed}
                    response = await streams.enter_async_context(
                        http.stream("POST", f"{url}/generate", json=body)
                    )
                    await response.aiter_lines().__anext__()
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == ExitCode.INTERRUPTED
    await _assert_no_traceback(process)


@pytest.mark.parametrize("server", ["belayer", "uvicorn"])
async def test_a_router_serves_on_a_socket_bound_before_it_and_leaves_it_to_its_owner(server: str) -> None:
    # A keeper binds once and hands the socket to each router it starts: the router must serve on
    # exactly that socket (not bind another) and close only its own descriptor.
    kept = bind_socket("127.0.0.1", 0)
    port = kept.getsockname()[1]
    own = kept.dup()  # what a child gets: its own descriptor of the same socket
    try:
        async with running_router(RouterConfig(), sock=own, server=server) as (url, _app):
            assert url == f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
        assert own.fileno() == -1  # closed by the router at its end
        assert kept.fileno() >= 0  # the keeper's descriptor still listens: connections wait in the backlog
        with contextlib.closing(socket.create_connection(("127.0.0.1", port), timeout=5)):
            pass
    finally:
        kept.close()
