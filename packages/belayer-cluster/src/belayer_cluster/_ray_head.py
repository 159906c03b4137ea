"""`RayHead`: an existing Ray cluster's head (`ray start --head`), started and stopped by its own pids."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from belayer_cluster._errors import ClusterConfigError, ClusterStartError

__all__ = ["RayHead"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _session_members(sid: int) -> list[int]:
    """The pids of the live processes of session `sid` (read from /proc; zombies are not live)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process exited meanwhile
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


class RayHead:
    """A Ray cluster's head node, started the way an operator starts one: `ray start --head --block`.

    For tests and demos of joining an existing cluster (`connect(address)`, `cluster.address`): the
    head runs outside the caller's Ray connection, in its own process session and its own temp
    folder, so `stop()` ends exactly its processes (never `ray stop`, which ends every Ray process
    of the machine) and removes the folder. Use as a context manager, or `start()` / `stop()`.
    """

    def __init__(
        self, num_cpus: int = 2, object_store_bytes: int = 80 * 1024 * 1024, start_timeout_s: float = 120.0
    ) -> None:
        if num_cpus < 0:
            raise ClusterConfigError(f"num_cpus must be >= 0 (got {num_cpus})")
        self.num_cpus, self.object_store_bytes, self.start_timeout_s = (
            num_cpus,
            object_store_bytes,
            start_timeout_s,
        )
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._temp_dir: Path | None = None

    @property
    def address(self) -> str:
        """The GCS address to join (`connect(address)`, `belayer-cluster status --address`)."""
        if self._process is None:
            raise ClusterStartError("the RayHead is not started; call start() first")
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The pid of `ray start --block` (the session leader of every process of the head)."""
        if self._process is None:
            raise ClusterStartError("the RayHead is not started; call start() first")
        return self._process.pid

    def alive(self) -> bool:
        """True while the head's `ray start` process and its GCS run."""
        return self._process is not None and self._process.poll() is None and len(self.processes()) > 1

    def processes(self) -> list[int]:
        """Every live process of the head (its session: GCS, raylet, workers)."""
        return [] if self._process is None else _session_members(self._process.pid)

    def start(self) -> RayHead:
        """Start the head and wait until its GCS answers."""
        if self._process is not None:
            raise ClusterStartError("this RayHead is already started; call stop() first")
        # Ray's Unix socket paths live under the temp folder: keep it short (107 bytes at most).
        self._temp_dir = Path(tempfile.mkdtemp(prefix="brh-", dir="/tmp"))
        self.port = _free_port()
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block"]
        argv += ["--port", str(self.port), "--node-ip-address", "127.0.0.1", "--num-cpus", str(self.num_cpus)]
        argv += ["--object-store-memory", str(self.object_store_bytes), "--temp-dir", str(self._temp_dir)]
        argv += ["--include-dashboard", "false", "--disable-usage-stats"]
        log = open(self._temp_dir / "ray-start.log", "wb")  # noqa: SIM115 - the child owns it
        with log:
            self._process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._process.poll() is not None:
                tail = (self._temp_dir / "ray-start.log").read_text(errors="replace")[-2000:]
                self.stop()
                raise ClusterStartError(f"`ray start --head` exited: {tail}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0),
            ):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterStartError(
                    f"the Ray head did not listen on port {self.port} within {self.start_timeout_s} s"
                )
            time.sleep(0.2)

    def stop(self, timeout_s: float = 60.0) -> None:
        """End every process of the head (SIGTERM, then SIGKILL after `timeout_s`) and remove its folder."""
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGTERM)  # `ray start --block` stops its children
            deadline = time.monotonic() + timeout_s
            while _session_members(process.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            for pid in _session_members(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=timeout_s)
            deadline = time.monotonic() + timeout_s
            while _session_members(process.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> RayHead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
