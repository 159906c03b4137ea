"""The client link (``POST /client-link``): many generation streams of one client on one connection.

The codec (round trips, malformed frames, a fuzz), then the route on real routers (both servers)
with real `FakeWorker` workers, driven by `LinkTestClient`: a raw-socket client written here.
"""

from __future__ import annotations

import random
import signal
import struct
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import httptools
import httpx
import orjson
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter, read_stderr

from belayer_router import ExitCode, LinkProtocolError, RouterApp, RouterClient, RouterConfig, running_router
from belayer_router._wire._frames import (
    CANCEL,
    CLIENT_LINK_PATH,
    ERROR,
    FINISH,
    LINK_ERROR,
    MAX_LINK_FRAME_BYTES,
    OPEN,
    TOKENS,
    CancelFrame,
    ErrorFrame,
    FinishFrame,
    FrameBuffer,
    LinkErrorFrame,
    OpenFrame,
    TokensFrame,
    decode_client_frame,
    decode_router_frame,
    decode_tokens,
    encode_cancel,
    encode_error,
    encode_finish,
    encode_link_error,
    encode_open,
    encode_tokens,
    pack_tokens,
)
from belayer_router.testing import expected_tokens, logprob_of, running_worker, wait_until

pytestmark = pytest.mark.anyio

# The codec.


def _one(frame: bytes) -> tuple[int, memoryview]:
    [(kind, payload)] = FrameBuffer().feed(frame)
    return kind, payload


def test_client_frames_round_trip() -> None:
    body = {"prompt_token_ids": [1, 2], "max_tokens": 3, "request_id": "é"}
    assert decode_client_frame(*_one(encode_open(7, orjson.dumps(body)))) == OpenFrame(7, body)
    assert decode_client_frame(*_one(encode_cancel(2**32 - 1))) == CancelFrame(2**32 - 1)


def test_router_frames_round_trip() -> None:
    entries = [(0, 3, [5, 6], [-0.5, -1.25]), (4, 0, [9], [-2.0]), (0, 5, [7], [float("-inf")])]
    kind, payload = _one(encode_tokens(entries))
    assert kind == TOKENS
    assert decode_router_frame(kind, payload) == TokensFrame(
        [0, 4, 0], [3, 0, 5], [2, 1, 1], [5, 6, 9, 7], [-0.5, -1.25, -2.0, float("-inf")]
    )
    assert decode_tokens(payload) == decode_router_frame(kind, payload)
    assert pack_tokens([0, 4, 0], [3, 0, 5], [2, 1, 1], [5, 6, 9, 7], [-0.5, -1.25, -2.0, float("-inf")]) == (
        encode_tokens(entries)
    )
    assert decode_tokens(_one(encode_tokens([]))[1]) == TokensFrame([], [], [], [], [])
    finish = {"request_id": "r", "finish_reason": "stop", "num_prompt_tokens": 2}
    assert decode_router_frame(*_one(encode_finish(3, finish))) == FinishFrame(3, finish)
    assert decode_router_frame(*_one(encode_error(3, 400, "bad"))) == ErrorFrame(3, 400, "bad")
    assert decode_router_frame(*_one(encode_link_error(400, "no"))) == LinkErrorFrame(400, "no")


def test_error_messages_are_cut_far_below_the_frame_limit() -> None:
    huge = repr("\x7f" * 4_000_000)  # 16 MB: whole, it would make a frame the client must refuse
    for frame in (encode_error(3, 400, huge), encode_link_error(400, huge)):
        kind, payload = _one(frame)
        decoded = decode_router_frame(kind, payload)
        assert isinstance(decoded, ErrorFrame | LinkErrorFrame)
        assert decoded.status == 400
        assert decoded.message.startswith(huge[:100])
        assert len(decoded.message) < 4200
        assert len(frame) < 6 * 4200  # at most 6 bytes a character in JSON


def test_encode_tokens_refuses_inconsistent_entries() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        encode_tokens([(0, 0, [1, 2], [0.0])])
    with pytest.raises(ValueError, match=r"1\.\.4096"):
        encode_tokens([(0, 0, [], [])])


def _payload(frame: bytes) -> bytes:
    return frame[5:]


