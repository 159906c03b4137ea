"""The reset that readies a done trajectory's sandbox for another one (a pool's reuse)."""

from __future__ import annotations

import shlex

__all__ = ["reuse_reset_argv"]


def reuse_reset_argv(working_dir: str) -> list[str]:
    """Kill every process but PID 1 (twice: one forked meanwhile is caught), then empty
    ``working_dir``'s contents.

    The contents, not the folder: the container's processes have it as their working directory,
    and CRIU cannot checkpoint a process whose working directory was deleted ("Can't create link
    remap"), so a sandbox reset with ``rm -rf DIR`` could never be checkpointed again.
    """
    folder = shlex.quote(working_dir.rstrip("/") or "/")
    kill = "kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null"
    return [
        "/bin/sh",
        "-c",
        f"{kill}; rm -rf -- {folder}/* {folder}/.[!.]* {folder}/..?* && mkdir -p {folder}",
    ]
