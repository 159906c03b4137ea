"""`RouterClient(multiplex=True)`: every generation of one client on ONE client link.

Real routers (in-process, and `belayer-router serve` processes for the restart), real FakeWorkers,
on both HTTP servers.  What a multiplexed call yields must equal what the HTTP path yields.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import anyio
import anyio.abc
import attrs
import httptools
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter

from belayer_router import (
    BelayerRouterError,
    FinishEvent,
    InvalidRequestError,
    RouterClient,
    RouterClientError,
    RouterConfig,
    RouterFleet,
    TokenEvent,
    running_router,
    serving,
)
from belayer_router._client._calls import MAX_HANDLE, Call, Conn
from belayer_router._wire._frames import (
    FrameBuffer,
    OpenFrame,
    decode_client_frame,
    encode_cancel,
    encode_finish,
    encode_tokens,
)
from belayer_router.testing import expected_tokens, logprob_of, running_worker, token_at, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers

Events = list[TokenEvent | FinishEvent]


@asynccontextmanager
async def tcp_server(handler: Callable[[anyio.abc.SocketStream], Awaitable[None]]) -> AsyncIterator[str]:
    """Serve ``handler`` per connection on a loopback port; yields the server's http:// URL."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, handler)
        try:
            yield f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        finally:
            group.cancel_scope.cancel()


@attrs.define
class CountingProxy:
    """A TCP proxy in front of the router that counts the client connections it carries."""

    url: str = ""
    num_connections: int = 0


@asynccontextmanager
async def counting_proxy(router_url: str) -> AsyncIterator[CountingProxy]:
    host, port = router_url.removeprefix("http://").rsplit(":", 1)
    proxy = CountingProxy()

    async def pipe(source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream) -> None:
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            async for data in source:
                await sink.send(data)
        with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await sink.send_eof()

    async def carry(client: anyio.abc.SocketStream) -> None:
        proxy.num_connections += 1
        async with (
            client,
            await anyio.connect_tcp(host, int(port)) as upstream,
            anyio.create_task_group() as group,
        ):
            group.start_soon(pipe, client, upstream)
            group.start_soon(pipe, upstream, client)

    async with tcp_server(carry) as proxy.url:
        yield proxy


async def _events(client: RouterClient | RouterFleet, max_tokens: int, **options: Any) -> Events:
    return [event async for event in client.generate_stream([1, 2], max_tokens, **options)]


def _check_exact(events: Events, seed: int, max_tokens: int) -> None:
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [e.token_id for e in tokens] == expected_tokens(seed, max_tokens)
    assert [e.index for e in tokens] == list(range(max_tokens))
    assert [e.logprob for e in tokens] == [logprob_of(e.token_id) for e in tokens]
    assert isinstance(events[-1], FinishEvent)
    assert events[-1].num_generated_tokens == max_tokens


async def _drain(client: RouterClient, seed: int, request_id: str, on_token: Callable[[], None]) -> None:
    """Stream a (practically) endless request, calling ``on_token`` per token."""
    async for _ in client.generate_stream([1], 100_000, seed=seed, request_id=request_id):
        on_token()


def _num_connects(client: RouterClient) -> int:
    """How many client links ``client`` opened."""
    assert client._link is not None
    return client._link.num_connects


def _without_id(events: Events) -> Events:
    return [attrs.evolve(e, request_id="") if isinstance(e, FinishEvent) else e for e in events]


def test_a_multiplexed_client_needs_a_plain_http_url() -> None:
    with pytest.raises(InvalidRequestError, match="plain http://"):
        RouterClient("https://router.example:8000", multiplex=True)
    RouterClient("https://router.example:8000")  # the HTTP path takes it


