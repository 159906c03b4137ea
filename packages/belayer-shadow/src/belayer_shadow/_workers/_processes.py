"""Nothing orphaned: a slot's children die with their supervisor, and a new one reaps what is left.

Three layers, each enough on its own for the case it covers:

- every worker and memory server is forked with `PR_SET_PDEATHSIG` = SIGKILL (set between fork
  and exec, then the parent pid is checked, in case the parent died before the prctl); a worker
  leads its own process group. Linux ties the death signal to the forking *thread*, so every child
  is forked by one long-lived `Spawner` thread per supervisor, never by a short-lived one (an anyio
  worker thread that idles out would kill the children it started);
- the supervisor records every child it starts (workers and belayer-gpumem's memory servers) in
  `run_dir/processes.json` with its start time as soon as it is forked (before it is waited for:
  a kill meanwhile must not find it unrecorded), and a small
  guardian process holds a pipe to the supervisor: when the supervisor dies (even by SIGKILL), the
  pipe reads end-of-file and the guardian kills every recorded process;
- `reap_stale_processes(run_dir)` kills what an earlier killed run left (a new supervisor calls it
  before it starts anything). A process counts only if its start time (field 22 of
  `/proc/<pid>/stat`) equals the recorded one, so a recycled pid is never killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from belayer_shadow._errors import SupervisorError
from belayer_shadow._workers._heartbeat import Heartbeat

__all__ = [
    "GUARDIAN_ALIVE_FILE",
    "PROCESSES_FILE",
    "Guardian",
    "ProcessTable",
    "Spawner",
    "die_with_parent",
    "process_start_time",
    "reap_stale_processes",
]

PROCESSES_FILE = "processes.json"
GUARDIAN_ALIVE_FILE = "guardian.alive"  # touched by the guardian every `_GUARDIAN_TICK_S`
_GUARDIAN_TICK_S = 0.5
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls into it

T = TypeVar("T")


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: SIGKILL this child when its forking thread ends; exit if the parent is gone."""

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl
            os._exit(1)

    return preexec


