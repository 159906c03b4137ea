"""Where envckpt reads the processes of the engine's containers: the host's /proc.

A sandbox's processes run on the machine of its Docker daemon; envckpt reads them through that
machine's procfs (their pids as the daemon reports them). By default that is this process's own
`/proc`. A process in a PID namespace of its own that drives the machine's daemon (a node of
belayer-cluster's `IsolatedRayCluster`) sees the host's procfs elsewhere: `BELAYER_ENVCKPT_HOST_PROC`
names that folder.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

HOST_PROC_ENV = "BELAYER_ENVCKPT_HOST_PROC"


def host_proc() -> str:
    """The procfs where the containers' pids are the host's (`/proc` unless set otherwise)."""
    return os.environ.get(HOST_PROC_ENV) or "/proc"


def container_pid(pid: int) -> int | None:
    """The pid the host's process `pid` has in its innermost PID namespace (its container's), from
    the `NSpid` line of its status in the host's procfs; None once it is gone."""
    try:
        status = Path(host_proc(), str(pid), "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return None


# `signal_in_container(pids, signum)`: sends `signum` to the container's processes named by
# their pids in its own namespace (through the engine: a process of another PID namespace cannot).
InContainer = Callable[[Sequence[int], int], None]


def kill_host_processes(pids: Collection[int], signum: int, in_container: InContainer | None = None) -> None:
    """Send `signum` to the host's processes `pids` (gone ones are skipped). In the host's PID
    namespace by `os.kill`. From a PID namespace of its own (the host's procfs elsewhere, as on an
    isolated node) no signal reaches a process by its host pid, and the same number may name one
    of this namespace's own: the pids are translated to the container's namespace and sent through
    `in_container`; without it nothing is sent (`ProcessLookupError`)."""
    if host_proc() == "/proc":
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        return
    if in_container is None:
        raise ProcessLookupError(
            f"processes {sorted(pids)} are the host's; this process is in a PID namespace of its own"
        )
    inner = [found for pid in pids if (found := container_pid(pid)) is not None]
    if inner:
        in_container(inner, signum)
