"""Child processes of a slot supervisor: the one place that spawns, waits for and kills workers.

Each worker leads its own process group and is SIGKILLed by the kernel when the thread that forked
it ends (`PR_SET_PDEATHSIG`, see `_processes`): call `spawn_worker` from the supervisor's `Spawner`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from belayer_shadow._errors import SupervisorError
from belayer_shadow._workers._events import read_state
from belayer_shadow._workers._processes import die_with_parent

__all__ = ["Child", "spawn_worker"]


@attrs.define(eq=False)
class Child:
    """A worker process (`main` or `shadow`) with its state file and its reaper thread."""

    role: str
    generation: int
    popen: subprocess.Popen[bytes]
    state_file: Path
    log_file: Path
    exit_code: int | None = None
    exit_time: float | None = None
    reaper: threading.Thread | None = None

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """True until the process has been reaped."""
        return self.exit_code is None and self.popen.poll() is None

    def state(self) -> dict[str, Any] | None:
        """The state the worker published last (None before its first)."""
        return read_state(self.state_file)

    def wait_state(self, wanted: set[str], timeout_s: float) -> dict[str, Any]:
        """Block until the worker publishes one of `wanted`; SupervisorError if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.state()
            if state is not None and state["state"] in wanted:
                return state
            if not self.alive():
                raise SupervisorError(
                    f"{self.role} worker exited with code {self.popen.poll()}; see {self.log_file}"
                )
            time.sleep(0.01)
        raise SupervisorError(
            f"{self.role} worker not {sorted(wanted)} within {timeout_s} s; see {self.log_file}"
        )

    def kill(self, *, graceful_s: float = 0.0) -> None:
        """SIGTERM (when `graceful_s` > 0, waiting that long) then SIGKILL its process group; reaps it."""
        if self.popen.poll() is None and graceful_s > 0:
            self.popen.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=graceful_s)
        if self.popen.poll() is None:  # not reaped yet: the pid (and its group id) is still ours
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


def spawn_worker(
    role: str,
    generation: int,
    argv: list[str],
    run_dir: Path,
    on_exit: Callable[[Child], None],
    env: dict[str, str],
) -> Child:
    """Start `python -m belayer_shadow <argv>` with its output in the run dir; `on_exit` runs when it is reaped."""
    workers = run_dir / "workers"
    workers.mkdir(parents=True, exist_ok=True)
    state_file = workers / f"{generation}-{role}.state.json"
    log_file = workers / f"{generation}-{role}.log"
    state_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "belayer_shadow", *argv, "--state-file", str(state_file)]
    with log_file.open("ab") as output:
        popen = subprocess.Popen(
            command,
            stdout=output,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,  # it leads its own group: killing the group leaves nothing of it
            preexec_fn=die_with_parent(os.getpid()),  # only prctl and getppid run in the child
        )
    child = Child(role, generation, popen, state_file, log_file)

    def reap() -> None:
        # Blocks in waitpid: the supervisor learns of the exit the moment the kernel reports it.
        child.exit_code = popen.wait()
        child.exit_time = time.time()
        on_exit(child)

    child.reaper = threading.Thread(target=reap, name=f"reap-{role}-{generation}", daemon=True)
    child.reaper.start()
    return child