def process_start_time(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (None if there is no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22; fields[0] is field 3


class ProcessTable:
    """`run_dir/processes.json`: the slot's live children with their start times, rewritten atomically."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / PROCESSES_FILE
        self._lock = threading.Lock()
        self._entries: dict[int, dict[str, Any]] = {}

    def add(self, pid: int, role: str, *, group: bool, files: tuple[Path, ...] = ()) -> None:
        """Record `pid` (`group`: it leads its own process group, which is killed with it).

        `files` (e.g. a memory server's socket) are removed by a reap once the process is gone.
        """
        start = process_start_time(pid)
        if start is None:
            return  # already gone
        entry = {
            "pid": pid,
            "start_time": start,
            "role": role,
            "group": group,
            "files": [str(f) for f in files],
        }
        with self._lock:
            self._entries[pid] = entry
            self._write()

    def remove(self, pid: int) -> None:
        """Forget `pid` (it has been reaped)."""
        with self._lock:
            if self._entries.pop(pid, None) is not None:
                self._write()

    def _write(self) -> None:
        owner = {"pid": os.getpid(), "start_time": process_start_time(os.getpid())}
        document = {"supervisor": owner, "processes": list(self._entries.values())}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(document))
        os.replace(tmp, self.path)


def _document(run_dir: Path) -> dict[str, Any]:
    try:
        document = json.loads((run_dir / PROCESSES_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _recorded(run_dir: Path) -> list[dict[str, Any]]:
    processes = _document(run_dir).get("processes", [])
    return [p for p in processes if isinstance(p, dict) and isinstance(p.get("pid"), int)]


def _live_owner(run_dir: Path) -> int | None:
    """The pid of another supervisor that recorded `run_dir` and still runs (None if there is none)."""
    owner = _document(run_dir).get("supervisor")
    if not isinstance(owner, dict) or not isinstance(owner.get("pid"), int) or owner["pid"] == os.getpid():
        return None
    start = owner.get("start_time")
    return owner["pid"] if start is not None and process_start_time(owner["pid"]) == start else None


def reap_stale_processes(
    run_dir: str | Path, *, timeout_s: float = 30.0, owner_gone: bool = False
) -> list[int]:
    """Kill every process an earlier run recorded in `run_dir/processes.json` that still runs.

    A process is killed (SIGKILL, with its process group if it leads one) only if its start time
    equals the recorded one, so a pid the kernel has since given to another process is left alone.
    Then the files recorded with the processes (sockets) are removed. Returns the pids killed, once
    they are gone (SupervisorError if one outlives `timeout_s`). A run folder whose supervisor still
    runs in another process is refused (SupervisorError): its children are not leftovers
    (`owner_gone=True`, the guardian's case, reaps anyway).
    """
    run_dir = Path(run_dir)
    owner = None if owner_gone else _live_owner(run_dir)
    if owner is not None:
        raise SupervisorError(
            f"run folder {run_dir} belongs to a running supervisor (pid {owner}); "
            "stop it first or use another run folder"
        )
    killed: list[tuple[int, int]] = []
    recorded = _recorded(run_dir)
    for entry in recorded:
        pid, start = entry["pid"], entry.get("start_time")
        if pid == os.getpid() or start is None or process_start_time(pid) != start:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if entry.get("group") and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            killed.append((pid, start))
    deadline = time.monotonic() + timeout_s
    for pid, start in killed:
        # Gone, or a zombie (it holds nothing but its pid; its parent, or init, reaps it).
        while process_start_time(pid) == start and _state(pid) != "Z":
            if time.monotonic() > deadline:
                raise SupervisorError(f"process {pid} from an earlier run in {run_dir} survived SIGKILL")
            time.sleep(0.01)
    for entry in recorded:
        for name in entry.get("files") or []:
            Path(name).unlink(missing_ok=True)
    (run_dir / PROCESSES_FILE).unlink(missing_ok=True)
    return [pid for pid, _ in killed]


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


class Spawner:
    """One long-lived thread that forks every worker of a supervisor (PDEATHSIG follows the thread)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the spawner thread and return its result (its exception is raised here)."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._closed:
            raise SupervisorError("the supervisor is stopped; it starts no more processes")
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        return future.result()

    def close(self) -> None:
        """End the thread (after every child it forked is gone: their death signal fires then)."""
        self._closed = True
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


class Guardian:
    """A process that reaps every child recorded in `processes.json` once the supervisor is gone.

    It holds the read end of a pipe whose write end only the supervisor holds: when the supervisor
    closes it (`close()`) or dies (the kernel closes it), the guardian reads end-of-file, kills what
    is still recorded (start times checked) and exits. It runs in its own session, so a signal to
    the supervisor's process group does not reach it first.
    """

    def __init__(self, popen: subprocess.Popen[bytes], pipe: int, table: ProcessTable) -> None:
        self.popen, self._pipe, self._table = popen, pipe, table

    @classmethod
    def start(cls, run_dir: Path, table: ProcessTable) -> Guardian:
        """Start the guardian of `run_dir` (its output goes to `run_dir/workers/guardian.log`)."""
        read_end, write_end = os.pipe()  # not inheritable: no other child keeps the write end open
        workers = run_dir / "workers"
        workers.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "belayer_shadow._workers._processes", str(run_dir), str(read_end)]
        try:
            with (workers / "guardian.log").open("ab") as output:
                popen = subprocess.Popen(
                    command,
                    pass_fds=(read_end,),
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        table.add(popen.pid, "guardian", group=False)
        return cls(popen, write_end, table)

    def close(self, timeout_s: float = 30.0) -> None:
        """Close the pipe (the guardian reaps what is still recorded and exits); wait for it."""
        if self._pipe >= 0:
            os.close(self._pipe)
            self._pipe = -1
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._table.remove(self.popen.pid)

    def kill(self) -> None:
        """SIGKILL the guardian (it hangs), then close the pipe: it reaps nothing."""
        self.popen.kill()
        self.popen.wait()
        self.close(timeout_s=0.0)


def _guard(run_dir: Path, fd: int) -> None:
    """The guardian: wait until the supervisor's end of the pipe closes (touching its alive file
    every `_GUARDIAN_TICK_S`, so the supervisor can tell a hung guardian), then reap its children."""
    alive = Heartbeat(run_dir / GUARDIAN_ALIVE_FILE)
    with contextlib.suppress(OSError):
        while True:
            alive.touch()
            readable, _, _ = select.select([fd], [], [], _GUARDIAN_TICK_S)
            if readable and not os.read(fd, 4096):
                break
    reap_stale_processes(run_dir, owner_gone=True)


if __name__ == "__main__":  # python -m belayer_shadow._workers._processes RUN_DIR FD
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _guard(Path(sys.argv[1]), int(sys.argv[2]))