async def test_many_streams_share_one_connection_and_equal_the_http_path() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.002) as (link_url, _link_worker),
        running_worker(1, token_delay_s=0.002, frame_tokens=3) as (plain_url, _plain_worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        counting_proxy(router_url) as proxy,
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as http,
        RouterClient(proxy.url, multiplex=True) as mux,
    ):
        await http.register("a", link_url, 1, link=True)
        await http.register("b", plain_url, 1)
        results: dict[tuple[str, int], Events] = {}

        async def one(client: RouterClient, name: str, seed: int) -> None:
            results[name, seed] = await _events(client, 30, seed=seed, request_id=f"{name}-{seed}")

        async with anyio.create_task_group() as group:
            for seed in range(100):
                group.start_soon(one, mux, "mux", seed)
                group.start_soon(one, http, "http", seed)
        for seed in range(100):
            _check_exact(results["mux", seed], seed, 30)
            assert _without_id(results["mux", seed]) == _without_id(results["http", seed])
        assert proxy.num_connections == 1
        assert app.metrics.num_client_links == 1  # the router's view: one link, still open
        assert _num_connects(mux) == 1


async def test_generate_over_the_link_returns_the_http_paths_completion() -> None:
    async with (
        running_worker(1, link=True) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as http,
        RouterClient(router_url, multiplex=True) as mux,
    ):
        await http.register("s", url, 1, link=True)
        stop = token_at(5, 7)
        over_link = await mux.generate([3, 4], 20, seed=5, stop_token_ids=[stop], request_id="m")
        over_http = await http.generate([3, 4], 20, seed=5, stop_token_ids=[stop], request_id="h")
        assert over_link.token_ids == expected_tokens(5, 20, (stop,))
        assert over_link.finish_reason == "stop"
        assert attrs.evolve(over_link, request_id="h") == over_http
        length = await mux.generate([3, 4], 12, seed=9)
        assert length.token_ids == expected_tokens(9, 12)
        assert length.logprobs == [logprob_of(t) for t in length.token_ids]
        assert length.finish_reason == "length"