GOOD_TOKENS = _payload(encode_tokens([(0, 0, [5], [-1.0])]))
BAD_ROUTER_FRAMES: list[tuple[int, bytes, str]] = [
    (TOKENS, b"\x01\x00", "shorter than its header"),
    (TOKENS, struct.pack("<I", 1000), "cannot hold"),
    (TOKENS, struct.pack("<4I", 1, 0, 0, 0), "must carry"),  # an entry of 0 tokens
    (TOKENS, struct.pack("<4I", 1, 0, 0, 4097) + b"\x00" * 12 * 4097, "must carry"),
    (TOKENS, GOOD_TOKENS[:-3], "must be"),  # truncated
    (TOKENS, GOOD_TOKENS + b"\x00", "must be"),  # trailing
    (FINISH, b"\x01", "no request handle"),
    (FINISH, struct.pack("<I", 1) + b"{", "not JSON"),
    (FINISH, struct.pack("<I", 1) + b"[1]", "JSON object"),
    (ERROR, struct.pack("<I", 1) + b'{"status": "400", "message": "x"}', "integer 'status'"),
    (ERROR, struct.pack("<I", 1) + b'{"status": true, "message": "x"}', "integer 'status'"),
    (LINK_ERROR, b'{"status": 400}', "string 'message'"),
    (LINK_ERROR, b"\xff\xfe", "not JSON"),
    (OPEN, struct.pack("<I", 1) + b"{}", "unknown router link frame kind"),
    (3, b"", "unknown router link frame kind"),
]


@pytest.mark.parametrize(("kind", "payload", "message"), BAD_ROUTER_FRAMES)
def test_malformed_router_frames_are_typed_errors(kind: int, payload: bytes, message: str) -> None:
    with pytest.raises(LinkProtocolError, match=message):
        decode_router_frame(kind, memoryview(payload))


BAD_CLIENT_FRAMES: list[tuple[int, bytes, str]] = [
    (OPEN, b"", "no request handle"),
    (OPEN, b"\x01\x02\x03", "no request handle"),
    (OPEN, struct.pack("<I", 1), "not JSON"),
    (OPEN, struct.pack("<I", 1) + b'{"prompt_token_ids": [1]', "not JSON"),  # truncated
    (OPEN, struct.pack("<I", 1) + b'"text"', "JSON object"),
    (CANCEL, b"\x01", "no request handle"),
    (CANCEL, struct.pack("<I", 1) + b"\x00", "must be 4 bytes"),
    (TOKENS, GOOD_TOKENS, "unknown client link frame kind"),
    (255, b"", "unknown client link frame kind"),
]


@pytest.mark.parametrize(("kind", "payload", "message"), BAD_CLIENT_FRAMES)
def test_malformed_client_frames_are_typed_errors(kind: int, payload: bytes, message: str) -> None:
    with pytest.raises(LinkProtocolError, match=message):
        decode_client_frame(kind, memoryview(payload))


@pytest.mark.parametrize("length", [0, MAX_LINK_FRAME_BYTES + 1, 2**32 - 1])
def test_oversized_and_empty_frame_lengths_are_refused_before_their_bytes(length: int) -> None:
    with pytest.raises(LinkProtocolError, match="link frame of"):
        FrameBuffer().feed(struct.pack("<I", length) + bytes([OPEN]))


