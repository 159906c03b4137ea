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

The client link (``POST /client-link``: many generation streams of one client on one connection)
uses the same framing with kinds 16..21:

- ``OPEN`` (client -> router): ``u32 handle`` then the JSON of a ``POST /generate`` body.  Handles
  are the client's, strictly increasing on a link.
- ``CANCEL`` (client -> router): ``u32 handle``: the client no longer wants that request.
- ``TOKENS`` (router -> client): ``u32 n``, then ``u32 handle[n], u32 first[n], u32 count[n],
  u32 token_id[sum(count)], f64 logprob[sum(count)]``: the tokens of every stream of the link
  produced in one event-loop turn.
- ``FINISH`` (router -> client): ``u32 handle`` then the JSON of the ``/generate`` finish event's
  fields (request_id, finish_reason, num_prompt_tokens, num_generated_tokens, num_resumes).
- ``ERROR`` (router -> client): ``u32 handle`` then JSON ``{"status", "message"}``: that request
  failed as ``/generate`` would have answered it.
- ``LINK_ERROR`` (router -> client): JSON ``{"status", "message"}``: the client broke the link.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import anyio.abc
import attrs
import orjson
from anyio.streams.memory import MemoryObjectReceiveStream

from belayer_router._errors import LinkProtocolError

__all__ = [
    "ABORT",
    "CANCEL",
    "CLIENT_LINK_PATH",
    "ERROR",
    "FINISH",
    "LINK_ERROR",
    "LINK_PATH",
    "MAX_ENTRY_TOKENS",
    "MAX_LINK_FRAME_BYTES",
    "OPEN",
    "REJECT",
    "STEP",
    "SUBMIT",
    "TOKENS",
    "CancelFrame",
    "ErrorFrame",
    "FinishFrame",
    "FrameBuffer",
    "LinkAbort",
    "LinkErrorFrame",
    "LinkStep",
    "LinkSubmit",
    "OpenFrame",
    "TokensFrame",
    "decode_client_frame",
    "decode_request_frame",
    "decode_router_frame",
    "decode_step",
    "decode_tokens",
    "encode_abort",
    "encode_cancel",
    "encode_error",
    "encode_finish",
    "encode_link_error",
    "encode_open",
    "encode_reject",
    "encode_step",
    "encode_submit",
    "encode_tokens",
    "pack_tokens",
    "read_link_frames",
    "send_chunked_frames",
]

LINK_PATH = "/link"
MAX_LINK_FRAME_BYTES = 16 << 20  # one frame, either way
MAX_ENTRY_TOKENS = 4096  # tokens of one request in one step frame
SUBMIT, ABORT, STEP, REJECT = 1, 2, 3, 4
CLIENT_LINK_PATH = "/client-link"
OPEN, CANCEL, TOKENS, FINISH, ERROR, LINK_ERROR = 16, 17, 18, 19, 20, 21
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


def _u32s(payload: memoryview | bytes, offset: int, count: int) -> list[int]:
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


# The client link (``POST /client-link``): client <-> router.


@attrs.frozen
class OpenFrame:
    """A decoded ``OPEN``: the client's request ``handle`` and its ``POST /generate`` body
    (``size``: the body's length in bytes, for the router's ``max_body_bytes``)."""

    handle: int
    body: dict[str, Any]
    size: int = attrs.field(default=0, eq=False)


@attrs.frozen
class CancelFrame:
    """A decoded ``CANCEL``: the client no longer wants request ``handle``."""

    handle: int


@attrs.frozen
class TokensFrame:
    """A decoded ``TOKENS`` frame (parallel lists; ``token_ids``/``logprobs`` are all entries'
    tokens in entry order): entry ``i`` is ``counts[i]`` tokens of ``handles[i]`` from completion
    index ``firsts[i]``."""

    handles: list[int]
    firsts: list[int]
    counts: list[int]
    token_ids: list[int]
    logprobs: list[float]


@attrs.frozen
class FinishFrame:
    """A decoded ``FINISH``: request ``handle`` ended; ``payload`` holds the ``/generate`` finish
    event's fields (request_id, finish_reason, num_prompt_tokens, num_generated_tokens, num_resumes)."""

    handle: int
    payload: dict[str, Any]


@attrs.frozen
class ErrorFrame:
    """A decoded ``ERROR``: request ``handle`` failed with HTTP ``status`` (as ``/generate`` would)."""

    handle: int
    status: int
    message: str


