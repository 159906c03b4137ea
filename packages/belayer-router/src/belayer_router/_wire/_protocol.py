"""Wire formats: the client request, the router -> worker request and the NDJSON events.

Both the router's ``/generate`` and every worker's ``/generate`` stream newline-delimited JSON
(``application/x-ndjson``): one object per line, ``{"type": "token", ...}`` per token and a final
``{"type": "finish", ...}`` (or ``{"type": "error", ...}``).  The README defines every field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import orjson

from belayer_router._errors import InvalidRequestError, WorkerStreamError

# Keep-alive, both ends.  The router's (and every worker's) HTTP server closes a connection idle
# this long between requests.
KEEP_ALIVE_S = 5.0
# Every client of ours drops a pooled connection idle this long, well before the server closes it.
# At equal times (httpx's default expiry is 5 s too) a request sent on a connection the server is
# closing at that moment fails with a ReadError after the server may have read it; under load that
# ended a training run ("httpx.ReadError ... BrokenResourceError" from append_context).
CLIENT_KEEP_ALIVE_S = 2.0

__all__ = [
    "CLIENT_KEEP_ALIVE_S",
    "FINISH_REASONS",
    "KEEP_ALIVE_S",
    "MAX_TOKENS",
    "MAX_TOKEN_ID",
    "FinishEvent",
    "GenerateRequest",
    "TokenEvent",
    "TokensEvent",
    "WorkerFinish",
    "WorkerToken",
    "WorkerTokens",
    "encode_event",
    "encode_worker_error",
    "encode_worker_finish",
    "encode_worker_token",
    "encode_worker_tokens",
    "parse_generate_request",
    "parse_worker_event",
    "worker_request_body",
]

FINISH_REASONS = ("stop", "length")
MAX_FRAME_TOKENS = 4096  # tokens in one ``tokens`` frame
MAX_TOKEN_ID = 2**32 - 1  # token ids travel as u32 on the links (no vocabulary comes near it)
MAX_TOKENS = 2**31 - 1  # max_tokens and token counts: far past any context, well inside orjson's i64
MAX_FRAME_BYTES = 1 << 20  # one NDJSON line from a worker
_MAX_SEED = 2**63 - 1


@attrs.frozen
class GenerateRequest:
    """One generation request as the router's ``/generate`` accepts it (already validated)."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    request_id: str | None = None
    trajectory_id: str | None = None
    turn: int | None = None
    num_received_tokens: int = 0
    stream: bool = True
    stop: tuple[str, ...] = ()  # stop strings (OpenAI endpoints; the router checks them)
    frames: bool = False  # the client reads ``tokens`` frames (several tokens per line)


@attrs.frozen
class TokenEvent:
    """A token as the router streams it to its client; ``index`` counts from 0 in the completion."""

    index: int
    token_id: int
    logprob: float


@attrs.frozen
class TokensEvent:
    """Several tokens in one event (a worker's frame), at indices ``index, index+1, ...``.

    Streamed to clients that asked for ``"frames": true`` as one ``tokens`` line.
    """

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@attrs.frozen
class FinishEvent:
    """The last event of a router stream."""

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_generated_tokens: int
    num_resumes: int


@attrs.frozen
class WorkerToken:
    """A token event from a worker, with the worker's epoch."""

    epoch: int
    index: int
    token_id: int
    logprob: float


@attrs.frozen
class WorkerTokens:
    """A ``tokens`` frame: the tokens one engine step produced, at indices ``index, index+1, ...``."""

    epoch: int
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@attrs.frozen
class WorkerFinish:
    """The final event from a worker, with the worker's epoch."""

    epoch: int
    finish_reason: str


def _field(body: Mapping[str, Any], name: str, default: Any) -> Any:
    return body[name] if name in body and body[name] is not None else default


