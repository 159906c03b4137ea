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
import time
from typing import Any, Self

import attrs

from belayer_gpumem.config import READY_PREFIX, ServerConfig
from belayer_gpumem.errors import ServerStartError

__all__ = ["ServerProcess"]


@attrs.define
class ServerProcess:
    """A running `belayer-gpumem serve` child process."""

    config: ServerConfig
    popen: subprocess.Popen[str]
    ready_info: dict[str, Any]

    @classmethod
    def start(cls, config: ServerConfig, *, timeout_s: float = 60.0) -> ServerProcess:
        """Spawn the server and block until it prints its ready line; raises ServerStartError otherwise."""
        argv = [sys.executable, "-m", "belayer_gpumem", *config.to_argv()]
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            info = _wait_ready(popen, argv, timeout_s)
        except BaseException:
            if popen.poll() is None:
                popen.kill()
            popen.wait()
            raise
        return cls(config=config, popen=popen, ready_info=info)

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
        for pipe in (self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                pipe.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_ready(popen: subprocess.Popen[str], argv: list[str], timeout_s: float) -> dict[str, Any]:
    assert popen.stdout is not None
    assert popen.stderr is not None
    deadline = time.monotonic() + timeout_s
    buffered = ""
    fd = popen.stdout.fileno()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerStartError(f"memory server did not get ready within {timeout_s} s: {' '.join(argv)}")
        readable, _, _ = select.select([fd], [], [], remaining)
        if not readable:
            continue
        chunk = os.read(fd, 65536).decode()
        if not chunk:  # stdout closed: the server exited
            popen.wait()
            stderr = popen.stderr.read().strip()
            raise ServerStartError(
                f"memory server exited with code {popen.returncode}: {stderr or '(no output)'}"
            )
        buffered += chunk
        for line in buffered.splitlines():
            if line.startswith(READY_PREFIX):
                info: dict[str, Any] = json.loads(line[len(READY_PREFIX) :])
                return info
