"""The client side of the wire: one blocking Unix-socket connection, one request at a time."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Any

import attrs

from belayer_gpumem._errors import (
    PermissionDeniedError,
    ProtocolError,
    RemoteError,
    ServerGoneError,
    UpdateBusyError,
)
from belayer_gpumem._protocol import HEADER, MAX_REPLY_BYTES, decode_body, encode_frame

__all__ = ["Connection"]

_RECV_BYTES = 256 * 1024
_MAX_FDS = 4


def _raise_remote(error: Any) -> None:
    code = str(error.get("code", "unknown")) if isinstance(error, dict) else "unknown"
    message = str(error.get("message", "")) if isinstance(error, dict) else repr(error)
    if code == "busy":
        raise UpdateBusyError(code, message)
    if code == "denied":
        raise PermissionDeniedError(f"the memory server refused this client: {message}")
    raise RemoteError(code, message)


@attrs.define
class Connection:
    """A connection to a memory server; every failure of the server shows up as ServerGoneError."""

    path: Path
    sock: socket.socket | None
    _pending: bytearray = attrs.field(factory=bytearray)

    @classmethod
    def connect(cls, path: str | Path, *, timeout_s: float = 30.0) -> Connection:
        """Connect to the server listening on `path`."""
        path = Path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
        except PermissionError as exc:
            sock.close()
            raise PermissionDeniedError(
                f"cannot reach {path}: {exc.strerror}; connect as the user that runs the server"
            ) from exc
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise ServerGoneError(
                f"no memory server listens on {path} ({exc.strerror}); start it first"
            ) from exc
        return cls(path=path, sock=sock)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def request(self, op: str, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """Send one request and return its successful reply plus any file descriptors that came with it.

        Raises ServerGoneError if the server is gone, RemoteError (or a subclass) on an error reply.
        """
        reply, fds = self.exchange(encode_frame({"op": op, **fields}))
        if reply.get("ok") is not True:
            for fd in fds:
                os.close(fd)
            _raise_remote(reply.get("error"))
        return reply, fds

    def exchange(self, frame: bytes) -> tuple[dict[str, Any], list[int]]:
        """Send raw bytes and read one reply frame (also used by tests to send malformed frames)."""
        sock = self._live_socket()
        try:
            # The server may have answered and closed before our request arrived (a refusal of
            # this peer): its reply is still ours to read, and says more than "broken pipe".
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(frame)
            return self._read_reply(sock)
        except (ServerGoneError, ProtocolError):
            raise
        except TimeoutError as exc:
            self.close()
            raise ServerGoneError(f"memory server at {self.path} did not answer in time") from exc
        except OSError as exc:
            self.close()
            raise ServerGoneError(
                f"memory server at {self.path} is gone ({exc.strerror or exc!r}); restart it and attach again"
            ) from exc

    def _live_socket(self) -> socket.socket:
        if self.sock is None:
            raise ServerGoneError(f"the connection to {self.path} is closed; attach again")
        return self.sock

    def _read_reply(self, sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
        fds: list[int] = []
        try:
            self._fill(sock, HEADER.size, fds)
            (length,) = HEADER.unpack(bytes(self._pending[: HEADER.size]))
            if length > MAX_REPLY_BYTES:
                raise ProtocolError(f"reply of {length} bytes exceeds the limit of {MAX_REPLY_BYTES}")
            self._fill(sock, HEADER.size + length, fds)
            body = bytes(self._pending[HEADER.size : HEADER.size + length])
            del self._pending[: HEADER.size + length]
            return decode_body(body), fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _fill(self, sock: socket.socket, size: int, fds: list[int]) -> None:
        while len(self._pending) < size:
            data, received, _flags, _addr = socket.recv_fds(sock, _RECV_BYTES, _MAX_FDS)
            fds.extend(received)
            if not data:
                self.close()
                raise ServerGoneError(
                    f"memory server at {self.path} closed the connection; it exited or refused us"
                )
            self._pending += data