def _int(name: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"field {name!r} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidRequestError(f"field {name!r} must be {bound}, got {value}")
    return value


def _float(name: str, value: Any, *, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"field {name!r} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise InvalidRequestError(f"field {name!r} must be in {'(' if low_open else '['}{low}, {high}]")
    return float(value)


def _token_ids(name: str, value: Any, *, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise InvalidRequestError(f"field {name!r} must be a list of integer token ids")
    if any(t < 0 for t in value):
        raise InvalidRequestError(f"field {name!r} must hold non-negative token ids")
    if any(t > MAX_TOKEN_ID for t in value):
        raise InvalidRequestError(f"field {name!r} must hold token ids of at most {MAX_TOKEN_ID}")
    if not value and not allow_empty:
        raise InvalidRequestError(f"field {name!r} must not be empty")
    return tuple(value)


def _optional_str(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > 256 or "/" in value:
        raise InvalidRequestError(f"field {name!r} must be a non-empty string of <= 256 chars without '/'")
    return value


def parse_generate_request(body: Any) -> GenerateRequest:
    """Validate a decoded JSON body of ``POST /generate``; raise `InvalidRequestError` if bad."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if "prompt_token_ids" not in body:
        raise InvalidRequestError("field 'prompt_token_ids' is required (a list of token ids)")
    if "max_tokens" not in body:
        raise InvalidRequestError("field 'max_tokens' is required (a positive integer)")
    seed = _field(body, "seed", None)
    turn = _field(body, "turn", None)
    stream = _field(body, "stream", True)
    if not isinstance(stream, bool):
        raise InvalidRequestError(f"field 'stream' must be true or false, got {stream!r}")
    frames = _field(body, "frames", False)
    if not isinstance(frames, bool):
        raise InvalidRequestError(f"field 'frames' must be true or false, got {frames!r}")
    request = GenerateRequest(
        prompt_token_ids=_token_ids("prompt_token_ids", body["prompt_token_ids"], allow_empty=False),
        max_tokens=_int("max_tokens", body["max_tokens"], minimum=1, maximum=MAX_TOKENS),
        temperature=_float("temperature", _field(body, "temperature", 1.0), low=0.0, high=100.0),
        top_p=_float("top_p", _field(body, "top_p", 1.0), low=0.0, high=1.0, low_open=True),
        seed=None if seed is None else _int("seed", seed, minimum=0, maximum=_MAX_SEED),
        stop_token_ids=_token_ids("stop_token_ids", _field(body, "stop_token_ids", []), allow_empty=True),
        request_id=_optional_str("request_id", _field(body, "request_id", None)),
        trajectory_id=_optional_str("trajectory_id", _field(body, "trajectory_id", None)),
        turn=None if turn is None else _int("turn", turn, minimum=0, maximum=_MAX_SEED),
        num_received_tokens=_int(
            "num_received_tokens", _field(body, "num_received_tokens", 0), minimum=0, maximum=MAX_TOKENS
        ),
        stream=stream,
        frames=frames,
    )
    if (request.trajectory_id is None) != (request.turn is None):
        raise InvalidRequestError("fields 'trajectory_id' and 'turn' must be given together")
    if request.num_received_tokens and request.request_id is None:
        raise InvalidRequestError("field 'num_received_tokens' needs the 'request_id' being resumed")
    return request


def worker_request_body(
    request: GenerateRequest,
    request_id: str,
    seed: int,
    generated_token_ids: list[int],
    epoch: int,
) -> dict[str, Any]:
    """The body the router POSTs to a worker's ``/generate`` to start or continue a request.

    The worker's context is ``prompt_token_ids + generated_token_ids``; it samples at most
    ``max_tokens`` more, the first at completion index ``len(generated_token_ids)``, keying its
    random stream by ``(seed, index)`` so a resumed request continues exactly as it would have.
    """
    return {
        "request_id": request_id,
        "prompt_token_ids": list(request.prompt_token_ids),
        "generated_token_ids": generated_token_ids,
        "max_tokens": request.max_tokens - len(generated_token_ids),
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": seed,
        "stop_token_ids": list(request.stop_token_ids),
        "epoch": epoch,
    }


def _event_int(event: Mapping[str, Any], name: str) -> int:
    value = event[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"field {name!r} must be a non-negative integer, got {value!r}")
    return value


def _frame(event: Mapping[str, Any], epoch: int) -> WorkerTokens:
    token_ids, logprobs = event["token_ids"], event["logprobs"]
    if not isinstance(token_ids, list) or not isinstance(logprobs, list):
        raise ValueError("'token_ids' and 'logprobs' must be lists")
    if not token_ids or len(token_ids) != len(logprobs) or len(token_ids) > MAX_FRAME_TOKENS:
        raise ValueError(
            f"a tokens frame needs 1..{MAX_FRAME_TOKENS} token ids and as many logprobs, "
            f"got {len(token_ids)} and {len(logprobs)}"
        )
    if not all(type(t) is int for t in token_ids) or min(token_ids) < 0 or max(token_ids) > MAX_TOKEN_ID:
        raise ValueError(f"'token_ids' must be integers in [0, {MAX_TOKEN_ID}]")
    if not all(type(v) is float for v in logprobs):  # orjson: a JSON number with . or e is a float
        if not all(type(v) in (float, int) for v in logprobs):
            raise ValueError("'logprobs' must be numbers")
        logprobs = [float(v) for v in logprobs]
    return WorkerTokens(epoch, _event_int(event, "index"), tuple(token_ids), tuple(logprobs))


def parse_worker_event(line: bytes) -> WorkerToken | WorkerTokens | WorkerFinish:
    """Decode one NDJSON line from a worker; raise `WorkerStreamError` on anything malformed.

    A frame is checked whole before any of its tokens is used, so a malformed frame leaves
    nothing behind.
    """
    try:
        event = orjson.loads(line)
        kind = event["type"]
        if kind == "error":
            raise WorkerStreamError(f"worker reported an error: {event.get('message')!r}")
        epoch = _event_int(event, "epoch")
        if kind == "token":
            token_id = _event_int(event, "token_id")
            if token_id > MAX_TOKEN_ID:
                raise ValueError(f"field 'token_id' must be at most {MAX_TOKEN_ID}, got {token_id}")
            return WorkerToken(epoch, _event_int(event, "index"), token_id, float(event["logprob"]))
        if kind == "tokens":
            return _frame(event, epoch)
        if kind == "finish":
            reason = event["finish_reason"]
            if reason not in FINISH_REASONS:
                raise WorkerStreamError(f"worker sent unknown finish_reason {reason!r}")
            return WorkerFinish(epoch, reason)
    except (ValueError, KeyError, TypeError, IndexError) as error:  # orjson's error is a ValueError
        raise WorkerStreamError(f"worker sent a malformed event {line[:200]!r}: {error}") from error
    raise WorkerStreamError(f"worker sent an unknown event type {kind!r}")


def encode_event(event: TokenEvent | TokensEvent | FinishEvent) -> bytes:
    """One NDJSON line of the router's client stream."""
    if isinstance(event, TokenEvent):
        payload: dict[str, Any] = {
            "type": "token",
            "index": event.index,
            "token_id": event.token_id,
            "logprob": event.logprob,
        }
    elif isinstance(event, TokensEvent):
        payload = {
            "type": "tokens",
            "index": event.index,
            "token_ids": event.token_ids,
            "logprobs": event.logprobs,
        }
    else:
        payload = {"type": "finish", **attrs.asdict(event)}
    return orjson.dumps(payload, option=orjson.OPT_APPEND_NEWLINE)


def encode_worker_token(epoch: int, index: int, token_id: int, logprob: float) -> bytes:
    """One NDJSON ``token`` line of a worker's stream (what `parse_worker_event` reads)."""
    payload = {"type": "token", "epoch": epoch, "index": index, "token_id": token_id, "logprob": logprob}
    return orjson.dumps(payload, option=orjson.OPT_APPEND_NEWLINE)


def encode_worker_tokens(epoch: int, index: int, token_ids: list[int], logprobs: list[float]) -> bytes:
    """One NDJSON ``tokens`` frame: the tokens a step produced, the first at ``index``."""
    payload = {"type": "tokens", "epoch": epoch, "index": index, "token_ids": token_ids, "logprobs": logprobs}
    return orjson.dumps(payload, option=orjson.OPT_APPEND_NEWLINE)


def encode_worker_finish(epoch: int, finish_reason: str) -> bytes:
    """The NDJSON ``finish`` line that ends a worker's stream; ``finish_reason`` in `FINISH_REASONS`."""
    if finish_reason not in FINISH_REASONS:
        raise InvalidRequestError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    payload = {"type": "finish", "epoch": epoch, "finish_reason": finish_reason}
    return orjson.dumps(payload, option=orjson.OPT_APPEND_NEWLINE)


def encode_worker_error(message: str) -> bytes:
    """An NDJSON ``error`` line: the worker gives up on the request (the router resumes it elsewhere)."""
    return orjson.dumps({"type": "error", "message": message}, option=orjson.OPT_APPEND_NEWLINE)