def _valid_frames(rng: random.Random) -> list[bytes]:
    entries = [
        (
            rng.randrange(2**32),
            rng.randrange(2**32),
            [rng.randrange(2**32) for _ in range(count)],
            [rng.random()] * count,
        )
        for count in (rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
    ]
    return [
        encode_open(
            rng.randrange(2**32), orjson.dumps({"prompt_token_ids": [1], "max_tokens": rng.randint(1, 9)})
        ),
        encode_cancel(rng.randrange(2**32)),
        encode_tokens(entries),
        encode_finish(rng.randrange(2**32), {"request_id": "x", "finish_reason": "length"}),
        encode_error(rng.randrange(2**32), 503, "none"),
        encode_link_error(400, "bad"),
    ]


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    match rng.randrange(5):
        case 0:  # flip bytes after the length
            for _ in range(rng.randint(1, 4)):
                if len(data) > 4:
                    data[rng.randrange(4, len(data))] = rng.randrange(256)
        case 1:  # truncate the payload, keeping a consistent length
            cut = rng.randrange(5, len(data) + 1) if len(data) > 5 else len(data)
            data = bytearray(struct.pack("<I", cut - 4)) + data[4:cut]
        case 2:  # grow the payload with garbage
            extra = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
            data = bytearray(struct.pack("<I", len(data) - 4 + len(extra))) + data[4:] + extra
        case 3:  # another kind
            data[4] = rng.choice([OPEN, CANCEL, TOKENS, FINISH, ERROR, LINK_ERROR, 0, 1, 3, 22, 255])
        case _:  # pure garbage of a plausible size
            size = rng.randint(1, 64)
            data = bytearray(struct.pack("<IB", size, rng.randrange(256)))
            data += bytes(rng.randrange(256) for _ in range(size - 1))
    return bytes(data)


def test_fuzzed_frames_give_values_or_typed_errors_only() -> None:
    """Random, mutated, truncated and oversized frames, fed in random pieces: each decoder gives
    a value or `LinkProtocolError`, never another exception."""
    rng = random.Random(15)
    outcomes = {"value": 0, "error": 0}
    for _ in range(3000):
        stream = b"".join(
            _mutate(rng, frame) if rng.random() < 0.7 else frame for frame in _valid_frames(rng)
        )
        if rng.random() < 0.05:
            stream += struct.pack("<IB", rng.randrange(MAX_LINK_FRAME_BYTES + 1, 2**32), OPEN)
        buffer = FrameBuffer()
        offset = 0
        try:
            while offset < len(stream):
                piece = stream[offset : offset + rng.randint(1, 64)]
                offset += len(piece)
                for kind, payload in buffer.feed(piece):
                    for decode in (decode_client_frame, decode_router_frame):
                        try:
                            decode(kind, payload)
                            outcomes["value"] += 1
                        except LinkProtocolError:
                            outcomes["error"] += 1
        except LinkProtocolError:
            outcomes["error"] += 1
    assert outcomes["value"] > 1000
    assert outcomes["error"] > 1000


def test_a_frame_in_pieces_and_frames_in_one_piece_reassemble() -> None:
    frames = [encode_open(0, b"{}"), encode_cancel(0), encode_tokens([(1, 0, [3], [-0.5])])]
    stream = b"".join(frames)
    buffer = FrameBuffer()
    got: list[tuple[int, bytes]] = []
    for index in range(len(stream)):
        got += [(kind, bytes(payload)) for kind, payload in buffer.feed(stream[index : index + 1])]
    assert got == [(frame[4], frame[5:]) for frame in frames]
    assert [kind for kind, _ in FrameBuffer().feed(stream)] == [OPEN, CANCEL, TOKENS]


# The route, on real routers (both servers) with real fake workers, driven by a raw-socket client.


class LinkTestClient:
    """A raw-socket client of ``POST /client-link``: frames out in request body chunks, every
    router frame read back and kept (per handle, and the TOKENS frames as they came)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.status: int | None = None
        self.tokens: dict[int, list[tuple[int, int, float]]] = defaultdict(list)  # (index, id, logprob)
        self.finishes: dict[int, dict[str, Any]] = {}
        self.errors: dict[int, ErrorFrame] = {}
        self.link_errors: list[LinkErrorFrame] = []
        self.token_frames: list[TokensFrame] = []
        self.after_last: list[int] = []  # handles that got a frame after their last frame
        self.ended = anyio.Event()  # the response ended (or the connection closed)
        self.changed = anyio.Event()
        self.reading = anyio.Event()  # cleared: the client stops reading (back-pressure on the router)
        self.reading.set()
        self._body: list[bytes] = []
        self._complete = False

    @classmethod
    @asynccontextmanager
    async def connect(cls, url: str) -> AsyncIterator[LinkTestClient]:
        parts = urlsplit(url)
        assert parts.hostname is not None
        assert parts.port is not None
        async with await anyio.connect_tcp(parts.hostname, parts.port) as stream:
            client = cls(stream)
            head = (
                f"POST {CLIENT_LINK_PATH} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                "Content-Type: application/x-belayer-link\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            await stream.send(head.encode())
            async with anyio.create_task_group() as group:
                group.start_soon(client._read)
                try:
                    yield client
                finally:
                    group.cancel_scope.cancel()

    async def send(self, *frames: bytes) -> None:
        """The frames in one body chunk."""
        data = b"".join(frames)
        await self.stream.send(b"%x\r\n%b\r\n" % (len(data), data))

    async def open(self, handle: int, body: dict[str, Any]) -> None:
        await self.send(encode_open(handle, orjson.dumps(body)))

    async def close_body(self) -> None:
        await self.stream.send(b"0\r\n\r\n")

    # httptools callbacks

    def on_status(self, status: bytes) -> None:
        del status

    def on_body(self, data: bytes) -> None:
        self._body.append(data)

    def on_message_complete(self) -> None:
        self._complete = True

    async def _read(self) -> None:
        parser = httptools.HttpResponseParser(self)
        buffer = FrameBuffer()
        try:
            while not self._complete:
                await self.reading.wait()
                try:
                    data = await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return
                parser.feed_data(data)
                if self.status is None:
                    self.status = parser.get_status_code()
                body, self._body = b"".join(self._body), []
                for kind, payload in buffer.feed(body):
                    self._frame(decode_router_frame(kind, payload))
                self.changed.set()
                self.changed = anyio.Event()
        finally:
            self.ended.set()
            self.changed.set()

    def _frame(self, frame: TokensFrame | FinishFrame | ErrorFrame | LinkErrorFrame) -> None:
        if isinstance(frame, LinkErrorFrame):
            self.link_errors.append(frame)
            return
        if isinstance(frame, TokensFrame):
            self.token_frames.append(frame)
            offset = 0
            for handle, first, count in zip(frame.handles, frame.firsts, frame.counts, strict=True):
                if handle in self.finishes or handle in self.errors:
                    self.after_last.append(handle)
                for i in range(count):
                    self.tokens[handle].append(
                        (first + i, frame.token_ids[offset + i], frame.logprobs[offset + i])
                    )
                offset += count
            return
        if frame.handle in self.finishes or frame.handle in self.errors:
            self.after_last.append(frame.handle)
        if isinstance(frame, FinishFrame):
            self.finishes[frame.handle] = frame.payload
        else:
            self.errors[frame.handle] = frame

    async def until(self, predicate: Callable[[], bool], limit_s: float = 90) -> None:
        """Wait (at most ``limit_s``) until ``predicate()`` holds on what was received."""
        with anyio.fail_after(limit_s):
            while not predicate():
                if self.ended.is_set():
                    assert predicate(), "the router ended the link first"
                await self.changed.wait()

    def token_ids(self, handle: int) -> list[int]:
        """The handle's token ids, after checking their indices are contiguous from the first."""
        got = self.tokens[handle]
        if got:
            start = got[0][0]
            assert [index for index, _, _ in got] == list(range(start, start + len(got))), handle
        return [token for _, token, _ in got]


def _body(seed: int, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"prompt_token_ids": [1, 2, seed % 50 + 3], "max_tokens": max_tokens, "seed": seed, **fields}


async def _link_and_plain_workers(client: RouterClient, link_url: str, plain_url: str) -> None:
    await client.register("linked", link_url, 1, link=True)
    await client.register("plain", plain_url, 1)


@pytest.mark.usefixtures("http_server")
async def test_many_requests_on_one_link_get_exactly_what_generate_gives() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.002) as (link_url, link_worker),
        running_worker(1, token_delay_s=0.002, frame_tokens=3) as (plain_url, _plain),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        LinkTestClient.connect(router_url) as link,
    ):
        await _link_and_plain_workers(client, link_url, plain_url)
        bodies = {handle: _body(handle, 20 + handle % 7, request_id=f"r{handle}") for handle in range(72)}
        for handle in range(0, 72, 8):  # OPENs several to a chunk, and one frame split over two chunks
            frames = b"".join(encode_open(h, orjson.dumps(bodies[h])) for h in range(handle, handle + 8))
            await link.send(frames[:7])
            await link.send(frames[7:])
        await link.until(lambda: len(link.tokens) > 0)
        async with httpx.AsyncClient(timeout=60) as http:
            assert "belayer_router_client_links 1\n" in (await http.get(f"{router_url}/metrics")).text
        await link.close_body()  # no more OPENs: the open requests finish, then the response ends
        with anyio.fail_after(120):
            await link.ended.wait()
        assert link.status == 200
        assert link.link_errors == []
        assert link.errors == {}
        assert link.after_last == []
        for handle, body in bodies.items():
            assert link.token_ids(handle) == expected_tokens(body["seed"], body["max_tokens"]), handle
            assert [lp for _, _, lp in link.tokens[handle]] == [logprob_of(t) for t in link.token_ids(handle)]
            assert link.tokens[handle][0][0] == 0
            assert link.finishes[handle] == {
                "request_id": f"r{handle}",
                "finish_reason": "length",
                "num_prompt_tokens": 3,
                "num_generated_tokens": body["max_tokens"],
                "num_resumes": 0,
            }
        # What /generate gives for the same bodies (new request ids): the same tokens.
        for handle in (0, 13, 71):
            body = bodies[handle]
            completion = await client.generate(
                body["prompt_token_ids"], body["max_tokens"], seed=body["seed"]
            )
            assert completion.token_ids == link.token_ids(handle)
        assert link_worker.num_links == 1
        assert any(len(frame.handles) > 1 for frame in link.token_frames)  # one frame for several streams
        assert len(link.token_frames) < sum(len(link.tokens[h]) for h in bodies)
        assert all(not app.journal.records[f"r{h}"].in_flight for h in bodies)
        await wait_until(lambda: app.metrics.num_client_links == 0, 60)


