"""The wire protocol: 4-byte big-endian length + one UTF-8 JSON object, checked against a schema.

Requests are bounded by MAX_REQUEST_BYTES (the server reads at most that much from any peer);
replies by MAX_REPLY_BYTES. Every reply carries `"ok"`; an error reply carries
`"error": {"code": ..., "message": ...}`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

from belayer_gpumem._errors import ProtocolError

__all__ = [
    "HEADER",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "REQUEST_SCHEMAS",
    "decode_body",
    "encode_frame",
    "error_reply",
    "validate_request",
]

HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 64 * 1024
MAX_REPLY_BYTES = 64 * 1024 * 1024

# op -> {field: (accepted types, required)}; unknown ops and unknown fields are refused.
_Number = (int, float)
REQUEST_SCHEMAS: Mapping[str, Mapping[str, tuple[tuple[type, ...], bool]]] = {
    "ping": {},
    "describe": {},
    "open": {},
    "health": {},
    "flush": {},
    "acquire": {},
    "release": {},
    "update_begin": {"copy_current": ((bool,), False), "timeout_s": (_Number, False)},
    "update_commit": {},
    "update_abort": {},
}


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """One frame: length prefix + compact JSON."""
    body = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse a frame body into a JSON object; raises ProtocolError otherwise."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("frame must hold a JSON object")
    return message


def validate_request(message: Mapping[str, Any]) -> str:
    """Check a request against REQUEST_SCHEMAS and return its op; raises ProtocolError."""
    op = message.get("op")
    if not isinstance(op, str):
        raise ProtocolError("request needs a string field 'op'")
    schema = REQUEST_SCHEMAS.get(op)
    if schema is None:
        raise ProtocolError(f"unknown op {op!r}; known ops: {sorted(REQUEST_SCHEMAS)}")
    extra = set(message) - set(schema) - {"op"}
    if extra:
        raise ProtocolError(f"op {op!r} takes no field(s) {sorted(extra)}")
    for name, (types, required) in schema.items():
        if name not in message:
            if required:
                raise ProtocolError(f"op {op!r} needs field {name!r}")
            continue
        value = message[name]
        # bool is an int subclass: only accept it where bool is listed.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolError(f"field {name!r} of op {op!r} has the wrong type {type(value).__name__}")
    return op


def error_reply(code: str, message: str) -> dict[str, Any]:
    """The reply for a refused or failed request."""
    return {"ok": False, "error": {"code": code, "message": message}}
