"""What runs in a sandbox, seen from the host: is its runtime only a stateless init?

A checkpoint needs CRIU only when some process holds state.  The sandbox's processes are read from
the host (its pids cgroup, else every host process in its PID namespace) and compared with the
stateless init its configuration declares: envckpt's keep-alive shell (`KEEPALIVE`, with the one
``sleep 3600`` child it waits on) or a bare ``sleep`` as the container's command.  A process is
that init only when its executable is: its argv (which ``exec -a sleep`` sets at will) must match,
and the file it runs (``/proc/PID/exe``) must be the one the declared command resolves to inside
the container (same device and inode, the name looked up in the container's PATH with its
symbolic links followed inside its root), a file of the image that the writable layer has not
replaced.  (In a multi-call binary such as BusyBox, argv[0] selects the applet, so a matching file
and argv is that applet.)  State that
outlives processes is looked for as well: SysV IPC objects, POSIX message queues, files in
``/dev/shm`` or anything else added to the container's ``/dev`` (none of it is in the writable
layer).  Anything unexpected, or anything that cannot be read, means the runtime is not fresh:
when unsure, a full checkpoint.

Reading /proc races with the sandbox: a process listed may exit before it is read.  Such a scan
is taken again (up to ``_SCAN_TRIES`` times); a scan that never comes out whole, or any other read
error (a permission refused), marks the view ``unreadable``: never fresh, and a refusal
(`RuntimeUnreadableError`) where a checkpoint must know every process.

It also finds processes of the sandbox outside its init's tree (a ``docker exec -d`` from outside
envckpt: its parent is the engine's shim): CRIU dumps the init's tree only, so such a process
would be lost silently by a full checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import stat as stat_module
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from ._errors import RuntimeUnreadableError, UncapturedProcessError
from ._procfs import host_proc

if TYPE_CHECKING:
    from ._sandbox import Sandbox

# Entries a fresh container's /dev holds (Docker's default set); anything else was added.
_FRESH_DEV = frozenset(
    {"console", "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin"}
    | {"stdout", "tty", "urandom", "zero"}
)
_KEEPALIVE_CHILD = ("sleep", "3600")
_CLONE_NEWIPC = 0x08000000
_DEFAULT_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
_SCAN_TRIES = 3
_SYMLINK_HOPS = 40
# Errors that say the process is gone (it exited between the listing and the read).
_GONE = (FileNotFoundError, ProcessLookupError)


class _Gone(Exception):
    """A listed process exited before it was read: the scan is taken again."""


class _Unreadable(Exception):
    """/proc refused a read for another reason than the process being gone."""


@attrs.frozen
class Process:
    """One process of the sandbox: host pid, parent's host pid, start time (ticks), argv, and the
    (device, inode) of the file it executes (None when the kernel shows none: a zombie)."""

    pid: int
    ppid: int
    start_ticks: int
    argv: tuple[str, ...]
    exe: tuple[int, int] | None = None

    def describe(self) -> str:
        """``pid 123 (sleep 50)`` for messages."""
        return f"host pid {self.pid} ({' '.join(self.argv)[:80] or '?'})"


@attrs.frozen
class RuntimeView:
    """The sandbox's processes at one moment, and what that means for a checkpoint.

    ``fresh``: only the declared stateless init runs and no state outlives processes: a fresh start
    of the image's command is the same runtime.  ``outside_init``: processes a CRIU dump of the
    init's tree would miss.  ``why_not_fresh`` says what made the runtime stateful (for logs).
    ``unreadable``: why the processes could not be read whole ("" when they were); such a view is
    never fresh and its ``outside_init`` is not known to be complete.
    """

    init_pid: int
    processes: tuple[Process, ...]
    fresh: bool
    outside_init: tuple[Process, ...]
    why_not_fresh: str = ""
    unreadable: str = ""

    @property
    def identity(self) -> tuple[tuple[int, int], ...]:
        """(pid, start) of every process: equal views saw the same processes."""
        return tuple((p.pid, p.start_ticks) for p in self.processes)


def _read_process(pid: int) -> Process:
    """A host process from /proc; `_Gone` when it exited meanwhile, `_Unreadable` for other errors."""
    try:
        stat = Path(f"{host_proc()}/{pid}/stat").read_text()
        raw = Path(f"{host_proc()}/{pid}/cmdline").read_bytes()
    except _GONE as exc:
        raise _Gone(pid) from exc
    except OSError as exc:
        raise _Unreadable(f"reading /proc/{pid}: {exc}") from exc
    try:
        # The command name (field 2) is parenthesised and may hold spaces or ")": split after the last ")".
        fields = stat[stat.rindex(")") + 2 :].split()
        ppid, start_ticks = int(fields[1]), int(fields[19])
    except (ValueError, IndexError) as exc:
        if not stat:  # read as the process was reaped
            raise _Gone(pid) from exc
        raise _Unreadable(f"/proc/{pid}/stat is not in the kernel's format: {stat[:80]!r}") from exc
    argv = tuple(part.decode(errors="replace") for part in raw.split(b"\0")[:-1])
    exe: tuple[int, int] | None = None
    try:
        info = os.stat(f"{host_proc()}/{pid}/exe")
        exe = (info.st_dev, info.st_ino)
    except FileNotFoundError:
        exe = None  # a zombie (or gone: the next read of its stat says which)
    except ProcessLookupError as exc:
        raise _Gone(pid) from exc
    except OSError as exc:
        raise _Unreadable(f"reading /proc/{pid}/exe: {exc}") from exc
    return Process(pid=pid, ppid=ppid, start_ticks=start_ticks, argv=argv, exe=exe)


def _pids_of(init_pid: int) -> list[int]:
    """Host pids of every process of the container: its pids cgroup, else its PID namespace.

    `_Gone` when the init itself exited; `_Unreadable` when /proc refused a read.  The kernel
    writes ``cgroup.procs`` in the reader's PID namespace and leaves out the processes it cannot
    see there (a reader inside a node of belayer-cluster's `IsolatedRayCluster` sees none of the
    host's).  Such a reader finds them in the host's /proc instead: every process whose pids
    cgroup is the init's (``/proc/PID/cgroup`` is readable where the ``ns`` links of processes
    outside the reader's PID namespace are not).
    """
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"{host_proc()}/{init_pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(","):
                procs = Path("/sys/fs/cgroup/pids") / path.lstrip("/") / "cgroup.procs"
                listed = [int(p) for p in procs.read_text().split()]
                if init_pid in listed:
                    return listed
                return _pids_in_cgroup(line)
    try:
        namespace = os.readlink(f"{host_proc()}/{init_pid}/ns/pid")
    except _GONE as exc:
        raise _Gone(init_pid) from exc
    except OSError as exc:
        raise _Unreadable(f"reading the PID namespace of {init_pid}: {exc}") from exc
    found = []
    for entry in os.scandir(host_proc()):
        if entry.name.isdigit():
            try:
                if os.readlink(f"{host_proc()}/{entry.name}/ns/pid") == namespace:
                    found.append(int(entry.name))
            except _GONE:
                continue  # exited since the listing: not a process of anyone any more
            except OSError as exc:
                raise _Unreadable(f"reading the PID namespace of {entry.name}: {exc}") from exc
    return found


def _pids_in_cgroup(line: str) -> list[int]:
    """Host pids whose /proc/PID/cgroup holds ``line`` (a hierarchy's line of the container's init)."""
    found = []
    for entry in os.scandir(host_proc()):
        if entry.name.isdigit():
            try:
                lines = Path(f"{host_proc()}/{entry.name}/cgroup").read_text().splitlines()
            except _GONE:
                continue  # exited since the listing
            except OSError as exc:
                raise _Unreadable(f"reading the cgroups of {entry.name}: {exc}") from exc
            if line in lines:
                found.append(int(entry.name))
    return found


def container_pids(init_pid: int) -> set[int]:
    """Host pids of every process of the container whose init is ``init_pid`` (empty when they
    cannot be read)."""
    try:
        return set(_pids_of(init_pid))
    except (_Gone, _Unreadable):
        return set()


def _scan(init_pid: int) -> list[Process]:
    """Every process of the container, all read from one listing (`_Gone` when one exited)."""
    return [_read_process(pid) for pid in sorted(_pids_of(init_pid))]


def _follow_in_root(root: str, path: str) -> tuple[str, list[str]] | None:
    """The symlink-free absolute path that ``path`` names inside the container's root, and every
    symbolic link passed on the way; None when it names nothing.

    Symbolic links are followed as the container sees them (an absolute target starts again at
    the container's root, not the host's): the host's own resolution through /proc/PID/root
    would follow an absolute link out of it.
    """
    parts = [p for p in path.split("/") if p and p != "."]
    done: list[str] = []
    links: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        here = "/" + "/".join([*done, part])
        try:
            info = os.lstat(root + here)
        except OSError:
            return None
        if stat_module.S_ISLNK(info.st_mode):
            links.append(here)
            if len(links) > _SYMLINK_HOPS:
                return None
            try:
                target = os.readlink(root + here)
            except OSError:
                return None
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p and p != "."] + parts
        else:
            done.append(part)
    return "/" + "/".join(done), links


@attrs.frozen
class Executables:
    """Where the declared stateless init's programs are, inside a container: its root on the host,
    the PATH its command is looked up in, and its writable layer (a program replaced there is no
    longer the image's)."""

    root: str
    path: tuple[str, ...] = _DEFAULT_PATH
    upper: Path | None = None

    def identity(self, name: str) -> tuple[int, int] | None:
        """(device, inode) of the image's file that ``name`` runs in the container, or None when
        it resolves to nothing, to no regular file, or through a file or link the writable layer
        holds (a ``sleep`` the sandbox put first in its PATH is not the image's)."""
        if name.startswith("/"):
            candidates = [name]
        elif "/" in name:
            return None  # relative to a working directory: not a declared init
        else:
            candidates = [f"{folder.rstrip('/')}/{name}" for folder in self.path if folder.startswith("/")]
        for candidate in candidates:
            found = _follow_in_root(self.root, candidate)
            if found is None:
                continue
            resolved, links = found
            try:
                info = os.stat(self.root + resolved)
            except OSError:
                continue
            if not stat_module.S_ISREG(info.st_mode) or not info.st_mode & 0o111:
                continue
            upper = self.upper
            if upper is not None and any(os.path.lexists(upper / p.lstrip("/")) for p in [*links, resolved]):
                return None  # the container added or replaced it (or a link to it): not the image's

            return (info.st_dev, info.st_ino)
        return None


def _runs(process: Process, name: str, executables: Executables) -> bool:
    """Whether ``process`` executes the program ``name`` names in the container (not only its argv)."""
    return process.exe is not None and process.exe == executables.identity(name)


def _is_sleep(argv: Sequence[str]) -> bool:
    return len(argv) == 2 and os.path.basename(argv[0]) == "sleep"


def _stateless_shape(
    init: Process,
    others: Sequence[Process],
    command: Sequence[str],
    keepalive: Sequence[str],
    executables: Executables,
) -> str:
    """ "" when the processes are the declared stateless init, else why not."""
    if tuple(init.argv) != tuple(command):
        return f"its init runs {' '.join(init.argv)[:60]!r}, not its configured command"
    if not command or not _runs(init, command[0], executables):
        return f"its init's executable is not the image's {command[0] if command else '?'!r}"
    if tuple(command) == tuple(keepalive):
        extra = [p for p in others if not (p.ppid == init.pid and p.argv == _KEEPALIVE_CHILD)]
        if extra or len(others) > 1:
            return (
                f"processes besides the stateless init: {', '.join(p.describe() for p in (extra or others))}"
            )
        if others and not _runs(others[0], _KEEPALIVE_CHILD[0], executables):
            return f"{others[0].describe()} does not execute the image's sleep"
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
    root = Path(f"{host_proc()}/{init_pid}/root")
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


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library (for setns), loaded once."""
    return ctypes.CDLL(None, use_errno=True)


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
            libc = _libc()
            fd = os.open(f"{host_proc()}/{init_pid}/ns/ipc", os.O_RDONLY)
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


def read_runtime(
    init_pid: int,
    command: Sequence[str],
    keepalive: Sequence[str],
    *,
    path: Sequence[str] = _DEFAULT_PATH,
    upper: Path | None = None,
) -> RuntimeView:
    """Read the sandbox's processes and decide whether its runtime is a fresh stateless init.

    ``init_pid`` is the container's init as the host sees it; ``command`` the sandbox's configured
    command, looked up in ``path`` (the container's PATH); ``upper`` its writable layer.  Any error
    reading the state counts as "not fresh" (a full checkpoint is always safe); a process list that
    could not be read whole is ``unreadable``.
    """
    processes: list[Process] = []
    unreadable = ""
    for _ in range(_SCAN_TRIES):
        try:
            processes = _scan(init_pid)
            unreadable = ""
            break
        except _Gone as gone:
            if gone.args and gone.args[0] == init_pid:
                return RuntimeView(init_pid, (), False, (), "its init is not running")
            unreadable = f"its processes kept exiting while they were read ({_SCAN_TRIES} tries)"
        except _Unreadable as exc:
            unreadable = f"its processes could not be read ({exc})"
            break
    if unreadable:
        return RuntimeView(init_pid, (), False, (), unreadable, unreadable)
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
    executables = Executables(f"{host_proc()}/{init_pid}/root", tuple(path), upper)
    why = _stateless_shape(init, others, command, keepalive, executables)
    if not why:
        try:
            why = _state_beyond_processes(init_pid)
        except Exception as exc:  # anything unreadable means "not known fresh"
            why = f"its state could not be read ({exc})"
    return RuntimeView(init_pid, tuple(processes), not why, tuple(outside), why)


def _container_path(attrs_: dict[str, object]) -> tuple[str, ...]:
    """The PATH of the container's configuration (Docker's default when it sets none)."""
    config = attrs_.get("Config")
    env = config.get("Env") if isinstance(config, dict) else None
    for entry in env or ():
        if isinstance(entry, str) and entry.startswith("PATH="):
            return tuple(folder for folder in entry[5:].split(":") if folder)
    return _DEFAULT_PATH


def _init_start(pid: int) -> int | None:
    """The start time (ticks) of host process ``pid`` when it is alive and not a zombie, else None."""
    try:
        stat = Path(f"{host_proc()}/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
    except (OSError, ValueError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])


def is_alive(pid: int) -> bool:
    """Whether host process ``pid`` exists and is not a zombie (a killed process counts until it
    has exited: one in an uninterruptible sleep goes on showing its command line)."""
    return _init_start(pid) is not None


def _thawed(pid: int, *, proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> bool:
    """Whether the cgroup of ``pid`` is not frozen (False when that cannot be read).

    cgroup v1: the ``freezer`` controller's line names the cgroup; its ``freezer.state`` is THAWED.
    cgroup v2 (unified, the line ``0::/path``): its ``cgroup.freeze`` reads 0, or, where that file
    is missing (the root cgroup), ``cgroup.events`` says ``frozen 0``. ``proc`` and ``cgroup_root``
    are the mount points (tests give other trees).
    """
    try:
        unified: str | None = None
        for line in (proc / str(pid) / "cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if "freezer" in controllers.split(","):
                state = cgroup_root / "freezer" / path.lstrip("/") / "freezer.state"
                return state.read_text().strip() == "THAWED"
            if hierarchy == "0" and not controllers:
                unified = path
        if unified is None:
            return False
        folder = cgroup_root / unified.lstrip("/")
        freeze = folder / "cgroup.freeze"
        if freeze.exists():
            return freeze.read_text().strip() == "0"
        for event in (folder / "cgroup.events").read_text().splitlines():
            key, _, value = event.partition(" ")
            if key == "frozen":
                return value.strip() == "0"
    except (OSError, ValueError):
        return False
    return False


# Container id -> (init pid, its start ticks) when the engine last said "running".
_SEEN_RUNNING: dict[str, tuple[int, int]] = {}
_SEEN_LIMIT = 4096


def still_running(sandbox: Sandbox) -> bool:
    """The sandbox's status is "running" without asking the engine, when that is certain.

    True only when the engine said "running" before (`sandbox_status`) and the same init (pid and
    start time) is still alive, not a zombie, in a cgroup not frozen (v1 freezer or v2): a stop, kill, restart,
    removal or pause each breaks one of these, and then the engine is asked (`sandbox_status`).
    An engine round trip is most of a reference checkpoint's hold (tens of milliseconds loaded).
    """
    seen = _SEEN_RUNNING.get(sandbox.id)
    return seen is not None and _init_start(seen[0]) == seen[1] and _thawed(seen[0], proc=Path(host_proc()))


def sandbox_status(sandbox: Sandbox) -> str:
    """`Sandbox.status` (the engine's view, reloaded) unless `still_running` says "running"."""
    if still_running(sandbox):
        return "running"
    status = sandbox.status()
    _SEEN_RUNNING.pop(sandbox.id, None)
    if status == "running":
        pid = int(sandbox._container.attrs.get("State", {}).get("Pid") or 0)
        start = _init_start(pid) if pid else None
        if start is not None:
            if len(_SEEN_RUNNING) >= _SEEN_LIMIT:
                _SEEN_RUNNING.pop(next(iter(_SEEN_RUNNING)))
            _SEEN_RUNNING[sandbox.id] = (pid, start)
    return status


def sandbox_runtime(sandbox: Sandbox) -> RuntimeView:
    """The sandbox's processes now (its engine view must be current: after `Sandbox.status`)."""
    attrs_ = sandbox._container.attrs
    pid = int(attrs_.get("State", {}).get("Pid") or 0)
    from ._sandbox import KEEPALIVE  # _sandbox is imported by the checkpoint modules, not this one

    return read_runtime(
        pid,
        sandbox.config.command,
        KEEPALIVE,
        path=_container_path(attrs_),
        upper=sandbox.engine.upper_dir(sandbox._container),
    )


def refuse_uncaptured(view: RuntimeView, sandbox_id: str) -> None:
    """Raise `UncapturedProcessError` when a process of the sandbox is outside its init's tree, and
    `RuntimeUnreadableError` when its processes could not be read whole (none can be ruled out)."""
    if view.unreadable:
        raise RuntimeUnreadableError(
            f"sandbox {sandbox_id[:12]}: {view.unreadable}, so a process outside its init's tree cannot be "
            "ruled out and no checkpoint was taken; the previous ready checkpoint is still in effect. "
            "Run belayer-envckpt as root with access to /proc, and retry the checkpoint"
        )
    if view.outside_init:
        names = tuple(p.describe() for p in view.outside_init)
        raise UncapturedProcessError(
            f"sandbox {sandbox_id[:12]} runs {', '.join(names)} outside its init's process tree (started "
            "by an exec from outside belayer-envckpt, e.g. `docker exec -d`): a checkpoint would lose it, "
            "so none was taken and the previous ready checkpoint is still in effect. Start background "
            "processes through Sandbox.exec (`cmd &`), or stop that process before the checkpoint",
            names,
        )