async def test_an_error_fails_only_its_own_call() -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, max_prompt_tokens=8)
    async with (
        running_worker(1, link=True, token_delay_s=0.005) as (url, _worker),
        running_router(config) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        results: dict[int, Events] = {}
        failures: list[RouterClientError] = []

        async def one(seed: int) -> None:
            results[seed] = await _events(client, 25, seed=seed)

        async def too_long() -> None:
            with pytest.raises(RouterClientError) as caught:
                await client.generate(list(range(9)), 5, seed=1)
            failures.append(caught.value)

        async with anyio.create_task_group() as group:
            for seed in range(4):
                group.start_soon(one, seed)
            group.start_soon(too_long)
        assert [error.status for error in failures] == [400]
        assert "max_prompt_tokens" in failures[0].message
        for seed in range(4):
            _check_exact(results[seed], seed, 25)
        assert _num_connects(client) == 1  # the link went on


async def test_leaving_a_stream_early_cancels_it_and_releases_its_record() -> None:
    async with (
        # Streams pause at index 50 until resumed: the left one is still running when it is cancelled.
        running_worker(1, link=True, token_delay_s=0.005, pause_at=50) as (url, worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        results: dict[int, Events] = {}
        left: list[TokenEvent | FinishEvent] = []

        async def one(seed: int) -> None:
            results[seed] = await _events(client, 40, seed=seed)

        async def leave() -> None:
            async for event in client.generate_stream([1, 2], 300, seed=77, request_id="left"):
                left.append(event)
                if len(left) == 3:
                    break

        async with anyio.create_task_group() as group:
            for seed in range(4):
                group.start_soon(one, seed)
            group.start_soon(leave)
        for seed in range(4):
            _check_exact(results[seed], seed, 40)
        assert [e.token_id for e in left if isinstance(e, TokenEvent)] == expected_tokens(77, 3)
        await wait_until(lambda: not app.journal.records["left"].in_flight, 60)
        await wait_until(lambda: worker.num_aborts == 1, 60)
        assert app.journal.records["left"].finish_reason is None
        worker.resume()
        # Released: the same request id resumes (from its journal) with the exact output.
        _check_exact(await _events(client, 300, seed=77, request_id="left"), 77, 300)


async def test_a_worker_killed_mid_stream_is_invisible_to_the_client() -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=60.0)
    async with (
        running_worker(1, link=True, die_after_total=150, token_delay_s=0.005) as (url, worker),
        running_worker(2, link=True) as (new_url, new_worker),
        running_router(config) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        results: dict[int, Events] = {}

        async def one(seed: int) -> None:
            results[seed] = await _events(client, 30, seed=seed)

        async with anyio.create_task_group() as group:
            for seed in range(12):
                group.start_soon(one, seed)
            with anyio.fail_after(60):
                await worker.died.wait()
            await client.register("s", new_url, 2, link=True)
        for seed in range(12):
            _check_exact(results[seed], seed, 30)
        assert new_worker.requests  # the router resumed them there
        assert _num_connects(client) == 1


async def test_a_router_restart_mid_stream_finishes_every_open_call_exactly(
    tmp_path: Path, router_process: StartRouter
) -> None:
    journal = tmp_path / "router.jsonl"
    router, url = await router_process(journal)
    async with (
        # Every stream pauses at index 20 until resumed: all are open when the router dies.
        running_worker(1, link=True, token_delay_s=0.005, pause_at=20) as (worker_url, worker),
        RouterClient(url, admin_token=ADMIN_TOKEN, reconnect_timeout_s=60, multiplex=True) as client,
    ):
        await client.register("s", worker_url, 1, link=True)
        counts = dict.fromkeys(range(32), 0)
        results: dict[int, Events] = {}

        async def one(seed: int) -> None:
            events: Events = []
            async for event in client.generate_stream([1, 2], 60, seed=seed, request_id=f"r{seed}"):
                events.append(event)
                counts[seed] += 1
            results[seed] = events

        async with anyio.create_task_group() as group:
            for seed in counts:
                group.start_soon(one, seed)
            await wait_until(lambda: min(counts.values()) >= 20, 60)
            router.kill()  # SIGKILL mid-stream: the link breaks, the calls reconnect
            await router.wait()
            await router_process(journal, int(url.rsplit(":", 1)[1]))
            worker.resume()
        for seed in counts:
            _check_exact(results[seed], seed, 60)
            finish = results[seed][-1]
            assert isinstance(finish, FinishEvent)
            assert finish.num_resumes >= 1
        assert _num_connects(client) == 2


async def test_a_link_error_fails_every_open_call_without_a_reconnect() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.01) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        failures: dict[int, RouterClientError] = {}
        counts = dict.fromkeys(range(3), 0)

        async def one(seed: int) -> None:
            def count() -> None:
                counts[seed] += 1

            with pytest.raises(RouterClientError) as caught:
                await _drain(client, seed, f"e{seed}", count)
            failures[seed] = caught.value

        async with anyio.create_task_group() as group:
            for seed in counts:
                group.start_soon(one, seed)
            await wait_until(lambda: min(counts.values()) >= 2, 60)
            assert client._link is not None
            assert client._link.conn is not None
            client._link.conn.outbox.send_nowait(encode_cancel(10_000))  # a client bug: never opened
        assert {seed: error.status for seed, error in failures.items()} == dict.fromkeys(counts, 400)
        assert all("never opened" in error.message for error in failures.values())
        assert _num_connects(client) == 1  # no reconnect
        await wait_until(lambda: not any(app.journal.records[f"e{seed}"].in_flight for seed in counts), 60)
        # The next call opens a new link.
        _check_exact(await _events(client, 10, seed=4), 4, 10)
        assert _num_connects(client) == 2


async def test_a_router_that_stays_away_fails_the_open_calls_after_the_reconnect_window(
    tmp_path: Path, router_process: StartRouter
) -> None:
    router, url = await router_process(tmp_path / "router.jsonl")
    async with (
        running_worker(1, link=True, token_delay_s=0.005, pause_at=5) as (worker_url, _worker),
        RouterClient(url, admin_token=ADMIN_TOKEN, reconnect_timeout_s=1.0, multiplex=True) as client,
    ):
        await client.register("s", worker_url, 1, link=True)
        counts = dict.fromkeys(range(3), 0)
        failures: dict[int, RouterClientError] = {}

        async def one(seed: int) -> None:
            def count() -> None:
                counts[seed] += 1

            with pytest.raises(RouterClientError) as caught:
                await _drain(client, seed, f"w{seed}", count)
            failures[seed] = caught.value

        async with anyio.create_task_group() as group:
            for seed in counts:
                group.start_soon(one, seed)
            await wait_until(lambda: min(counts.values()) >= 5, 60)  # every stream paused, open
            router.kill()
            await router.wait()
        assert {seed: error.status for seed, error in failures.items()} == dict.fromkeys(counts, 503)
        assert all("reconnect_timeout_s=1" in error.message for error in failures.values())
        assert counts == dict.fromkeys(counts, 5)
        assert _num_connects(client) == 1


@asynccontextmanager
async def fake_hung_router(head: bytes = b"") -> AsyncIterator[tuple[str, list[int]]]:
    """Stands in for a hung router (no real one hangs on purpose): it accepts connections, sends
    ``head`` (a response head, or nothing), reads what comes and sends nothing more.  Yields its
    URL and the list of connections it took."""
    taken: list[int] = []

    async def hang(client: anyio.abc.SocketStream) -> None:
        taken.append(1)
        async with client:
            if head:
                await client.send(head)
            with suppress(anyio.BrokenResourceError, anyio.EndOfStream):
                async for _ in client:
                    pass

    async with tcp_server(hang) as url:
        yield url, taken


async def test_a_silent_router_breaks_the_link_after_timeout_s_and_the_calls_reconnect() -> None:
    async with (
        fake_hung_router() as (url, taken),
        RouterClient(url, timeout_s=0.5, reconnect_timeout_s=2.0, multiplex=True) as client,
    ):
        with pytest.raises(RouterClientError, match="did not come back") as caught:
            await client.generate([1], 5, seed=1)
        assert caught.value.status == 503
        # Connected, silent for timeout_s, broken, connected again: only a read timeout does that.
        # (On a loaded machine a connect may time out too: the fake may count one more.)
        assert _num_connects(client) >= 2
        assert len(taken) >= _num_connects(client)


@asynccontextmanager
async def fake_link_router(answer: Callable[[list[OpenFrame]], bytes]) -> AsyncIterator[str]:
    """Stands in for a router whose frames the client must take apart (the real one's batching
    is not deterministic): it reads two OPENs, then sends the response ``answer(opens)`` (chunked
    as one body chunk) in 7-byte pieces, so HTTP chunks and frames arrive cut anywhere."""

    async def serve(client: anyio.abc.SocketStream) -> None:
        body = FrameBuffer()
        opens: list[OpenFrame] = []

        class Request:
            def on_body(self, data: bytes) -> None:
                for kind, payload in body.feed(data):
                    frame = decode_client_frame(kind, payload)
                    if isinstance(frame, OpenFrame):
                        opens.append(frame)

        parser = httptools.HttpRequestParser(Request())
        async with client:
            while len(opens) < 2:
                parser.feed_data(await client.receive())
            payload = answer(opens)
            data = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            data += b"%x\r\n%b\r\n" % (len(payload), payload)
            for start in range(0, len(data), 7):
                await client.send(data[start : start + 7])
                await anyio.sleep(0.001)
            with suppress(anyio.BrokenResourceError, anyio.EndOfStream):
                async for _ in client:
                    pass

    async with tcp_server(serve) as url:
        yield url


def _finish(frame: OpenFrame, num_tokens: int) -> bytes:
    payload = {
        "request_id": frame.body["request_id"],
        "finish_reason": "length",
        "num_prompt_tokens": 1,
        "num_generated_tokens": num_tokens,
        "num_resumes": 0,
    }
    return encode_finish(frame.handle, payload)


def _interleaved(opens: list[OpenFrame]) -> bytes:
    a, b = sorted(opens, key=lambda frame: frame.body["seed"])
    return b"".join(
        [
            # One request in two entries of one frame, and a FINISH in the same chunk as tokens.
            encode_tokens([(a.handle, 0, [10, 11], [-1.0, -1.5]), (b.handle, 0, [20], [-2.0])]),
            encode_tokens([(a.handle, 2, [12], [-0.25]), (b.handle, 1, [21, 22], [-3.0, -3.5])]),
            _finish(a, 3),
            encode_tokens([(b.handle, 3, [23], [-4.0])]),
            _finish(b, 4),
        ]
    )


async def test_frames_cut_anywhere_and_a_request_in_several_entries_arrive_in_order() -> None:
    async with fake_link_router(_interleaved) as url, RouterClient(url, multiplex=True) as client:
        results: dict[int, Events] = {}

        async def one(seed: int) -> None:
            results[seed] = await _events(client, 4, seed=seed, request_id=f"q{seed}")

        async with anyio.create_task_group() as group:
            group.start_soon(one, 1)
            group.start_soon(one, 2)
    assert results[1][:-1] == [TokenEvent(0, 10, -1.0), TokenEvent(1, 11, -1.5), TokenEvent(2, 12, -0.25)]
    assert results[1][-1] == FinishEvent("q1", "length", 1, 3, 0)
    assert [(e.index, e.token_id) for e in results[2] if isinstance(e, TokenEvent)] == [
        (0, 20),
        (1, 21),
        (2, 22),
        (3, 23),
    ]


async def test_a_malformed_router_frame_fails_every_open_call() -> None:
    def bad(opens: list[OpenFrame]) -> bytes:
        return encode_tokens([(opens[0].handle, 0, [1], [-1.0])]) + b"\x01\x00\x00\x00\x63"  # kind 99

    async with fake_link_router(bad) as url, RouterClient(url, multiplex=True) as client:
        failures: list[RouterClientError] = []

        async def one(seed: int) -> None:
            with pytest.raises(RouterClientError) as caught:
                await client.generate([1], 4, seed=seed)
            failures.append(caught.value)

        async with anyio.create_task_group() as group:
            group.start_soon(one, 1)
            group.start_soon(one, 2)
    assert [error.status for error in failures] == [502, 502]
    assert all("malformed client link" in error.message for error in failures)
    assert _num_connects(client) == 1  # no reconnect


async def test_closing_the_client_fails_its_open_calls_clearly() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.01) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        failures: list[RouterClientError] = []
        started = anyio.Event()

        async def one() -> None:
            with pytest.raises(RouterClientError) as caught:
                await _drain(client, 3, "open", started.set)
            failures.append(caught.value)

        async with anyio.create_task_group() as group:
            group.start_soon(one)
            with anyio.fail_after(60):
                await started.wait()
            await client.aclose()
        assert [error.status for error in failures] == [499]
        assert "closed" in failures[0].message
        await wait_until(lambda: not app.journal.records["open"].in_flight, 60)  # the router let go


async def test_an_error_in_the_clients_block_comes_out_as_itself() -> None:
    async with (
        running_worker(1, link=True) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, _app),
    ):

        async def use_then_fail() -> None:
            async with RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client:
                await client.register("s", url, 1, link=True)
                _check_exact(await _events(client, 5, seed=1), 1, 5)
                raise LookupError("the caller's own error")

        with pytest.raises(LookupError, match="the caller's own error"):  # not in an ExceptionGroup
            await use_then_fail()