@attrs.frozen
class LinkErrorFrame:
    """A decoded ``LINK_ERROR``: the router closed the link because of what the client sent."""

    status: int
    message: str


_COUNT = struct.Struct("<I")
_NATIVE_LE = sys.byteorder == "little" and array("I").itemsize == 4 and array("d").itemsize == 8


def _pack_u32s(values: Sequence[int]) -> bytes:
    if _NATIVE_LE:
        return array("I", values).tobytes()
    return struct.pack(f"<{len(values)}I", *values)


def _pack_f64s(values: Sequence[float]) -> bytes:
    if _NATIVE_LE:
        return array("d", values).tobytes()
    return struct.pack(f"<{len(values)}d", *values)


def encode_open(handle: int, body: bytes) -> bytes:
    """An ``OPEN`` frame; ``body`` is the JSON of a ``POST /generate`` body."""
    return _frame(OPEN, _HANDLE.pack(handle) + body)


def encode_cancel(handle: int) -> bytes:
    """A ``CANCEL`` frame."""
    return _frame(CANCEL, _HANDLE.pack(handle))


def pack_tokens(
    handles: Sequence[int],
    firsts: Sequence[int],
    counts: Sequence[int],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
) -> bytes:
    """A ``TOKENS`` frame from parallel lists (the router's hot path: a few C calls per frame).

    The caller keeps ``len(token_ids) == len(logprobs) == sum(counts)`` and every count in
    1..`MAX_ENTRY_TOKENS`; `encode_tokens` checks it."""
    body = 4 + 12 * len(handles) + 12 * len(token_ids)
    return b"".join(
        (
            _KIND.pack(body + 1, TOKENS),
            _COUNT.pack(len(handles)),
            _pack_u32s(handles),
            _pack_u32s(firsts),
            _pack_u32s(counts),
            _pack_u32s(token_ids),
            _pack_f64s(logprobs),
        )
    )


def encode_tokens(entries: Sequence[tuple[int, int, Sequence[int], Sequence[float]]]) -> bytes:
    """A ``TOKENS`` frame: ``entries`` are ``(handle, first index, token ids, logprobs)``."""
    counts = [len(entry[2]) for entry in entries]
    if any(len(entry[3]) != count for entry, count in zip(entries, counts, strict=True)):
        raise ValueError("every entry needs as many logprobs as token ids")
    if any(not 1 <= count <= MAX_ENTRY_TOKENS for count in counts):
        raise ValueError(f"every entry carries 1..{MAX_ENTRY_TOKENS} tokens, got {counts}"[:300])
    return pack_tokens(
        [entry[0] for entry in entries],
        [entry[1] for entry in entries],
        counts,
        [t for entry in entries for t in entry[2]],
        [v for entry in entries for v in entry[3]],
    )


