"""The router's own HTTP/1.1 server (``server="belayer"``), review fixes: a streamed event is
rendered exactly once when a direct write is refused (HTTP/1.0, HEAD: stateful OpenAI renderers);
idle keep-alive and request-head timeouts; an app's own ``transfer-encoding: chunked``; no
``100 Continue`` after the response head; configuration and lifespan errors are typed."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import httpx
import pytest
from router_helpers import exchange

from belayer_router import (
    ByteTokenizer,
    InvalidRequestError,
    RouterClient,
    RouterConfig,
    ServerConfigError,
    ServerStartupError,
    bind_socket,
    running_router,
    serve_asgi,
    serving,
)
from belayer_router.asgi import Receive, Send
from belayer_router.testing import expected_tokens, running_worker

pytestmark = pytest.mark.anyio


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


@pytest.fixture
async def router() -> AsyncIterator[str]:
    """A router on the belayer server with a byte tokenizer and one worker registered."""
    config = RouterConfig(tokenizer=ByteTokenizer())
    async with (
        running_router(config, server="belayer") as (url, _),
        running_worker(1) as (worker_url, _),
        RouterClient(url) as client,
    ):
        await client.register("s", worker_url, 1)
        yield url


def _sse_text(body: bytes) -> tuple[str, list[int]]:
    """The concatenated text and token ids of a streamed /v1/completions body."""
    text, ids = "", list[int]()
    for line in body.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            text += choice["text"]
            ids += choice.get("token_ids") or []
    return text, ids


async def test_streamed_completions_over_http10_are_rendered_once(router: str) -> None:
    """HTTP/1.0 refuses every direct write: the text must still be whole and right (the OpenAI
    renderer keeps state, so a second rendering of a token lost or garbled its text)."""
    seed, num_tokens = 4, 40
    body = json.dumps(
        {"model": "m", "prompt": [1, 2], "max_tokens": num_tokens, "seed": seed, "stream": True}
    ).encode()
    head = b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    answer = await exchange(_address(router), head % len(body) + body)
    assert answer.startswith(b"HTTP/1.1 200 ")
    text_10, ids_10 = _sse_text(answer.partition(b"\r\n\r\n")[2])
    async with httpx.AsyncClient(timeout=60) as http:  # the same over HTTP/1.1 (direct writes)
        response = await http.post(f"{router}/v1/completions", content=body)
    text_11, ids_11 = _sse_text(response.content)
    expected = expected_tokens(seed, num_tokens)
    assert ids_10 == ids_11 == expected
    assert text_10 == text_11 == ByteTokenizer().decode(expected)
    assert len(text_10) > 0


async def test_a_refused_direct_write_is_not_rendered_again_on_http10_and_head() -> None:
    from belayer_router._server._asgi import direct_writer, stream_response

    num_events = 200
    rendered: dict[str, list[int]] = {}

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        seen = rendered.setdefault(f"{scope['method']} {scope['http_version']}", [])

        async def produce(emit: Any) -> None:
            for index in range(num_events):
                emit(index)
                await anyio.lowlevel.checkpoint()

        def render(events: list[int]) -> bytes:  # stateful: counts what it rendered
            lines = []
            for index in events:
                seen.append(index)
                lines.append(b"%d:%d\n" % (index, len(seen)))
            return b"".join(lines)

        await stream_response(
            receive, send, produce, render, lambda e: b"", "text/plain", direct_writer(scope)
        )

    async with serving(app, server="belayer") as url:
        old = await exchange(_address(url), b"GET / HTTP/1.0\r\n\r\n")
        head = await exchange(_address(url), b"HEAD / HTTP/1.1\r\nConnection: close\r\n\r\n")
    lines = old.partition(b"\r\n\r\n")[2].split(b"\n")[:-1]
    assert lines == [b"%d:%d" % (i, i + 1) for i in range(num_events)]
    assert rendered["GET 1.0"] == list(range(num_events))
    assert head.startswith(b"HTTP/1.1 200 ")
    assert head.endswith(b"\r\n\r\n")  # no body
    assert rendered["HEAD 1.1"] == list(range(num_events))


async def _closed_by_server(stream: anyio.abc.ByteStream) -> bytes:
    received = b""
    with anyio.fail_after(60):
        while True:
            try:
                received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return received


async def _hello(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        raise RuntimeError("no lifespan")
    if scope["path"] == "/slow":
        await anyio.sleep(1.5)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_an_idle_keep_alive_connection_is_closed_a_busy_one_is_not() -> None:
    async with serving(_hello, server="belayer", keep_alive_s=0.5) as url:
        async with await anyio.connect_tcp(*_address(url)) as silent:  # never sends a byte
            assert await _closed_by_server(silent) == b""
        async with await anyio.connect_tcp(*_address(url)) as stream:
            # a request running longer than the idle timeout is answered; then the idle
            # connection is closed after it
            await stream.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await _closed_by_server(stream)
        assert answer.startswith(b"HTTP/1.1 200 ")
        assert answer.endswith(b"\r\n\r\nhello")
        async with httpx.AsyncClient(timeout=60) as http:  # still serving
            assert (await http.get(url)).text == "hello"


async def test_a_request_head_not_complete_in_time_gets_a_408() -> None:
    from belayer_router._server._http import HttpServer

    server = HttpServer(_hello, keep_alive_s=60, head_timeout_s=0.5)
    with bind_socket("127.0.0.1", 0) as sock:
        await server.listen(sock)
        try:
            async with await anyio.connect_tcp(*sock.getsockname()[:2]) as stream:
                await stream.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and no more
                answer = await _closed_by_server(stream)
        finally:
            await server.close(grace_s=0)
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in answer.lower()
    with pytest.raises(ServerConfigError):
        HttpServer(_hello, keep_alive_s=0)


async def test_an_apps_own_chunked_header_gets_chunk_framing_and_no_late_100_continue() -> None:
    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        headers = [(b"transfer-encoding", b"chunked")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"one,", "more_body": True})
        if scope["path"] == "/expect":  # answered before reading the body, then reads
            with anyio.move_on_after(0.2):
                await receive()
        await send({"type": "http.response.body", "body": b"two"})

    async with serving(app, server="belayer") as url, httpx.AsyncClient(timeout=60) as http:
        response = await http.get(url)
        assert response.text == "one,two"
        old = await exchange(_address(url), b"GET / HTTP/1.0\r\n\r\n")  # 1.0: no chunks
        expect = b"POST /expect HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        answer = await exchange(_address(url), expect)
    assert old.partition(b"\r\n\r\n")[2] == b"one,two"
    assert b"transfer-encoding" not in old.lower()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert b"100 Continue" not in answer
    assert answer.endswith(b"4\r\none,\r\n3\r\ntwo\r\n0\r\n\r\n")


async def test_configuration_and_lifespan_errors_are_typed() -> None:
    from belayer_router._server._serve import choose_server

    with pytest.raises(ServerConfigError) as unknown:
        choose_server("nginx")
    assert not isinstance(unknown.value, InvalidRequestError)  # not a client's HTTP 400
    assert "belayer" in str(unknown.value)

    async def failing(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        assert scope["type"] == "lifespan"
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no weights"})

    sock = bind_socket("127.0.0.1", 0)
    with sock, pytest.raises(ServerStartupError, match="no weights"), anyio.fail_after(60):
        await serve_asgi(failing, sock, server="belayer")