@pytest.mark.usefixtures("http_server")
async def test_a_worker_killed_mid_stream_resumes_the_links_requests_exactly() -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=60.0)
    async with (
        running_worker(1, link=True, die_after_total=150, token_delay_s=0.005) as (url, worker),
        running_worker(2, link=True) as (new_url, new_worker),
        running_router(config) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        LinkTestClient.connect(router_url) as link,
    ):
        await client.register("s", url, 1, link=True)
        await link.send(*(encode_open(h, orjson.dumps(_body(h, 30))) for h in range(12)))
        await link.close_body()
        with anyio.fail_after(60):
            await worker.died.wait()
        await client.register("s", new_url, 2, link=True)  # the shadow's handover
        with anyio.fail_after(120):
            await link.ended.wait()
        assert link.errors == {}
        assert link.after_last == []
        for handle in range(12):
            assert link.token_ids(handle) == expected_tokens(handle, 30), handle
            assert link.tokens[handle][0][0] == 0
        assert sum(link.finishes[h]["num_resumes"] for h in range(12)) > 0
        assert all(len(r["generated_token_ids"]) > 0 for r in new_worker.requests)  # continued, not redone


@pytest.mark.usefixtures("http_server")
async def test_cancel_stops_that_request_only() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.01) as (url, worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        LinkTestClient.connect(router_url) as link,
    ):
        await client.register("s", url, 1, link=True)
        await link.open(0, _body(0, 100_000, request_id="long"))
        await link.open(1, _body(1, 30))
        await link.until(lambda: len(link.tokens[0]) >= 3)
        await link.send(encode_cancel(0))
        await wait_until(lambda: worker.num_aborts == 1, 60)  # the worker stopped generating it
        await wait_until(lambda: not app.journal.records["long"].in_flight, 60)  # released, resumable
        await link.send(encode_cancel(0))  # a CANCEL of a handle no longer open: ignored
        await link.close_body()
        with anyio.fail_after(120):
            await link.ended.wait()
        assert link.link_errors == []
        assert 0 not in link.finishes
        assert 0 not in link.errors
        assert link.token_ids(1) == expected_tokens(1, 30)
        assert link.finishes[1]["finish_reason"] == "length"
        received = len(link.tokens[0])
        assert link.token_ids(0) == expected_tokens(0, received)
        assert len(app.journal.records["long"].token_ids) >= received