def _json_object(data: memoryview | bytes, what: str) -> dict[str, Any]:
    try:
        value = orjson.loads(data)
    except ValueError as error:
        raise LinkProtocolError(f"{what} is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise LinkProtocolError(f"{what} must be a JSON object")
    return value


def _status_message(data: memoryview | bytes, what: str) -> tuple[int, str]:
    value = _json_object(data, what)
    status, message = value.get("status"), value.get("message")
    if isinstance(status, bool) or not isinstance(status, int) or not isinstance(message, str):
        raise LinkProtocolError(f"{what} needs an integer 'status' and a string 'message'")
    return status, message


def encode_finish(handle: int, payload: dict[str, Any]) -> bytes:
    """A ``FINISH`` frame; ``payload``: the ``/generate`` finish event's fields."""
    return _frame(FINISH, _HANDLE.pack(handle) + orjson.dumps(payload))


MAX_ERROR_MESSAGE_CHARS = 4096  # of an ERROR / LINK_ERROR frame's message: far below a frame's limit


def _status_payload(status: int, message: str) -> bytes:
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = f"{message[:MAX_ERROR_MESSAGE_CHARS]}... (cut)"
    return orjson.dumps({"status": status, "message": message})


def encode_error(handle: int, status: int, message: str) -> bytes:
    """An ``ERROR`` frame: request ``handle`` failed with HTTP ``status`` (``message`` cut at
    `MAX_ERROR_MESSAGE_CHARS`)."""
    return _frame(ERROR, _HANDLE.pack(handle) + _status_payload(status, message))


def encode_link_error(status: int, message: str) -> bytes:
    """A ``LINK_ERROR`` frame: the link is closed because of what the client sent (``message``
    cut at `MAX_ERROR_MESSAGE_CHARS`)."""
    return _frame(LINK_ERROR, _status_payload(status, message))


def decode_tokens(payload: memoryview | bytes) -> TokensFrame:
    """Decode a ``TOKENS`` payload (after the kind byte); `LinkProtocolError` if it is malformed."""
    size = len(payload)
    if size < 4:
        raise LinkProtocolError(f"a TOKENS frame of {size} bytes is shorter than its header")
    (n,) = _COUNT.unpack_from(payload)
    if 4 + 12 * n > size:
        raise LinkProtocolError(f"a TOKENS frame of {size} bytes cannot hold {n} entries")
    handles = _u32s(payload, 4, n)
    firsts = _u32s(payload, 4 + 4 * n, n)
    counts = _u32s(payload, 4 + 8 * n, n)
    if n and (min(counts) < 1 or max(counts) > MAX_ENTRY_TOKENS):
        raise LinkProtocolError(f"a TOKENS entry must carry 1..{MAX_ENTRY_TOKENS} tokens, got {counts}"[:300])
    total = sum(counts)
    offset = 4 + 12 * n
    if offset + 12 * total != size:
        raise LinkProtocolError(
            f"a TOKENS frame with {n} entries and {total} tokens must be {offset + 12 * total} bytes, "
            f"got {size}"
        )
    token_ids = _u32s(payload, offset, total)
    logprobs = list(struct.unpack_from(f"<{total}d", payload, offset + 4 * total))
    return TokensFrame(handles, firsts, counts, token_ids, logprobs)


def _handle_of(kind_name: str, payload: memoryview | bytes) -> int:
    if len(payload) < _HANDLE.size:
        raise LinkProtocolError(f"a {kind_name} frame of {len(payload)} bytes has no request handle")
    handle: int = _HANDLE.unpack_from(payload)[0]
    return handle


def decode_client_frame(kind: int, payload: memoryview | bytes) -> OpenFrame | CancelFrame:
    """Decode a client -> router frame (``OPEN``, ``CANCEL``); `LinkProtocolError` if it is
    malformed or of another kind.  The OPEN body is only checked to be a JSON object here."""
    if kind == OPEN:
        handle = _handle_of("OPEN", payload)
        body = payload[_HANDLE.size :]
        return OpenFrame(handle, _json_object(body, "an OPEN frame's body"), len(body))
    if kind == CANCEL:
        handle = _handle_of("CANCEL", payload)
        if len(payload) != _HANDLE.size:
            raise LinkProtocolError(f"a CANCEL frame must be 4 bytes (a handle), got {len(payload)}")
        return CancelFrame(handle)
    raise LinkProtocolError(f"unknown client link frame kind {kind} ({len(payload)} bytes)")


def decode_router_frame(
    kind: int, payload: memoryview | bytes
) -> TokensFrame | FinishFrame | ErrorFrame | LinkErrorFrame:
    """Decode a router -> client frame (``TOKENS``, ``FINISH``, ``ERROR``, ``LINK_ERROR``);
    `LinkProtocolError` if it is malformed or of another kind."""
    if kind == TOKENS:
        return decode_tokens(payload)
    if kind == FINISH:
        handle = _handle_of("FINISH", payload)
        return FinishFrame(handle, _json_object(payload[_HANDLE.size :], "a FINISH frame's payload"))
    if kind == ERROR:
        handle = _handle_of("ERROR", payload)
        return ErrorFrame(handle, *_status_message(payload[_HANDLE.size :], "an ERROR frame's payload"))
    if kind == LINK_ERROR:
        return LinkErrorFrame(*_status_message(payload, "a LINK_ERROR frame's payload"))
    raise LinkProtocolError(f"unknown router link frame kind {kind} ({len(payload)} bytes)")


async def send_chunked_frames(
    outgoing: MemoryObjectReceiveStream[bytes], stream: anyio.abc.ByteSendStream
) -> None:
    """Send the frames queued on ``outgoing`` as chunks of a chunked request body, everything
    queued at a wake-up in one chunk, until ``outgoing`` is closed (both links' writer task)."""
    async with outgoing:
        async for first in outgoing:
            batch = [first]
            while True:
                try:
                    batch.append(outgoing.receive_nowait())
                except anyio.WouldBlock:
                    break
            data = b"".join(batch)
            await stream.send(b"%x\r\n%b\r\n" % (len(data), data))
