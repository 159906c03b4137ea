"""Commands run inside a container: the result value and the one exec routine with a timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from ._boundary import engine_errors


@attrs.frozen
class ExecResult:
    """The outcome of one command run in a container."""

    stdout: str
    stderr: str
    exit_code: int
    duration_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """Whether the command exited with 0 before its timeout."""
        return self.exit_code == 0 and not self.timed_out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every descendant (an exec's children keep its output pipe open)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    todo = [pid]
    while todo:
        current = todo.pop()
        todo.extend(children.get(current, []))
        with contextlib.suppress(ProcessLookupError):
            os.kill(current, signal.SIGKILL)


def exec_in(
    api: Any, container_id: str, argv: Sequence[str], *, workdir: str, timeout_s: float
) -> ExecResult:
    """Run ``argv`` in a running container; at ``timeout_s`` its whole process tree is killed."""
    what = f"running {list(argv)[:3]!r} in container {container_id[:12]}"
    with engine_errors(what, container=container_id):
        exec_id = api.exec_create(container_id, list(argv), workdir=workdir)["Id"]
    output: list[tuple[bytes | None, bytes | None]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            output.append(api.exec_start(exec_id, demux=True))
        except Exception as exc:  # re-raised, translated, in the calling thread
            failure.append(exc)

    started = time.perf_counter()
    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout_s)
    timed_out = runner.is_alive()
    with engine_errors(what, container=container_id):
        if timed_out:
            pid = api.exec_inspect(exec_id).get("Pid", 0)
            if pid:
                kill_tree(int(pid))
            runner.join(30)
        duration_s = time.perf_counter() - started
        if failure:
            raise failure[0]
        info = api.exec_inspect(exec_id)
    stdout, stderr = output[0] if output else (b"", b"")
    code = info.get("ExitCode")
    return ExecResult(
        (stdout or b"").decode(errors="replace"),
        (stderr or b"").decode(errors="replace"),
        int(code) if code is not None else -1,
        duration_s,
        timed_out,
    )