@pytest.mark.usefixtures("http_server")
async def test_per_request_errors_are_error_frames_and_the_link_goes_on() -> None:
    config = RouterConfig(
        admin_token=ADMIN_TOKEN, max_prompt_tokens=8, resume_wait_s=0.5, max_body_bytes=64 * 1024
    )
    async with running_router(config) as (router_url, app), LinkTestClient.connect(router_url) as link:
        await link.open(0, {"max_tokens": 3})  # no prompt
        await link.open(1, _body(1, 3, prompt_token_ids=list(range(9))))  # over max_prompt_tokens
        await link.open(2, _body(2, 3, temperature="hot"))
        await link.open(3, _body(3, 3, num_received_tokens=2))  # a resume without its request_id
        await link.open(4, _body(4, 3, request_id="nobody"))  # no worker registered: 503
        await link.open(8, _body(8, 3, prompt_token_ids=[1234567] * 10_000))  # over max_body_bytes: 413
        await link.open(
            9, {**_body(9, 3), "seed": "\x7f" * 30_000}
        )  # its repr is 4x longer: a capped message
        await link.until(lambda: len(link.errors) == 7)
        assert {h: e.status for h, e in link.errors.items()} == {
            0: 400,
            1: 400,
            2: 400,
            3: 400,
            4: 503,
            8: 413,
            9: 400,
        }
        assert "prompt_token_ids" in link.errors[0].message
        assert "max_prompt_tokens" in link.errors[1].message
        assert "no healthy worker" in link.errors[4].message
        assert "max_body_bytes" in link.errors[8].message
        assert "'seed'" in link.errors[9].message
        assert len(link.errors[9].message) < 2100
        async with (
            running_worker(1, link=True) as (url, _worker),
            RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        ):
            await client.register("s", url, 1, link=True)
            await link.open(10, _body(5, 10))  # the link goes on
            await link.until(lambda: 10 in link.finishes)
            assert link.token_ids(10) == expected_tokens(5, 10)
            await link.open(11, _body(6, 100_000, request_id="busy"))
            await link.until(lambda: len(link.tokens[11]) > 0)
            await link.open(12, _body(6, 100_000, request_id="busy"))  # still in flight: 409
            await link.until(lambda: 12 in link.errors)
            assert link.errors[12].status == 409
            await link.send(encode_cancel(11))
            await wait_until(lambda: not app.journal.records["busy"].in_flight, 60)
        assert link.link_errors == []
        assert link.after_last == []
        assert not link.ended.is_set()
        assert app.journal.records["nobody"].finish_reason is None


