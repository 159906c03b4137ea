"""FakeDockerEngine: a Unix-socket server speaking just enough of the Docker Engine API for an
exec (create, start, inspect), with the start answer's bytes written exactly as a test says."""

from __future__ import annotations

import json
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

API_VERSION = "1.41"
UPGRADE_HEAD = (
    b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker.multiplexed-stream\r\n"
    b"Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
)


def frame(stream: int, payload: bytes) -> bytes:
    """One multiplexed-stream frame: stream type, three zero bytes, big-endian length, payload."""
    return struct.pack(">BxxxI", stream, len(payload)) + payload


@attrs.define
class ExecScript:
    """What the fake answers to `POST /exec/{id}/start`: ``writes`` are sent one `sendall` each
    (``pause_s`` apart); ``before_close`` runs before the connection is closed (a test waits there
    for a process to be killed).  Exec inspect reports ``pid`` running while that host process
    lives, then ``exit_code``; its first ``unstarted_inspects`` answers say the exec has not started
    yet (Pid 0, no exit code), as a slow engine does."""

    writes: list[bytes]
    exit_code: int = 0
    pid: int = 0
    pause_s: float = 0.0
    before_close: Callable[[], None] | None = None
    unstarted_inspects: int = 0


def alive(pid: int) -> bool:
    """Whether host process ``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


class FakeDockerEngine:
    """Serves exec create / start / inspect on ``socket_path``; every exec plays ``script``."""

    def __init__(self, socket_path: Path, script: ExecScript) -> None:
        self.socket_path = socket_path
        self.script = script
        self.starts = 0
        self.inspects = 0
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(socket_path))
        self._server.listen(16)
        self._threads: list[threading.Thread] = []
        self._closed = False

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket_path}"

    def serve(self) -> None:
        acceptor = threading.Thread(target=self._accept, daemon=True)
        acceptor.start()
        self._threads.append(acceptor)

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            worker = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            worker.start()
            self._threads.append(worker)

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            reader = conn.makefile("rb")
            while True:
                request_line = reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode().split(" ", 2)
                length = 0
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                reader.read(length)
                if method == "POST" and path.endswith("/exec"):
                    self._json(conn, 201, {"Id": "fakeexec"})
                elif method == "POST" and path.endswith("/start"):
                    self.starts += 1
                    for data in self.script.writes:
                        conn.sendall(data)
                        if self.script.pause_s:
                            time.sleep(self.script.pause_s)
                    if self.script.before_close is not None:
                        self.script.before_close()
                    return  # the stream ends with the connection
                elif method == "GET" and path.endswith("/json"):
                    self.inspects += 1
                    pid = self.script.pid
                    if self.inspects <= self.script.unstarted_inspects:
                        info: dict[str, object] = {"Running": False, "ExitCode": None, "Pid": 0}
                    elif pid and alive(pid):
                        info = {"Running": True, "ExitCode": None, "Pid": pid}
                    else:
                        info = {"Running": False, "ExitCode": self.script.exit_code, "Pid": pid}
                    self._json(conn, 200, info)
                else:
                    self._json(conn, 404, {"message": f"fake engine: no route {method} {path}"})

    @staticmethod
    def _json(conn: socket.socket, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        conn.sendall(head.encode() + data)


@contextmanager
def fake_engine(script: ExecScript) -> Iterator[FakeDockerEngine]:
    """A served FakeDockerEngine (its socket in a short temp dir: a Unix socket path has at most
    107 bytes), closed and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="fde-") as folder:
        engine = FakeDockerEngine(Path(folder) / "docker.sock", script)
        engine.serve()
        try:
            yield engine
        finally:
            engine.close()