async def test_a_router_without_the_client_link_says_so() -> None:
    async def older_router(scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Stands in for an older router version (outside this package's tree): no /client-link."""
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b'{"error": {"message": "no route POST /client-link", "status": 404}}'
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": body})

    async with (
        serving(older_router, log_level="critical") as url,
        RouterClient(url, multiplex=True) as client,
    ):
        with pytest.raises(RouterClientError, match="does not serve the client link") as caught:
            await client.generate([1], 5, seed=1)
        assert caught.value.status == 404
        assert "multiplex=False" in caught.value.message


async def test_a_fleet_of_multiplexed_clients() -> None:
    async with (
        running_worker(1, link=True) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (url0, _app0),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (url1, _app1),
        RouterFleet([url0, url1], admin_token=ADMIN_TOKEN, multiplex=True) as fleet,
    ):
        await fleet.register("s", url, 1, link=True)
        results: dict[int, Events] = {}

        async def one(seed: int) -> None:
            results[seed] = await _events(fleet, 10, seed=seed, request_id=f"f{seed}")

        async with anyio.create_task_group() as group:
            for seed in range(16):
                group.start_soon(one, seed)
        for seed in range(16):
            _check_exact(results[seed], seed, 10)
        assert [_num_connects(client) for client in fleet.clients] == [1, 1]


async def test_a_multiplexed_client_must_be_entered() -> None:
    client = RouterClient("http://127.0.0.1:9", multiplex=True)
    with pytest.raises(InvalidRequestError, match="async with"):
        await client.generate([1], 5)
    await client.aclose()


async def test_a_call_opening_as_the_links_writer_fails_reconnects_instead_of_raising() -> None:
    """The writer closes the link's outgoing queue when its send fails (a reset) a loop turn
    before the reader marks the link broken: a call opening in that turn got an untyped
    `BrokenResourceError` and no reconnect; a call leaving then raised it from its CANCEL."""
    conn = Conn(cast(Any, None))
    await conn.outgoing.aclose()  # what the failed writer's `async with` leaves
    call = Call({"prompt_token_ids": [1], "max_tokens": 4})
    with pytest.raises(ConnectionError):  # an OSError: `ClientMux.stream` reconnects on it
        conn.open(call)
    assert conn.broken
    assert not conn.calls
    assert call.conn is None
    leaving = Call({"prompt_token_ids": [2], "max_tokens": 4}, handle=7, conn=conn)
    conn.calls[7], conn.broken = leaving, False
    conn.cancel(leaving)  # nothing raised: the broken link cancels it anyway
    assert not conn.calls
    assert leaving.conn is None


@attrs.define
class ScriptedLinkRouter:
    """What `scripted_link_router` received: every OPEN and the handles of every CANCEL."""

    url: str = ""
    opens: list[OpenFrame] = attrs.field(factory=list)
    cancels: list[int] = attrs.field(factory=list)


@asynccontextmanager
async def scripted_link_router(
    script: Callable[[OpenFrame, int], list[tuple[float, bytes]]],
) -> AsyncIterator[ScriptedLinkRouter]:
    """Stands in for a router that serves one stream and keeps another stuck (no real router
    starves one request of a live link on purpose).  For each OPEN it sends ``script(open, n)``
    (``n``: how many OPENs of that request came before), each frame after its delay, as one
    chunk; it records every OPEN and CANCEL."""
    router = ScriptedLinkRouter()

    async def serve(client: anyio.abc.SocketStream) -> None:
        body = FrameBuffer()
        lock = anyio.Lock()
        seen: dict[str, int] = {}

        async def play(frames: list[tuple[float, bytes]]) -> None:
            for delay, frame in frames:
                await anyio.sleep(delay)
                async with lock:
                    await client.send(b"%x\r\n%b\r\n" % (len(frame), frame))

        async with client, anyio.create_task_group() as group:

            class Request:
                def on_body(self, data: bytes) -> None:
                    for kind, payload in body.feed(data):
                        frame = decode_client_frame(kind, payload)
                        if isinstance(frame, OpenFrame):
                            router.opens.append(frame)
                            request_id = frame.body["request_id"]
                            group.start_soon(play, script(frame, seen.get(request_id, 0)))
                            seen[request_id] = seen.get(request_id, 0) + 1
                        else:
                            router.cancels.append(frame.handle)

            parser = httptools.HttpRequestParser(Request())
            await client.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            with suppress(anyio.BrokenResourceError, anyio.EndOfStream):
                async for data in client:
                    parser.feed_data(data)
            group.cancel_scope.cancel()

    async with tcp_server(serve) as router.url:
        yield router


def _stuck_and_streaming(resume_the_stuck_one: bool) -> Callable[[OpenFrame, int], list[tuple[float, bytes]]]:
    """Request "live" gets 30 tokens 0.05 s apart; request "stuck" gets 2 tokens, then nothing
    (or, re-OPENed, ``resume_the_stuck_one``: its remaining 3 tokens and its FINISH)."""

    def script(frame: OpenFrame, num_before: int) -> list[tuple[float, bytes]]:
        handle, body = frame.handle, frame.body
        received = body["num_received_tokens"]
        if body["request_id"] == "live":
            tokens = [(0.05, encode_tokens([(handle, i, [100 + i], [-1.0])])) for i in range(30)]
            return [*tokens, (0.0, _finish(frame, 30))]
        if num_before == 0:
            return [(0.0, encode_tokens([(handle, 0, [7, 8], [-0.5, -0.5])]))]
        if not resume_the_stuck_one:
            return []
        rest = encode_tokens([(handle, received, [9, 10, 11][received - 2 :], [-0.5] * (5 - received))])
        return [(0.0, rest), (0.0, _finish(frame, 5))]

    return script


async def _live_and_stuck(client: RouterClient) -> tuple[Events, Events | RouterClientError]:
    results: dict[str, Any] = {}

    async def stuck() -> None:
        try:
            results["stuck"] = await _events(client, 5, request_id="stuck")
        except RouterClientError as error:
            results["stuck"] = error

    async def live() -> None:
        results["live"] = await _events(client, 30, request_id="live")

    async with anyio.create_task_group() as group:
        group.start_soon(stuck)
        group.start_soon(live)
    return results["live"], results["stuck"]


async def test_a_call_stuck_on_a_live_link_times_out_alone_and_resumes_on_a_new_open() -> None:
    async with (
        scripted_link_router(_stuck_and_streaming(resume_the_stuck_one=True)) as router,
        RouterClient(router.url, timeout_s=0.4, reconnect_timeout_s=5.0, multiplex=True) as client,
    ):
        live, stuck = await _live_and_stuck(client)
    assert [e.token_id for e in live if isinstance(e, TokenEvent)] == [100 + i for i in range(30)]
    assert not isinstance(stuck, RouterClientError)
    assert [(e.index, e.token_id) for e in stuck if isinstance(e, TokenEvent)] == list(
        enumerate([7, 8, 9, 10, 11])
    )
    assert isinstance(stuck[-1], FinishEvent)
    first, again = [frame for frame in router.opens if frame.body["request_id"] == "stuck"]
    assert router.cancels == [first.handle]  # the stuck attempt was cancelled before the new OPEN
    assert again.body["num_received_tokens"] == 2  # and resumed from what the client had
    assert _num_connects(client) == 1  # on the same link: the live stream never noticed


async def test_a_call_that_stays_stuck_raises_504_after_the_reconnect_window() -> None:
    async with (
        scripted_link_router(_stuck_and_streaming(resume_the_stuck_one=False)) as router,
        RouterClient(router.url, timeout_s=0.3, reconnect_timeout_s=0.5, multiplex=True) as client,
    ):
        live, stuck = await _live_and_stuck(client)
    assert isinstance(stuck, RouterClientError)
    assert stuck.status == 504
    assert "'stuck' got nothing" in stuck.message
    assert "timeout_s" in stuck.message
    assert [e.token_id for e in live if isinstance(e, TokenEvent)] == [100 + i for i in range(30)]
    stuck_opens = [frame for frame in router.opens if frame.body["request_id"] == "stuck"]
    assert len(stuck_opens) >= 2
    assert all(frame.body["num_received_tokens"] == 2 for frame in stuck_opens[1:])
    assert router.cancels == [frame.handle for frame in stuck_opens]  # each attempt cancelled
    assert _num_connects(client) == 1


async def test_a_call_the_client_cannot_send_fails_alone() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.005) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        results: dict[int, Events] = {}
        failures: dict[str, BelayerRouterError] = {}

        async def one(seed: int) -> None:
            results[seed] = await _events(client, 25, seed=seed)

        async def bad(name: str, prompt: list[Any]) -> None:
            with pytest.raises(BelayerRouterError) as caught:
                await client.generate(prompt, 5, seed=1, request_id=name)
            failures[name] = caught.value

        async with anyio.create_task_group() as group:
            for seed in range(3):
                group.start_soon(one, seed)
            await wait_until(lambda: len(results) > 0 or _num_connects(client) == 1)
            group.start_soon(bad, "numpy-like", [1, Decimal(2)])  # not JSON: as numpy integers are not
            group.start_soon(bad, "huge", [1234567] * 2_500_000)  # 20 MB: over a link frame's 16 MiB
        assert isinstance(failures["numpy-like"], InvalidRequestError)
        assert "tolist" in str(failures["numpy-like"])
        assert isinstance(failures["huge"], RouterClientError)
        assert failures["huge"].status == 413
        for seed in range(3):
            _check_exact(results[seed], seed, 25)
        assert _num_connects(client) == 1  # no LINK_ERROR, no reconnect


async def test_new_calls_do_not_keep_a_hung_routers_link_alive() -> None:
    async with (
        fake_hung_router() as (url, _taken),
        RouterClient(url, timeout_s=0.5, reconnect_timeout_s=1.0, multiplex=True) as client,
    ):

        async def impatient_callers() -> None:  # a new call every 0.2 s, each given up after 0.2 s
            while True:
                with anyio.move_on_after(0.2):
                    await client.generate([1], 5, seed=2)

        async with anyio.create_task_group() as group:
            group.start_soon(impatient_callers)
            with anyio.fail_after(20), pytest.raises(RouterClientError, match="did not come back") as caught:
                await client.generate([1], 5, seed=1)
            group.cancel_scope.cancel()
        assert caught.value.status == 503
        assert _num_connects(client) >= 2  # the silent link was broken and reconnected


async def test_a_link_that_used_up_its_handles_is_retired_after_its_last_call() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.005) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        _check_exact(await _events(client, 5, seed=0), 0, 5)
        assert client._link is not None
        first = client._link.conn
        assert first is not None
        first.next_handle = MAX_HANDLE  # the last handle this link may use
        results: dict[int, Events] = {}

        async def one(seed: int, max_tokens: int) -> None:
            results[seed] = await _events(client, max_tokens, seed=seed)

        async with anyio.create_task_group() as group:
            group.start_soon(one, 1, 400)  # takes handle 2^32 - 1 on the first link
            await wait_until(lambda: first.next_handle > MAX_HANDLE)
            group.start_soon(one, 2, 10)  # no handle left: a new link
            await wait_until(lambda: 2 in results, 60)
            assert not first.done.is_set()  # the first link still carries its call
        _check_exact(results[1], 1, 400)
        _check_exact(results[2], 2, 10)
        assert _num_connects(client) == 2
        await wait_until(first.done.is_set)  # closed once its last call ended
        await wait_until(lambda: app.metrics.num_client_links == 1)
        _check_exact(await _events(client, 5, seed=3), 3, 5)  # on the second link
        assert _num_connects(client) == 2