_OVERSIZED = struct.pack("<IB", MAX_LINK_FRAME_BYTES + 1, OPEN)
BAD_LINK_INPUT: list[tuple[str, bytes, str]] = [
    (
        "malformed",
        encode_open(1, b'{"prompt_token_ids": [1], "max_tokens": 5, "request_id": "bad"'),
        "not JSON",
    ),
    ("truncated", encode_open(1, orjson.dumps(_body(1, 5, request_id="bad")))[:-4], "ended inside a frame"),
    ("oversized", _OVERSIZED, "link frame of"),
    ("unknown kind", struct.pack("<IB", 5, TOKENS) + b"\x00" * 4, "unknown client link frame kind"),
    ("same handle", encode_open(0, orjson.dumps(_body(1, 5, request_id="bad"))), "handles must increase"),
    ("never opened", encode_cancel(7), "never opened"),
]


@pytest.mark.usefixtures("http_server")
@pytest.mark.parametrize(("case", "bad", "message"), BAD_LINK_INPUT, ids=[c[0] for c in BAD_LINK_INPUT])
async def test_a_bad_frame_is_a_link_error_that_closes_the_link(case: str, bad: bytes, message: str) -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.01) as (url, worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        LinkTestClient.connect(router_url) as link,
    ):
        await client.register("s", url, 1, link=True)
        await link.open(0, _body(0, 100_000, request_id="open"))
        await link.until(lambda: len(link.tokens[0]) >= 2)
        records = set(app.journal.records)
        await link.send(bad)
        if case == "truncated":
            await link.close_body()
        with anyio.fail_after(90):
            await link.ended.wait()  # the router ended its response
        [error] = link.link_errors
        assert error.status == 400
        assert message in error.message
        await wait_until(lambda: not app.journal.records["open"].in_flight, 60)  # cancelled, released
        await wait_until(lambda: worker.num_aborts == 1, 60)
        assert set(app.journal.records) == records  # nothing of the bad frame journaled
        assert link.token_ids(0) == expected_tokens(0, len(link.tokens[0]))
        await wait_until(lambda: app.metrics.num_client_links == 0, 60)


