"""What runs in a sandbox, seen from the host: is its runtime only a stateless init?

A checkpoint needs CRIU only when some process holds state.  The sandbox's processes are read from
the host (its pids cgroup, else every host process in its PID namespace) and compared with the
stateless init its configuration declares: envckpt's keep-alive shell (`KEEPALIVE`, with the one
``sleep 3600`` child it waits on) or a bare ``sleep`` as the container's command.  State that
outlives processes is looked for as well: SysV IPC objects, POSIX message queues, files in
``/dev/shm`` or anything else added to the container's ``/dev`` (none of it is in the writable
layer).  Anything unexpected, or anything that cannot be read, means the runtime is not fresh:
when unsure, a full checkpoint.

It also finds processes of the sandbox outside its init's tree (a ``docker exec -d`` from outside
envckpt: its parent is the engine's shim): CRIU dumps the init's tree only, so such a process
would be lost silently by a full checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from ._errors import UncapturedProcessError

if TYPE_CHECKING:
    from ._sandbox import Sandbox

# Entries a fresh container's /dev holds (Docker's default set); anything else was added.
_FRESH_DEV = frozenset(
    {"console", "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin"}
    | {"stdout", "tty", "urandom", "zero"}
)
_KEEPALIVE_CHILD = ("sleep", "3600")
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWIPC = 0x08000000


@attrs.frozen
class Process:
    """One process of the sandbox: host pid, parent's host pid, start time (ticks), argv."""

    pid: int
    ppid: int
    start_ticks: int
    argv: tuple[str, ...]

    def describe(self) -> str:
        """``pid 123 (sleep 50)`` for messages."""
        return f"host pid {self.pid} ({' '.join(self.argv)[:80] or '?'})"


@attrs.frozen
class RuntimeView:
    """The sandbox's processes at one moment, and what that means for a checkpoint.

    ``fresh``: only the declared stateless init runs and no state outlives processes: a fresh start
    of the image's command is the same runtime.  ``outside_init``: processes a CRIU dump of the
    init's tree would miss.  ``why_not_fresh`` says what made the runtime stateful (for logs).
    """

    init_pid: int
    processes: tuple[Process, ...]
    fresh: bool
    outside_init: tuple[Process, ...]
    why_not_fresh: str = ""

    @property
    def identity(self) -> tuple[tuple[int, int], ...]:
        """(pid, start) of every process: equal views saw the same processes."""
        return tuple((p.pid, p.start_ticks) for p in self.processes)


def _read_process(pid: int) -> Process | None:
    """A host process from /proc, or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is parenthesised and may hold spaces or ")": split after the last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    argv = tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1])
    return Process(pid=pid, ppid=int(fields[1]), start_ticks=int(fields[19]), argv=argv)


def _pids_of(init_pid: int) -> list[int]:
    """Host pids of every process of the container: its pids cgroup, else its PID namespace."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{init_pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                procs = Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "cgroup.procs"
                return [int(p) for p in procs.read_text().split()]
    namespace = os.readlink(f"/proc/{init_pid}/ns/pid")
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/ns/pid") == namespace:
                    found.append(int(entry.name))
    return found


def _is_sleep(argv: Sequence[str]) -> bool:
    return len(argv) == 2 and os.path.basename(argv[0]) == "sleep"


def _stateless_shape(
    init: Process, others: Sequence[Process], command: Sequence[str], keepalive: Sequence[str]
) -> str:
    """ "" when the processes are the declared stateless init, else why not."""
    if tuple(init.argv) != tuple(command):
        return f"its init runs {' '.join(init.argv)[:60]!r}, not its configured command"
    if tuple(command) == tuple(keepalive):
        extra = [p for p in others if not (p.ppid == init.pid and p.argv == _KEEPALIVE_CHILD)]
        if extra or len(others) > 1:
            return (
                f"processes besides the stateless init: {', '.join(p.describe() for p in (extra or others))}"
            )
        return ""
    if _is_sleep(command):
        return (
            f"processes besides the stateless init: {', '.join(p.describe() for p in others)}"
            if others
            else ""
        )
    return "its command is not a stateless init (envckpt's keep-alive shell or a bare sleep)"


