"""The memory server process: a private Unix socket in front of one `RegionState`.

Life cycle a supervisor can rely on: the region is allocated (and loaded) first; then the socket
accepts connections, the pid file and the ready file are written and the ready line is printed;
SIGTERM or SIGINT close the listener, remove socket, pid and ready files and release the region.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import sys
from typing import Any

import anyio
import anyio.abc
import attrs
from anyio.streams.buffered import BufferedByteReceiveStream

from belayer_gpumem._config import READY_PREFIX, ServerConfig
from belayer_gpumem._errors import PermissionDeniedError, ProtocolError, RemoteError
from belayer_gpumem._protocol import (
    HEADER,
    MAX_REQUEST_BYTES,
    decode_body,
    encode_frame,
    error_reply,
    validate_request,
)
from belayer_gpumem._regionstate import RegionState
from belayer_gpumem._socketdir import check_peer, claim_socket_path, remove_quietly, write_file_atomically

__all__ = ["MemoryServer", "run_server"]

_STREAM_CLOSED = (
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    ConnectionError,
)


@attrs.define
class MemoryServer:
    """Serves one region over one socket until cancelled."""

    config: ServerConfig
    state: RegionState
    _conn_ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, announce readiness, serve until SIGTERM/SIGINT or cancellation, then clean up."""
        config = self.config
        claim_socket_path(config.socket)
        listener = await anyio.create_unix_listener(config.socket, mode=0o600)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._stop_on_signal, tg.cancel_scope)
                tg.start_soon(listener.serve, self._serve_connection, tg)
                self._announce_ready()
                task_status.started()
        finally:
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            for path in (config.socket, config.ready_file, config.pid_file):
                remove_quietly(path)

    def _announce_ready(self) -> None:
        config = self.config
        info = {
            "socket": str(config.socket),
            "pid": os.getpid(),
            "kind": config.kind,
            "backend": config.backend,
        }
        if config.ready_file is not None:
            write_file_atomically(config.ready_file, json.dumps(info) + "\n")
        print(f"{READY_PREFIX} {json.dumps(info)}", flush=True)

    async def _stop_on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                scope.cancel()
                return

    async def _serve_connection(self, stream: anyio.abc.SocketStream) -> None:
        conn = next(self._conn_ids)
        try:
            raw: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            try:
                check_peer(raw)
            except PermissionDeniedError as exc:
                await stream.send(encode_frame(error_reply("denied", f"{exc}; run as the server's user")))
                return
            await self._request_loop(conn, stream)
        except _STREAM_CLOSED:
            pass
        finally:
            self.state.disconnect(conn)
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _request_loop(self, conn: int, stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        while True:
            try:
                header = await reader.receive_exactly(HEADER.size)
            except anyio.IncompleteRead:
                return
            (length,) = HEADER.unpack(header)
            if length > MAX_REQUEST_BYTES:
                # We cannot skip a frame we refuse to read, so the connection ends here.
                message = f"request of {length} bytes exceeds the limit of {MAX_REQUEST_BYTES}"
                await stream.send(encode_frame(error_reply("too_large", message)))
                return
            body = await reader.receive_exactly(length)
            reply, fd = await self._reply_to(conn, body)
            frame = encode_frame(reply)
            if fd is None:
                await stream.send(frame)
            else:
                assert isinstance(stream, anyio.abc.UNIXSocketStream)
                await stream.send_fds(frame, [fd])

    async def _reply_to(self, conn: int, body: bytes) -> tuple[dict[str, Any], int | None]:
        try:
            request = decode_body(body)
            op = validate_request(request)
        except ProtocolError as exc:
            return error_reply("bad_request", str(exc)), None
        try:
            reply = await self.state.handle(conn, op, request)
        except RemoteError as exc:
            return error_reply(exc.code, exc.message), None
        except Exception as exc:  # one bad request must never take the region down with it
            print(f"belayer-gpumem: op {op!r} failed: {exc!r}", file=sys.stderr, flush=True)
            return error_reply("internal", f"op {op!r} failed in the server: {exc!r}"), None
        return reply, (self.state.region.export_fd() if op == "open" else None)


def run_server(config: ServerConfig) -> None:
    """Allocate the region, serve it until SIGTERM/SIGINT, release it. Blocks."""
    if config.pid_file is not None:  # first, so a supervisor can stop a slow allocation too
        write_file_atomically(config.pid_file, f"{os.getpid()}\n")
    try:
        state = RegionState.allocate(config)
    except BaseException:
        remove_quietly(config.pid_file)
        raise
    try:
        anyio.run(MemoryServer(config=config, state=state).serve)
    finally:
        state.close()