@pytest.mark.usefixtures("http_server")
@pytest.mark.parametrize("body_closed", [False, True], ids=["body open", "body closed"])
async def test_a_disconnect_releases_the_requests_and_a_new_link_resumes_them_exactly(
    body_closed: bool,
) -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.01) as (url, worker),
        running_worker(1, token_delay_s=0.01) as (plain_url, _plain),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await _link_and_plain_workers(client, url, plain_url)
        bodies = {h: _body(h, 60, request_id=f"d{h}") for h in range(4)}
        async with LinkTestClient.connect(router_url) as link:
            for handle, body in bodies.items():
                await link.open(handle, body)
            if body_closed:  # no more OPENs, then gone before the requests finish
                await link.close_body()
            await link.until(lambda: all(len(link.tokens[h]) >= 3 for h in bodies))
            received = {h: link.token_ids(h) for h in bodies}  # then the client is gone
        await wait_until(lambda: all(not app.journal.records[f"d{h}"].in_flight for h in bodies), 60)
        await wait_until(lambda: app.metrics.num_client_links == 0, 60)
        assert all(app.journal.records[f"d{h}"].finish_reason is None for h in bodies)
        async with LinkTestClient.connect(router_url) as link:
            for handle, body in bodies.items():
                await link.open(handle, {**body, "num_received_tokens": len(received[handle])})
            await link.close_body()
            with anyio.fail_after(120):
                await link.ended.wait()
        for handle in bodies:
            assert link.tokens[handle][0][0] == len(received[handle])
            assert received[handle] + link.token_ids(handle) == expected_tokens(handle, 60), handle
            assert link.finishes[handle]["num_generated_tokens"] == 60
        assert worker.num_aborts >= 1


