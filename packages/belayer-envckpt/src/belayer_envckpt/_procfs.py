"""Where envckpt reads the processes of the engine's containers: the host's /proc.

A sandbox's processes run on the machine of its Docker daemon; envckpt reads them through that
machine's procfs (their pids as the daemon reports them). By default that is this process's own
`/proc`. A process in a PID namespace of its own that drives the machine's daemon (a node of
belayer-cluster's `IsolatedRayCluster`) sees the host's procfs elsewhere: `BELAYER_ENVCKPT_HOST_PROC`
names that folder.
"""

from __future__ import annotations

import os

HOST_PROC_ENV = "BELAYER_ENVCKPT_HOST_PROC"


def host_proc() -> str:
    """The procfs where the containers' pids are the host's (`/proc` unless set otherwise)."""
    return os.environ.get(HOST_PROC_ENV) or "/proc"


def kill_host_process(pid: int, signum: int) -> None:
    """Send `signum` to the host's process `pid`. From a PID namespace of its own (the host's procfs
    elsewhere) no signal can reach a process by its host pid, and the same number may name one of
    this namespace's own: nothing is sent then (`ProcessLookupError`, as for a process gone)."""
    if host_proc() != "/proc":
        raise ProcessLookupError(
            f"process {pid} is the host's; this process is in a PID namespace of its own"
        )
    os.kill(pid, signum)