def _state_beyond_processes(init_pid: int) -> str:
    """What the container holds outside its processes and its layer ("" for nothing)."""
    root = Path(f"/proc/{init_pid}/root")
    dev = root / "dev"
    added = sorted(set(os.listdir(dev)) - _FRESH_DEV)
    if added:
        return f"entries added to /dev: {added[:5]}"
    for folder in ("shm", "mqueue"):
        held = os.listdir(dev / folder)
        if held:
            return f"/dev/{folder} holds {sorted(held)[:5]}"
    ptys = sorted(set(os.listdir(dev / "pts")) - {"ptmx"})
    if ptys:
        return f"pseudo-terminals are open: {ptys[:5]}"
    objects = _sysv_ipc_objects(init_pid)
    if objects:
        return f"SysV IPC objects exist ({objects})"
    return ""


def _sysv_ipc_objects(init_pid: int) -> int:
    """SysV message queues, semaphore sets and shared memory segments in the container's IPC namespace.

    /proc/sysvipc shows the reading thread's IPC namespace, so a thread of our own joins the
    container's (setns affects only the calling thread, which exits afterwards) and reads there:
    no fork, a fraction of a millisecond instead of the milliseconds of `nsenter`.
    """
    found: list[int] = []
    errors: list[BaseException] = []

    def read_inside() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{init_pid}/ns/ipc", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWIPC) != 0:
                    raise OSError(ctypes.get_errno(), "setns into the sandbox's IPC namespace failed")
            finally:
                os.close(fd)
            lines = []
            for name in ("msg", "sem", "shm"):
                lines += Path(f"/proc/sysvipc/{name}").read_text().splitlines()[1:]
            found.append(sum(1 for line in lines if line.strip()))
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=read_inside, name="belayer-sysvipc", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return found[0]


def read_runtime(init_pid: int, command: Sequence[str], keepalive: Sequence[str]) -> RuntimeView:
    """Read the sandbox's processes and decide whether its runtime is a fresh stateless init.

    ``init_pid`` is the container's init as the host sees it; ``command`` the sandbox's configured
    command.  Any error reading the state counts as "not fresh" (a full checkpoint is always safe).
    """
    processes = [p for p in (_read_process(pid) for pid in sorted(_pids_of(init_pid))) if p is not None]
    by_pid = {p.pid: p for p in processes}
    init = by_pid.get(init_pid)
    if init is None:
        return RuntimeView(init_pid, tuple(processes), False, (), "its init is not running")
    outside = []
    for proc in processes:
        seen, cursor = set(), proc
        while cursor.pid != init_pid and cursor.pid not in seen:
            seen.add(cursor.pid)
            parent = by_pid.get(cursor.ppid)
            if parent is None:
                outside.append(proc)
                break
            cursor = parent
    others = [p for p in processes if p.pid != init_pid]
    why = _stateless_shape(init, others, command, keepalive)
    if not why:
        try:
            why = _state_beyond_processes(init_pid)
        except Exception as exc:  # anything unreadable means "not known fresh"
            why = f"its state could not be read ({exc})"
    return RuntimeView(init_pid, tuple(processes), not why, tuple(outside), why)


def sandbox_runtime(sandbox: Sandbox) -> RuntimeView:
    """The sandbox's processes now (its engine view must be current: after `Sandbox.status`)."""
    pid = int(sandbox._container.attrs.get("State", {}).get("Pid") or 0)
    from ._sandbox import KEEPALIVE  # _sandbox is imported by the checkpoint modules, not this one

    return read_runtime(pid, sandbox.config.command, KEEPALIVE)


def refuse_uncaptured(view: RuntimeView, sandbox_id: str) -> None:
    """Raise `UncapturedProcessError` when a process of the sandbox is outside its init's tree."""
    if view.outside_init:
        names = tuple(p.describe() for p in view.outside_init)
        raise UncapturedProcessError(
            f"sandbox {sandbox_id[:12]} runs {', '.join(names)} outside its init's process tree (started "
            "by an exec from outside belayer-envckpt, e.g. `docker exec -d`): a checkpoint would lose it, "
            "so none was taken and the previous ready checkpoint is still in effect. Start background "
            "processes through Sandbox.exec (`cmd &`), or stop that process before the checkpoint",
            names,
        )