@pytest.mark.usefixtures("http_server")
async def test_a_client_that_stops_reading_gets_every_token_in_order_later() -> None:
    async with (
        running_worker(1, link=True, frame_tokens=8) as (url, worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        LinkTestClient.connect(router_url) as link,
    ):
        await client.register("s", url, 1, link=True)
        link.reading = anyio.Event()  # not reading
        await link.send(*(encode_open(h, orjson.dumps(_body(h, 1000))) for h in range(64)))
        await link.close_body()
        await wait_until(lambda: worker.num_tokens_sent == 64 * 1000, 120)
        link.reading.set()
        with anyio.fail_after(120):
            await link.ended.wait()
        assert link.after_last == []
        for handle in range(64):
            assert link.token_ids(handle) == expected_tokens(handle, 1000), handle
            assert link.finishes[handle]["num_generated_tokens"] == 1000


async def test_writes_the_belayer_server_refuses_go_out_through_the_writer_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The belayer server refuses a direct write under back-pressure (`belayer.write` returns
    False; forced here for every third write, and the server's ``send`` made to wait as a drain
    does): what it refused is sent by the link's writer task, and nothing written directly
    overtakes it."""
    from belayer_router._server import _http

    write = _http._Cycle.write
    refused: list[int] = []
    calls = 0

    def refusing(self: _http._Cycle, body: bytes) -> bool:
        nonlocal calls
        if self.scope["path"] == CLIENT_LINK_PATH:
            calls += 1
            if calls % 3 == 0:
                refused.append(len(body))
                return False
        return write(self, body)

    send = _http._Cycle.send

    async def slow_send(self: _http._Cycle, message: dict[str, Any]) -> None:
        if self.scope["path"] == CLIENT_LINK_PATH and message.get("more_body") and message.get("body"):
            await anyio.sleep(0.005)  # as a send waiting for the client to drain its buffer
        await send(self, message)

    monkeypatch.setattr(_http._Cycle, "write", refusing)
    monkeypatch.setattr(_http._Cycle, "send", slow_send)
    monkeypatch.setenv("BELAYER_ROUTER_SERVER", "belayer")
    async with (
        running_worker(1, link=True, token_delay_s=0.001) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        LinkTestClient.connect(router_url) as link,
    ):
        await client.register("s", url, 1, link=True)
        await link.send(*(encode_open(h, orjson.dumps(_body(h, 200))) for h in range(32)))
        await link.close_body()
        with anyio.fail_after(120):
            await link.ended.wait()
        assert refused  # the writer task sent what was refused
        assert link.after_last == []
        for handle in range(32):
            assert link.token_ids(handle) == expected_tokens(handle, 200), handle
            assert link.finishes[handle]["num_generated_tokens"] == 200


def test_a_turn_over_the_frame_limit_goes_out_as_several_tokens_frames(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from belayer_router._server import _client_link

    monkeypatch.setattr(_client_link, "_MAX_FRAME_TOKENS", 5)
    entries: list[tuple[int, int, Sequence[int], Sequence[float]]] = [
        (h, h * 10, [h] * (h % 4 + 1), [-float(h)] * (h % 4 + 1)) for h in range(9)
    ]
    frames = [
        decode_router_frame(kind, payload)
        for kind, payload in FrameBuffer().feed(_client_link._pack(entries))
    ]
    assert len(frames) > 1
    assert all(isinstance(frame, TokensFrame) and sum(frame.counts) <= 5 for frame in frames)
    got = [
        (handle, first, count)
        for frame in frames
        if isinstance(frame, TokensFrame)
        for handle, first, count in zip(frame.handles, frame.firsts, frame.counts, strict=True)
    ]
    assert got == [(h, h * 10, h % 4 + 1) for h in range(9)]


async def test_a_router_stopped_with_open_links_exits_cleanly_and_a_restart_resumes_them(
    tmp_path: Path, router_process: StartRouter, http_server: str
) -> None:
    """SIGTERM with a client link open: exit code 130 and no traceback on either server (under
    uvicorn the router cuts the link before uvicorn's grace runs out); the journal keeps the
    requests, and a router restarted on it resumes them on a new link with exact tokens."""
    journal = tmp_path / "router.jsonl"
    process, url = await router_process(journal)
    async with (
        running_worker(1, link=True, token_delay_s=0.02) as (worker_url, _worker),
        RouterClient(url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", worker_url, 1, link=True)
        bodies = {h: _body(h, 80, request_id=f"t{h}") for h in range(4)}
        async with LinkTestClient.connect(url) as link:
            for handle, body in bodies.items():
                await link.open(handle, body)
            await link.until(lambda: all(len(link.tokens[h]) >= 2 for h in bodies))
            received = {h: link.token_ids(h) for h in bodies}
            process.send_signal(signal.SIGTERM)
            with anyio.fail_after(60):
                assert await process.wait() == ExitCode.INTERRUPTED
        stderr = await read_stderr(process)
        assert b"Traceback" not in stderr, stderr.decode(errors="replace")
        _process, url = await router_process(journal, port=int(url.rsplit(":", 1)[1]))
        async with LinkTestClient.connect(url) as link:
            for handle, body in bodies.items():
                await link.open(handle, {**body, "num_received_tokens": len(received[handle])})
            await link.close_body()
            with anyio.fail_after(120):
                await link.ended.wait()
        for handle in bodies:
            assert received[handle] + link.token_ids(handle) == expected_tokens(handle, 80), handle
            assert link.finishes[handle]["num_resumes"] >= 1


@pytest.mark.usefixtures("http_server")
async def test_an_unexpected_failure_of_one_request_is_its_error_500_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = RouterApp._run

    async def failing_run(self: RouterApp, record: Any, emit: Any, num_received: int) -> None:
        if record.request_id == "bug":
            raise RuntimeError("a bug")
        await run(self, record, emit, num_received)

    monkeypatch.setattr(RouterApp, "_run", failing_run)
    async with (
        running_worker(1, link=True) as (url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
        LinkTestClient.connect(router_url) as link,
    ):
        await client.register("s", url, 1, link=True)
        await link.open(0, _body(0, 20, request_id="bug"))
        await link.open(1, _body(1, 20))
        await link.close_body()
        with anyio.fail_after(120):
            await link.ended.wait()
        assert link.errors[0].status == 500
        assert "a bug" in link.errors[0].message
        assert link.token_ids(1) == expected_tokens(1, 20)
        assert link.link_errors == []
