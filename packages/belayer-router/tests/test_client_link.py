"""The client link (``POST /client-link``): many generation streams of one client on one connection.

The codec (round trips, malformed frames, a fuzz), then the route on real routers (both servers)
with real `FakeWorker` workers, driven by `LinkTestClient`: a raw-socket client written here.
"""

from __future__ import annotations

import random
import struct

import orjson
import pytest

from belayer_router import LinkProtocolError
from belayer_router._wire import (
    CANCEL,
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