async def test_a_retired_link_cancels_a_call_left_early_and_closes_with_the_client() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.005) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN, multiplex=True) as client,
    ):
        await client.register("s", url, 1, link=True)
        _check_exact(await _events(client, 5, seed=0), 0, 5)
        assert client._link is not None
        first = client._link.conn
        assert first is not None
        first.next_handle = MAX_HANDLE - 1  # two handles left
        counts = {"a": 0, "c": 0, "b": 0}
        failures: dict[str, int] = {}
        left = anyio.CancelScope()

        async def one(name: str, seed: int) -> None:
            def count() -> None:
                counts[name] += 1

            try:
                await _drain(client, seed, name, count)
            except RouterClientError as error:
                failures[name] = error.status

        async def leaves_early() -> None:
            with left:
                await one("a", 1)

        async with anyio.create_task_group() as group:
            group.start_soon(leaves_early)  # handle 2^32 - 2 on the first link
            await wait_until(lambda: counts["a"] > 0, 60)
            group.start_soon(one, "c", 2)  # handle 2^32 - 1, the last
            await wait_until(lambda: counts["c"] > 0, 60)
            group.start_soon(one, "b", 3)  # a new link
            await wait_until(lambda: counts["b"] > 0, 60)
            assert _num_connects(client) == 2
            left.cancel()  # the caller of "a" leaves: its CANCEL goes out on the retired link
            await wait_until(lambda: not app.journal.records["a"].in_flight, 60)
            assert app.journal.records["c"].in_flight  # the retired link goes on for "c"
            assert not first.done.is_set()
            await client.aclose()  # ends the calls of both links
        assert failures == {"c": 499, "b": 499}
        assert first.done.is_set()
        await wait_until(lambda: app.metrics.num_client_links == 0, 60)


async def test_the_response_head_and_new_calls_do_not_postpone_a_silent_links_timeout() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"  # and then never a frame
    async with (
        fake_hung_router(head) as (url, _taken),
        RouterClient(url, timeout_s=30, multiplex=True) as client,
    ):
        assert client._link is not None
        link = client._link
        began = anyio.current_time()
        async with anyio.create_task_group() as group:
            group.start_soon(_events, client, 5)
            await wait_until(lambda: link.conn is not None and len(link.conn.calls) == 1)
            conn = link.conn
            assert conn is not None
            await anyio.sleep(0.2)  # the head has arrived by now
            second = anyio.current_time()
            group.start_soon(_events, client, 5)
            await wait_until(lambda: len(conn.calls) == 2)
            assert began <= conn.opened_at < second  # still the first OPEN's time
            assert conn.last_read == -math.inf  # a head is not an answer
            group.cancel_scope.cancel()
