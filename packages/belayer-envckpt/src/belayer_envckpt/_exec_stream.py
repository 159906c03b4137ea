"""An exec's output read off the engine's Unix socket by hand: our own HTTP/1.1 request and
response head, then the multiplexed stream (8-byte frame headers) demultiplexed until EOF.

Why by hand: docker-py (7.x, ``APIClient._get_raw_response_socket``) reads the stream from the raw
socket *under* http.client's buffered reader, so output bytes that arrived in the same read as the
response head are dropped (an exec that exits 0 with empty stdout, about 1 in 80 under load here).
Here every byte after the head is kept.  No Docker SDK import: `_exec` finds the socket path.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import time
from collections.abc import Callable
from urllib.parse import quote

from ._errors import ContainerEngineError, ContainerNotFoundError, ExecStreamError

FRAME_HEADER = struct.Struct(">B3sI")  # stream type, three zero bytes, big-endian payload length
STDOUT, STDERR, SYSTEMERR = 1, 2, 3
MAX_HEAD_BYTES = 64 * 1024
MAX_ERROR_BODY_BYTES = 1024 * 1024
READ_SIZE = 256 * 1024
STREAM_HINT = (
    "The engine's answer does not follow the Docker exec stream format; check that DOCKER_HOST "
    "points at a Docker engine (`docker version`) and run the command again"
)


class FrameDemuxer:
    """Split a multiplexed exec stream into stdout and stderr; bytes may arrive in any pieces."""

    def __init__(self) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self._pending = bytearray()

    def feed(self, data: bytes) -> None:
        """Take the next bytes of the stream; a partial frame waits for the rest."""
        self._pending += data
        at = 0
        while len(self._pending) - at >= FRAME_HEADER.size:
            kind, zeros, length = FRAME_HEADER.unpack_from(self._pending, at)
            if zeros != b"\0\0\0" or kind not in (0, STDOUT, STDERR, SYSTEMERR):
                raise ExecStreamError(
                    f"bad frame header {bytes(self._pending[at : at + FRAME_HEADER.size]).hex()} "
                    f"after {len(self.stdout) + len(self.stderr)} output bytes. {STREAM_HINT}"
                )
            end = at + FRAME_HEADER.size + length
            if end > len(self._pending):
                break
            payload = self._pending[at + FRAME_HEADER.size : end]
            if kind == SYSTEMERR:
                raise ContainerEngineError(
                    f"the engine reported an error in the exec stream: {payload.decode(errors='replace')}"
                )
            (self.stderr if kind == STDERR else self.stdout).extend(payload)
            at = end
        del self._pending[:at]

    def finish(self) -> None:
        """The stream ended: a frame cut short is an error (output would be missing)."""
        if self._pending:
            raise ExecStreamError(
                f"the exec stream ended inside a frame ({len(self._pending)} bytes of an unfinished "
                f"frame). {STREAM_HINT}"
            )


def split_head(buffer: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """Parse an HTTP/1.1 response head at the start of ``buffer``: (status, headers, every byte
    after the head), or None while the head is incomplete."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise ExecStreamError(f"no end of the response head in {len(buffer)} bytes. {STREAM_HINT}")
        return None
    lines = buffer[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ExecStreamError(f"bad status line {lines[0][:200]!r}. {STREAM_HINT}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise ExecStreamError(f"bad header line {line[:200]!r}. {STREAM_HINT}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers, buffer[end + 4 :]


def start_request(api_version: str, exec_id: str) -> bytes:
    """The `POST /exec/{id}/start` request that attaches to the exec's output (no TTY)."""
    body = json.dumps({"Detach": False, "Tty": False}).encode()
    head = (
        f"POST /v{quote(api_version)}/exec/{quote(exec_id, safe='')}/start HTTP/1.1\r\n"
        "Host: docker\r\nUser-Agent: belayer-envckpt\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
    )
    return head.encode() + body


def _error_answer(status: int, body: bytes, what: str) -> Exception:
    try:
        message = str(json.loads(body).get("message", ""))
    except (ValueError, AttributeError):
        message = body.decode(errors="replace").strip()
    message = message[:2000] or f"HTTP {status}"
    if status == 404:
        return ContainerNotFoundError(
            f"{what}: the engine answered 404 ({message}). Check the container with `docker ps -a`; "
            "a removed sandbox can only come back through `full_restore` of one of its checkpoints"
        )
    return ContainerEngineError(f"{what}: the engine answered {status} ({message})")


def read_exec_output(
    socket_path: str,
    api_version: str,
    exec_id: str,
    *,
    timeout_s: float,
    kill: Callable[[], None],
    what: str,
    connect_timeout_s: float = 60.0,
    grace_s: float = 30.0,
) -> tuple[bytes, bytes, bool]:
    """Start exec ``exec_id`` and read its output until EOF: (stdout, stderr, timed_out).

    At ``timeout_s`` ``kill`` runs (it kills the exec's process tree) and reading goes on for up
    to ``grace_s`` more, so output written before the kill is kept.  An error answer of the engine
    or a malformed stream raises a `BelayerEnvckptError` subclass; socket errors (OSError)
    propagate for the caller's engine boundary to translate.  Once the engine has accepted the
    start (its 101/200 head), any error while reading runs ``kill`` first (its own errors are
    dropped: the reading error is the one raised), so a broken stream leaves no process running.
    """
    demux = FrameDemuxer()
    accepted: list[bool] = []
    try:
        timed_out = _read(
            socket_path,
            api_version,
            exec_id,
            demux,
            accepted,
            timeout_s,
            kill,
            what,
            connect_timeout_s,
            grace_s,
        )
    except BaseException:
        if accepted:
            with contextlib.suppress(Exception):
                kill()
        raise
    return bytes(demux.stdout), bytes(demux.stderr), timed_out


def _read(
    socket_path: str,
    api_version: str,
    exec_id: str,
    demux: FrameDemuxer,
    accepted: list[bool],
    timeout_s: float,
    kill: Callable[[], None],
    what: str,
    connect_timeout_s: float,
    grace_s: float,
) -> bool:
    """`read_exec_output`'s loop: feeds ``demux``, appends to ``accepted`` once the engine accepted
    the start; whether the exec timed out."""
    deadline = time.monotonic() + timeout_s
    timed_out = False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(connect_timeout_s)
        sock.connect(socket_path)
        sock.sendall(start_request(api_version, exec_id))
        buffer = b""
        head: tuple[int, dict[str, str], bytes] | None = None
        eof = False
        while True:
            now = time.monotonic()
            if now >= deadline:
                if timed_out:  # the grace after the kill is over too: keep what came
                    break
                timed_out = True
                kill()
                deadline = time.monotonic() + grace_s
                continue
            sock.settimeout(deadline - now)
            try:
                data = sock.recv(READ_SIZE)
            except TimeoutError:
                continue
            eof = not data
            if head is None:
                buffer += data
                head = split_head(buffer)
                if head is None:
                    if eof:
                        raise ExecStreamError(
                            f"{what}: the engine closed the connection before answering. {STREAM_HINT}"
                        )
                    continue
                status, headers, data = head
                buffer = b""
                if status not in (101, 200):
                    body = data if eof else _read_error_body(sock, headers, data)
                    raise _error_answer(status, body, what)
                accepted.append(True)
            if data:
                demux.feed(data)
            if eof:
                demux.finish()
                break
    return timed_out


def _read_error_body(sock: socket.socket, headers: dict[str, str], body: bytes) -> bytes:
    """The body of an error answer: by its Content-Length, else up to EOF (bounded)."""
    length = int(headers["content-length"]) if headers.get("content-length", "").isdigit() else None
    sock.settimeout(30.0)
    while (length is None or len(body) < length) and len(body) < MAX_ERROR_BODY_BYTES:
        try:
            data = sock.recv(READ_SIZE)
        except TimeoutError:
            break
        if not data:
            break
        body += data
    return body[:length] if length is not None else body
