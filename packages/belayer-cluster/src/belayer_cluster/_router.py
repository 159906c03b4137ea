"""`DriverRouter`: the belayer-router process the driver owns, its journal on shared storage."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from belayer_cluster._errors import ClusterStartError

__all__ = ["DriverRouter"]


class DriverRouter:
    """`belayer-router serve` as a child of the driver, journaling to `journal_path`.

    The router is not a Ray actor: a node loss cannot take it down with a slot, and its journal
    lives on storage every node reads (a shared directory here), so a router restarted on the same
    journal, on any machine, continues every request (belayer-router's guarantee).
    """

    def __init__(
        self,
        journal_path: Path,
        *,
        admin_token: str | None = None,
        resume_wait_s: float = 30.0,
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 60.0,
        launcher: Sequence[str] = (),
    ) -> None:
        self.journal_path, self.admin_token = Path(journal_path), admin_token
        self.resume_wait_s, self.host, self.start_timeout_s = resume_wait_s, host, start_timeout_s
        self.port = port  # 0: any free port at the first start, then kept for restarts
        self._process: subprocess.Popen[str] | None = None
        self.url = ""
        # A command the router runs under, e.g. `IsolatedRayCluster.launcher(node)` (nsenter into a
        # node: the router is then that node's process and is lost with it). Change it between a
        # kill and a start to restart the router elsewhere on the same journal. With a launcher the
        # router has a session of its own and is signalled as a group (the launcher and the router).
        self.launcher: list[str] = list(launcher)

    def start(self) -> DriverRouter:
        """Start the router and wait until it listens (`url` is then its base URL).

        A restart (after `stop` or `kill`) listens on the same port and reads the same journal:
        clients reconnect to the same URL, and every request continues (belayer-router's
        restart on its journal).
        """
        self.journal_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "belayer_router",
            "serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        argv += ["--journal", str(self.journal_path), "--resume-wait-s", str(self.resume_wait_s), "--json"]
        env = dict(os.environ)
        if self.admin_token is not None:
            env["BELAYER_ROUTER_ADMIN_TOKEN"] = self.admin_token
        process = subprocess.Popen(
            [*self.launcher, *argv],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=bool(self.launcher),
        )
        self._process = process
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(process.stdout.readline() if process.stdout else "")
        )
        reader.start()
        reader.join(self.start_timeout_s)
        try:
            self.url = str(json.loads(line[0])["url"]) if line and line[0] else ""
        except (ValueError, KeyError):
            self.url = ""
        if self.url:
            self.port = int(self.url.rstrip("/").rsplit(":", 1)[1])
        else:
            self.stop()
            raise ClusterStartError(
                f"belayer-router did not start within {self.start_timeout_s} s (exit code "
                f"{process.poll()}); run `python -m belayer_router serve` by hand to see why"
            )
        return self

    def kill(self) -> None:
        """Chaos: SIGKILL the router, as when the machine it runs on is lost (the journal stays)."""
        process, self._process = self._process, None
        if process is None:
            return
        self._signal(process, signal.SIGKILL)
        process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def stop(self) -> None:
        """SIGTERM the router (it shuts down cleanly, the journal stays) and wait for it."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            self._signal(process, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._signal(process, signal.SIGKILL)
                process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def _signal(self, process: subprocess.Popen[str], signum: int) -> None:
        if self.launcher:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signum)  # the launcher does not pass signals on
        else:
            process.send_signal(signum)

    def __enter__(self) -> DriverRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
