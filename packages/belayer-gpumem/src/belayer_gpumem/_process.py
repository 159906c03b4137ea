"""Starting a memory server as a subprocess and waiting until it is ready (for supervisors and tests).

This module is the package's one place that runs subprocesses.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Self

import attrs

from belayer_gpumem._config import READY_PREFIX, ServerConfig
from belayer_gpumem._errors import ServerStartError

__all__ = ["ServerProcess"]

_STDERR_TAIL_LINES = 200


@attrs.define
class ServerProcess:
    """A running `belayer-gpumem serve` child process.

    Its stdout and stderr are drained for as long as it runs (the last lines of stderr are kept,
    see `stderr_tail`), so a chatty server never blocks on a full pipe.
    """

    config: ServerConfig
    popen: subprocess.Popen[str]
    ready_info: dict[str, Any]
    _stderr_tail: deque[str] = attrs.field(factory=lambda: deque(maxlen=_STDERR_TAIL_LINES))
    _drains: list[threading.Thread] = attrs.field(factory=list)

    @classmethod
    def start(cls, config: ServerConfig, *, timeout_s: float = 60.0) -> ServerProcess:
        """Spawn the server and block until it prints its ready line; raises ServerStartError otherwise."""
        return cls.wait_ready(config, cls.spawn(config), timeout_s=timeout_s)

    @staticmethod
    def spawn(config: ServerConfig, *, preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen[str]:
        """Spawn the server without waiting for it; hand the process to `wait_ready`.

        For a supervisor that must know the process before it is ready (to record it, so that a
        kill of the supervisor meanwhile leaves nothing) or that forks it with a parent-death signal
        (`preexec_fn` runs in the child between fork and exec; a death signal set there follows the
        *thread* that called `spawn`).
        """
        argv = [sys.executable, "-m", "belayer_gpumem", *config.to_argv()]
        return subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn
        )

    @classmethod
    def wait_ready(
        cls, config: ServerConfig, popen: subprocess.Popen[str], *, timeout_s: float = 60.0
    ) -> ServerProcess:
        """Block until `popen` (from `spawn`) prints its ready line; otherwise kill it and raise
        ServerStartError."""
        argv = [sys.executable, "-m", "belayer_gpumem", *config.to_argv()]
        tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        try:
            info = _wait_ready(popen, argv, timeout_s, tail)
        except BaseException:
            if popen.poll() is None:
                popen.kill()
            popen.wait()
            raise
        server = cls(config=config, popen=popen, ready_info=info, stderr_tail=tail)
        server._start_draining()
        return server

    def stderr_tail(self) -> str:
        """The last lines (at most 200) the server wrote to stderr so far."""
        return "\n".join(self._stderr_tail)

    def _start_draining(self) -> None:
        assert self.popen.stdout is not None
        assert self.popen.stderr is not None
        for pipe, tail in ((self.popen.stdout, None), (self.popen.stderr, self._stderr_tail)):
            thread = threading.Thread(
                target=_drain, args=(pipe.fileno(), tail), name=f"gpumem-drain-{self.pid}", daemon=True
            )
            thread.start()
            self._drains.append(thread)

    @property
    def pid(self) -> int:
        """The server's process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """True while the process has not exited."""
        return self.popen.poll() is None

    def stop(self, *, timeout_s: float = 30.0) -> int:
        """SIGTERM, wait for the clean shutdown (SIGKILL after `timeout_s`); returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            code = self.popen.wait()
        self._close_pipes()
        return code

    def kill(self) -> None:
        """SIGKILL (a crash, as far as clients can tell) and reap."""
        if self.alive():
            self.popen.kill()
        self.popen.wait()
        self._close_pipes()

    def _close_pipes(self) -> None:
        for thread in self._drains:
            thread.join(timeout=5.0)
        if any(thread.is_alive() for thread in self._drains):
            return  # a descendant still holds the pipes: closing them now would race the drain
        for pipe in (self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _drain(fd: int, tail: deque[str] | None, pending: bytes = b"") -> None:
    """Read `fd` until EOF, keeping its lines (the first one starts with `pending`) in `tail`."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            break
        if tail is not None:
            *lines, pending = (pending + chunk).split(b"\n")
            tail.extend(line.decode(errors="replace") for line in lines)
    if tail is not None and pending:
        tail.append(pending.decode(errors="replace"))


def _wait_ready(
    popen: subprocess.Popen[str], argv: list[str], timeout_s: float, tail: deque[str]
) -> dict[str, Any]:
    assert popen.stdout is not None
    assert popen.stderr is not None
    deadline = time.monotonic() + timeout_s
    out_fd, err_fd = popen.stdout.fileno(), popen.stderr.fileno()
    watched = [out_fd, err_fd]
    stdout, stderr = b"", b""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerStartError(f"memory server did not get ready within {timeout_s} s: {' '.join(argv)}")
        readable, _, _ = select.select(watched, [], [], remaining)
        if err_fd in readable:
            # Read stderr as it comes, so a server that logs a lot before it is ready never blocks.
            chunk = os.read(err_fd, 65536)
            if not chunk:
                watched.remove(err_fd)
            *lines, stderr = (stderr + chunk).split(b"\n")
            tail.extend(line.decode(errors="replace") for line in lines)
        if out_fd not in readable:
            continue
        chunk = os.read(out_fd, 65536)
        if not chunk:  # stdout closed: the server exited
            popen.wait()
            if err_fd in watched:
                _drain(err_fd, tail, stderr)
            elif stderr:
                tail.append(stderr.decode(errors="replace"))
            message = "\n".join(tail).strip()
            raise ServerStartError(
                f"memory server exited with code {popen.returncode}: {message or '(no output)'}"
            )
        stdout += chunk
        *lines, stdout = stdout.split(b"\n")  # only complete lines: the ready line may arrive in pieces
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith(READY_PREFIX):
                info: dict[str, Any] = json.loads(text[len(READY_PREFIX) :])
                return info
