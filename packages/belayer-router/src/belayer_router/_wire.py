"""The worker link's binary framing: length-prefixed, struct-packed frames both ways.

One link is one long-lived ``POST /link`` per worker: the router's frames travel in the chunked
request body, the worker's in the chunked response body.  Every frame is
``u32 length`` (of what follows) ``| u8 kind | payload``, little-endian:

- ``SUBMIT`` (router -> worker): ``u32 handle`` then the JSON of `worker_request_body`.  The handle
  names the request on this link (the router numbers them 0, 1, 2, ... per link).
- ``ABORT`` (router -> worker): ``u32 handle``: stop generating it (client gone, stop string).
- ``STEP`` (worker -> router): the tokens one engine step produced for every request on the link
  and the requests it finished: ``u64 epoch, u32 n, u32 f``, then ``u32 handle[n], u32 first[n],
  u32 count[n], u32 token_id[sum(count)], f64 logprob[sum(count)], u32 finished[f],
  u8 reason[f]`` (reason 0 = stop, 1 = length).  Entry ``i`` holds the tokens at completion
  indices ``first[i] ..`` of request ``handle[i]``.
- ``REJECT`` (worker -> router): ``u32 handle`` then a UTF-8 message: the worker refuses or gives
  up on the request (a stale epoch, a malformed body); the router resumes it elsewhere.

Decoding checks a frame whole (sizes, counts, reasons) before anything of it is used, and raises
`LinkProtocolError`; the arrays come out as lists in one C call each, not per token.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator, Sequence
from typing import Any

import attrs
import orjson

from belayer_router._errors import LinkProtocolError

__all__ = [
    "ABORT",
    "LINK_PATH",
    "MAX_LINK_FRAME_BYTES",
    "REJECT",
    "STEP",
    "SUBMIT",
    "FrameBuffer",
    "LinkAbort",
    "LinkStep",
    "LinkSubmit",
    "decode_request_frame",
    "decode_step",
    "encode_abort",
    "encode_reject",
    "encode_step",
    "encode_submit",
    "read_link_frames",
]

LINK_PATH = "/link"
MAX_LINK_FRAME_BYTES = 16 << 20  # one frame, either way
MAX_ENTRY_TOKENS = 4096  # tokens of one request in one step frame
SUBMIT, ABORT, STEP, REJECT = 1, 2, 3, 4
REASONS = ("stop", "length")
_LENGTH = struct.Struct("<I")
_KIND = struct.Struct("<IB")
_HANDLE = struct.Struct("<I")
_STEP_HEAD = struct.Struct("<QII")
_MAX_U32 = 2**32 - 1


@attrs.frozen
class LinkSubmit:
    """A request the router submits on the link: ``body`` is a `worker_request_body` dict."""

    handle: int
    body: dict[str, Any]


@attrs.frozen
class LinkAbort:
    """The router no longer wants request ``handle``."""

    handle: int


@attrs.frozen
class LinkStep:
    """A decoded ``STEP`` frame (parallel lists; ``token_ids``/``logprobs`` are all entries' tokens)."""

    epoch: int
    handles: list[int]
    firsts: list[int]
    counts: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finished: list[int]
    reasons: list[str]


def _frame(kind: int, payload: bytes) -> bytes:
    return _KIND.pack(len(payload) + 1, kind) + payload


def encode_submit(handle: int, body: bytes) -> bytes:
    """A ``SUBMIT`` frame; ``body`` is the JSON of a `worker_request_body`."""
    return _frame(SUBMIT, _HANDLE.pack(handle) + body)


def encode_abort(handle: int) -> bytes:
    """An ``ABORT`` frame."""
    return _frame(ABORT, _HANDLE.pack(handle))


def encode_reject(handle: int, message: str) -> bytes:
    """A ``REJECT`` frame: the worker will not (or no longer) generate request ``handle``."""
    return _frame(REJECT, _HANDLE.pack(handle) + message.encode()[:4096])


def encode_step(
    epoch: int,
    entries: Sequence[tuple[int, int, Sequence[int], Sequence[float]]],
    finished: Sequence[tuple[int, str]] = (),
) -> bytes:
    """A ``STEP`` frame: ``entries`` are ``(handle, first index, token ids, logprobs)``; ``finished``
    are ``(handle, reason)`` with reason ``"stop"`` or ``"length"``."""
    n, f = len(entries), len(finished)
    token_ids = [t for entry in entries for t in entry[2]]
    logprobs = [v for entry in entries for v in entry[3]]
    if len(token_ids) != len(logprobs):
        raise ValueError("every entry needs as many logprobs as token ids")
    parts = [
        _STEP_HEAD.pack(epoch, n, f),
        struct.pack(f"<{n}I", *(e[0] for e in entries)),
        struct.pack(f"<{n}I", *(e[1] for e in entries)),
        struct.pack(f"<{n}I", *(len(e[2]) for e in entries)),
        struct.pack(f"<{len(token_ids)}I", *token_ids),
        struct.pack(f"<{len(logprobs)}d", *logprobs),
        struct.pack(f"<{f}I", *(h for h, _ in finished)),
        bytes(REASONS.index(r) for _, r in finished),
    ]
    return _frame(STEP, b"".join(parts))


def _u32s(payload: memoryview, offset: int, count: int) -> list[int]:
    return list(struct.unpack_from(f"<{count}I", payload, offset))


def decode_step(payload: memoryview) -> LinkStep:
    """Decode a ``STEP`` payload (after the kind byte); `LinkProtocolError` if it is malformed."""
    if len(payload) < _STEP_HEAD.size:
        raise LinkProtocolError(f"a STEP frame of {len(payload)} bytes is shorter than its header")
    epoch, n, f = _STEP_HEAD.unpack_from(payload)
    offset = _STEP_HEAD.size
    if offset + 12 * n + 5 * f > len(payload):
        raise LinkProtocolError(f"a STEP frame of {len(payload)} bytes cannot hold {n} entries, {f} finishes")
    handles = _u32s(payload, offset, n)
    firsts = _u32s(payload, offset + 4 * n, n)
    counts = _u32s(payload, offset + 8 * n, n)
    offset += 12 * n
    total = sum(counts)
    if (n and min(counts) < 1) or (n and max(counts) > MAX_ENTRY_TOKENS):
        raise LinkProtocolError(f"a STEP entry must carry 1..{MAX_ENTRY_TOKENS} tokens, got {counts}"[:300])
    if offset + 12 * total + 5 * f != len(payload):
        raise LinkProtocolError(
            f"a STEP frame with {n} entries, {total} tokens and {f} finishes must be "
            f"{offset + 12 * total + 5 * f} bytes, got {len(payload)}"
        )
    token_ids = _u32s(payload, offset, total)
    logprobs = list(struct.unpack_from(f"<{total}d", payload, offset + 4 * total))
    offset += 12 * total
    finished = _u32s(payload, offset, f)
    codes = bytes(payload[offset + 4 * f :])
    if any(code >= len(REASONS) for code in codes):
        raise LinkProtocolError(f"a STEP frame names an unknown finish reason code in {list(codes)}")
    return LinkStep(
        epoch, handles, firsts, counts, token_ids, logprobs, finished, [REASONS[c] for c in codes]
    )


def decode_request_frame(kind: int, payload: memoryview) -> LinkSubmit | LinkAbort:
    """Decode a router -> worker frame; `LinkProtocolError` if it is malformed."""
    if len(payload) < _HANDLE.size:
        raise LinkProtocolError(f"a link frame of kind {kind} has no request handle")
    (handle,) = _HANDLE.unpack_from(payload)
    if kind == ABORT and len(payload) == _HANDLE.size:
        return LinkAbort(handle)
    if kind == SUBMIT:
        try:
            body = orjson.loads(payload[_HANDLE.size :])
        except ValueError as error:
            raise LinkProtocolError(f"a SUBMIT frame's body is not JSON: {error}") from error
        if not isinstance(body, dict):
            raise LinkProtocolError("a SUBMIT frame's body must be a JSON object")
        return LinkSubmit(handle, body)
    raise LinkProtocolError(f"unknown router link frame kind {kind} ({len(payload)} bytes)")


class FrameBuffer:
    """Reassembles frames from a byte stream: `feed` returns the complete ``(kind, payload)`` pairs.

    A length over ``max_bytes`` (or a frame with no kind byte) raises `LinkProtocolError` at once,
    before its bytes arrive.
    """

    def __init__(self, max_bytes: int = MAX_LINK_FRAME_BYTES) -> None:
        self.max_bytes = max_bytes
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, memoryview]]:
        """Add ``data``; return the frames it completed (payload views stay valid until the next feed)."""
        buffer = self.buffer
        buffer += data
        spans: list[tuple[int, int]] = []
        offset, size = 0, len(buffer)
        while size - offset >= 4:  # scan in place: a frame arriving in pieces is not copied per piece
            (length,) = _LENGTH.unpack_from(buffer, offset)
            if length < 1 or length > self.max_bytes:
                raise LinkProtocolError(f"a link frame of {length} bytes (allowed 1..{self.max_bytes})")
            if size - offset - 4 < length:
                break
            spans.append((offset, length))
            offset += 4 + length
        if not spans:
            return []
        view = memoryview(bytes(buffer[:offset]))  # only the completed frames are copied, once
        del buffer[:offset]
        return [(view[start + 4], view[start + 5 : start + 4 + length]) for start, length in spans]

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self.buffer)


def check_u32(value: int, name: str) -> int:
    """``value`` if it fits a u32 field, else `LinkProtocolError`."""
    if not 0 <= value <= _MAX_U32:
        raise LinkProtocolError(f"{name} {value} does not fit a link frame's u32 field")
    return value


async def read_link_frames(
    receive: Any, max_bytes: int = MAX_LINK_FRAME_BYTES
) -> AsyncIterator[LinkSubmit | LinkAbort]:
    """The router's frames on a worker's ``POST /link`` (ASGI ``receive``), until the router closes it.

    For workers: answer ``POST /link`` with status 200, then stream `encode_step` / `encode_reject`
    frames as body chunks while iterating this.  Raises `LinkProtocolError` on a malformed frame.
    """
    frames = FrameBuffer(max_bytes)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        for kind, payload in frames.feed(message.get("body", b"")):
            yield decode_request_frame(kind, payload)
        if not message.get("more_body", False):
            if frames.pending:
                raise LinkProtocolError(f"the router's link ended inside a frame ({frames.pending} bytes)")
            return
