"""The watch that turns a hit limit into a detected sandbox failure, and the disk and size caps.

The engine enforces pids, memory and CPU, but nothing tells the caller that an action ran into
them, and it cannot cap the writable layer here (overlay2 on ext4 has no project quota).
`LimitGuard` runs around one action: it measures the layer every ``disk_poll_s``, reads the
container's cgroup counters (OOM kills, refused forks) before and after, and on a hit kills the
processes the action started and raises `SandboxLimitError`.  `check_checkpointable` and
`check_checkpoint_size` hold a checkpoint to the same caps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs

from ._errors import BelayerEnvckptError, CheckpointFailedError, CheckpointTooLargeError, SandboxLimitError
from ._limits import MIB, LimitCause, SandboxLimits, host_has_cap_sys_resource, is_root_user
from ._procfs import InContainer, host_proc, kill_host_processes
from ._runtime import container_pids, is_alive

POLL_COST_RATIO = 9.0
# How long a hit limit's kill waits for the action's processes to be gone.
KILL_SETTLE_S = 10.0

# -- the disk cap ---------------------------------------------------------------------------


def layer_size_bytes(upper: Path) -> int:
    """Bytes the writable layer holds as a layer archive would store them (apparent sizes, links once)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    todo = [str(upper)]
    while todo:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError), os.scandir(todo.pop()) as it:
            for entry in it:
                with contextlib.suppress(FileNotFoundError):
                    st = entry.stat(follow_symlinks=False)
                    if entry.is_dir(follow_symlinks=False):
                        todo.append(entry.path)
                    elif (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
                    total += 512  # a header per member
    return total


def check_layer(limits: SandboxLimits, upper: Path, sandbox_id: str) -> None:
    """Refuse (`SandboxLimitError`, cause disk) a layer already over ``disk_mb``."""
    if not limits.disk_mb:
        return
    size = layer_size_bytes(upper)
    if size > limits.disk_mb * MIB:
        raise SandboxLimitError(
            f"sandbox {sandbox_id[:12]}: its writable layer holds {size // MIB} MB, over its disk cap of "
            f"{limits.disk_mb} MB. Nothing was checkpointed; restore its latest ready checkpoint "
            "(full_restore), or create the sandbox with a larger SandboxLimits.disk_mb",
            cause=LimitCause.DISK,
            sandbox_id=sandbox_id,
        )


def check_checkpointable(limits: SandboxLimits, user: str, upper: Path, sandbox_id: str) -> None:
    """Refuse, before anything is frozen or written, a checkpoint that cannot or may not be taken.

    CRIU reads every process's resource limits (prlimit); for a process of another uid that needs
    CAP_SYS_RESOURCE, which root lacks on some hosts (measured: "Can't get rlimit: Operation not
    permitted", the dump fails).  The layer must be within the disk cap.
    """
    if not is_root_user(user) and not host_has_cap_sys_resource():
        raise CheckpointFailedError(
            f"sandbox {sandbox_id[:12]} runs as user {user!r}, and this host's root lacks CAP_SYS_RESOURCE, "
            "which CRIU needs to read a non-root process's resource limits: its dump would fail. Create "
            "checkpointed sandboxes without a user (root inside the container, with only "
            "SandboxLimits.capabilities and no-new-privileges), or run on a host whose root has "
            "CAP_SYS_RESOURCE (`belayer-envckpt doctor` says which)"
        )
    check_layer(limits, upper, sandbox_id)


def check_checkpoint_size(limits: SandboxLimits, num_bytes: int, sandbox_id: str) -> None:
    """Raise `CheckpointTooLargeError` for a captured checkpoint over ``checkpoint_cap_mb``."""
    cap = limits.checkpoint_cap_mb
    if cap and num_bytes > cap * MIB:
        raise CheckpointTooLargeError(
            f"the checkpoint of sandbox {sandbox_id[:12]} holds {num_bytes // MIB} MB, over its cap of "
            f"{cap} MB; it was removed and the previous ready checkpoint is still in effect. Raise "
            "SandboxLimits.checkpoint_mb, or lower what the sandbox keeps in memory and on disk"
        )


# -- cgroup counters ------------------------------------------------------------------------


@attrs.frozen
class CgroupFiles:
    """The host's cgroup files of one container (cgroup v1 controllers, or the v2 unified tree)."""

    memory: Path | None
    pids: Path | None

    @classmethod
    def of_pid(cls, pid: int, root: Path = Path("/sys/fs/cgroup")) -> CgroupFiles:
        """Locate the cgroups of host process ``pid`` (the container's init)."""
        found: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for line in Path(f"{host_proc()}/{pid}/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                for name in controllers.split(",") if controllers else ["unified"]:
                    found[name] = path.lstrip("/")
        unified = root / "unified" if (root / "unified").is_dir() else root

        def where(name: str) -> Path | None:
            if name in found and (root / name / found[name]).is_dir():
                return root / name / found[name]
            if "unified" in found and (unified / found["unified"] / f"{name}.events").exists():
                return unified / found["unified"]
            return None

        return cls(where("memory"), where("pids"))

    def oom_kills(self) -> int:
        """Processes the OOM killer killed in this cgroup so far."""
        return _counter(self.memory, ("memory.oom_control", "memory.events"), "oom_kill")

    def refused_forks(self) -> int:
        """Forks the pids limit refused so far."""
        return _counter(self.pids, ("pids.events",), "max")


def _counter(directory: Path | None, files: tuple[str, ...], key: str) -> int:
    for name in files:
        if directory is not None and (directory / name).exists():
            with contextlib.suppress(OSError):
                for line in (directory / name).read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == key:
                        return int(parts[1])
    return 0


# -- the watch around one action ------------------------------------------------------------


@attrs.define
class LimitGuard:
    """Watches one action: polls the layer against the disk cap, then reads the cgroup counters.

    ``seen`` are the counters (OOM kills, refused forks) the sandbox's previous action ended with,
    so a limit a background process hit between two actions is reported by the next one; ``after``
    are the counters this action ended with.

    On a hit it kills the processes the action started (those not in the container before it),
    so the sandbox is not left full of them, and `check` raises `SandboxLimitError`.
    """

    limits: SandboxLimits
    sandbox_id: str
    init_pid: int
    upper: Path | None
    is_oom_killed: Callable[[], bool] = lambda: False
    seen: tuple[int, int] | None = None
    # How a kill reaches the container's processes from a PID namespace of its own (`_procfs`).
    in_container: InContainer | None = None
    after: tuple[int, int] | None = attrs.field(default=None, init=False)
    _files: CgroupFiles | None = attrs.field(default=None, init=False)
    _before: tuple[int, int] = attrs.field(default=(0, 0), init=False)
    _procs_before: set[int] = attrs.field(factory=set, init=False)
    _layer_peak: int = attrs.field(default=0, init=False)
    _stop: threading.Event = attrs.field(factory=threading.Event, init=False)

    @contextlib.contextmanager
    def watching(self) -> Iterator[LimitGuard]:
        """Run the action inside this block; `check` afterwards."""
        self._files = CgroupFiles.of_pid(self.init_pid) if self.init_pid else CgroupFiles(None, None)
        self._before = self.seen if self.seen is not None else self._counters()
        self._procs_before = container_pids(self.init_pid) if self.init_pid else set()
        poller = None
        if self.limits.disk_mb and self.upper is not None:
            poller = threading.Thread(target=self._poll_disk, daemon=True)
            poller.start()
        try:
            yield self
        finally:
            self._stop.set()
            if poller is not None:
                poller.join(60)

    def _counters(self) -> tuple[int, int]:
        assert self._files is not None
        return self._files.oom_kills(), self._files.refused_forks()

    def _over_disk(self) -> bool:
        assert self.upper is not None
        self._layer_peak = max(self._layer_peak, layer_size_bytes(self.upper))
        return self._layer_peak > self.limits.disk_mb * MIB

    def _poll_disk(self) -> None:
        # A walk costs time in proportion to the layer's files (measured: about 0.25 s for 10,000
        # on the loaded 2-core machine, benchmarks/results/bench_limits.json); waiting at least
        # POLL_COST_RATIO walks between two keeps the poll under a tenth of a core.
        wait_s = self.limits.disk_poll_s
        while not self._stop.wait(wait_s):
            started = time.perf_counter()
            if self._over_disk():
                self._kill_action()
                return
            wait_s = max(self.limits.disk_poll_s, POLL_COST_RATIO * (time.perf_counter() - started))

    def _kill_action(self) -> None:
        """SIGKILL the processes the action started until none is left (bounded by KILL_SETTLE_S).

        One listing then one kill is not enough: a process the action forked after the listing
        outlives it, and a killed one in an uninterruptible sleep (a page fault under I/O load)
        lives on for a while under its old command line (CI saw the disk filler's shell there).
        Zombies count as gone: a killed process whose new parent, the container's init, never
        reaps it stays one.
        """
        assert self._files is not None
        deadline = time.monotonic() + KILL_SETTLE_S
        while True:
            started = container_pids(self.init_pid) - self._procs_before - {self.init_pid}
            alive = {pid for pid in started if is_alive(pid)}
            if not alive or time.monotonic() > deadline:
                return
            # Best effort: `check` reports the hit whether or not the kill got through.
            try:
                kill_host_processes(alive, signal.SIGKILL, self.in_container)
            except (ProcessLookupError, PermissionError, BelayerEnvckptError):
                return
            time.sleep(0.01)

    def check(self, result: object = None) -> None:
        """Raise `SandboxLimitError` if the action hit a limit (its processes are killed first)."""
        assert self._files is not None
        self.after = self._counters()
        oom, forks = self.after[0] - self._before[0], self.after[1] - self._before[1]
        over_disk = bool(self.limits.disk_mb and self.upper is not None and self._over_disk())
        gone = self._files.memory is not None and not self._files.memory.is_dir()
        if oom > 0 or (gone and self.is_oom_killed()):
            cause, detail = LimitCause.MEMORY, f"the OOM killer killed {max(oom, 1)} process(es) at its "
            detail += f"memory limit of {self.limits.memory_mb} MB (no swap)"
        elif forks > 0:
            cause, detail = (
                LimitCause.PIDS,
                f"{forks} fork(s) were refused at its pids limit of {self.limits.pids}",
            )
        elif over_disk:
            cause = LimitCause.DISK
            detail = f"its writable layer grew to {self._layer_peak // MIB} MB, over its disk cap of {self.limits.disk_mb} MB"
        else:
            return
        self._kill_action()
        raise SandboxLimitError(
            f"sandbox {self.sandbox_id[:12]} failed: {detail}. The action's processes were killed and "
            "its effects may be partial: restore the latest ready checkpoint (full_restore) and go on "
            "from its prefix, or raise the limit in SandboxLimits",
            cause=cause,
            sandbox_id=self.sandbox_id,
            result=result,
        )


def init_killed_error(limits: SandboxLimits, sandbox_id: str) -> SandboxLimitError:
    """The failure of a sandbox whose init the OOM killer killed (the container is down)."""
    return SandboxLimitError(
        f"sandbox {sandbox_id[:12]} is down: the OOM killer killed its init at its memory limit of "
        f"{limits.memory_mb} MB (no swap). Restore its latest ready checkpoint (full_restore) and go on "
        "from its prefix, or raise SandboxLimits.memory_mb",
        cause=LimitCause.MEMORY,
        sandbox_id=sandbox_id,
    )
