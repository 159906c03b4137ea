"""Commands run inside a container: the result value and the one exec routine with a timeout."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import docker.transport

from ._boundary import engine_errors
from ._errors import BelayerEnvckptError, ContainerEngineError, ContainerNotFoundError
from ._exec_stream import read_exec_output
from ._procfs import InContainer, host_proc, kill_host_processes


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


def kill_tree(pid: int, in_container: InContainer | None = None) -> None:
    """SIGKILL ``pid`` and every descendant (an exec's children keep its output pipe open);
    ``in_container`` as in `kill_host_processes` (from a PID namespace of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path(host_proc()).iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(children.get(current, []))
    with contextlib.suppress(ProcessLookupError):
        kill_host_processes(tree, signal.SIGKILL, in_container)


def signal_in_container(api: Any, container_id: str) -> InContainer:
    """A sender of signals to ``container_id``'s processes by their pids in its namespace: one exec
    of the shell's `kill` builtin, as root, through the engine (which reaches any namespace).

    That exec may not run: the container at its pids limit (exactly when a fork loop hit it), no
    `/bin/sh` in the image, no kill capability. A SIGKILL that cannot be sent so kills the whole
    container instead (its processes must not run on; the sandbox is then down, a failure its owner
    restores from a checkpoint like any other); another signal raises `ContainerEngineError`."""

    def send(pids: Sequence[int], signum: int) -> None:
        argv = ["/bin/sh", "-c", f"kill -{int(signum)} {' '.join(str(int(pid)) for pid in pids)}"]
        what = f"signalling processes {list(pids)} in container {container_id[:12]}"
        try:
            with engine_errors(what, container=container_id):
                exec_id = api.exec_create(container_id, argv, user="0")["Id"]
                api.exec_start(exec_id)
                code = api.exec_inspect(exec_id).get("ExitCode")
            if code not in (0, None):
                raise ContainerEngineError(f"{what}: `kill` exited with {code}")
        except ContainerNotFoundError:
            return  # gone with its processes
        except BelayerEnvckptError:
            if signum != signal.SIGKILL:
                raise
            with engine_errors(f"killing container {container_id[:12]}", container=container_id):
                api.kill(container_id, signal="SIGKILL")

    return send


def kill_exec(api: Any, exec_id: str, what: str, container_id: str, *, pid_wait_s: float = 30.0) -> None:
    """Kill exec ``exec_id``'s process tree if it runs.  An exec the engine has not started yet
    (Pid 0, no exit code: a slow engine) is inspected again until its Pid appears (then killed) or
    it has exited, for at most ``pid_wait_s``; an exec that has exited is left alone (its Pid may
    already name another process)."""
    deadline = time.monotonic() + pid_wait_s
    while True:
        with engine_errors(what, container=container_id):
            info = api.exec_inspect(exec_id)
        pid = int(info.get("Pid") or 0)
        if info.get("Running") and pid:
            kill_tree(pid, signal_in_container(api, container_id))
            return
        if info.get("ExitCode") is not None or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def engine_socket_path(api: Any) -> str | None:
    """The engine's Unix socket path when ``api`` (a docker ``APIClient``) talks to a local Unix
    socket; None for a tcp / TLS / ssh engine."""
    get_adapter = getattr(api, "get_adapter", None)
    if get_adapter is None:
        return None
    try:
        adapter = get_adapter(api.base_url)
    except Exception:  # requests' InvalidSchema: no adapter, so not a Unix socket either
        return None
    if isinstance(adapter, docker.transport.UnixHTTPAdapter):
        return str(adapter.socket_path)
    return None


def exec_in(
    api: Any, container_id: str, argv: Sequence[str], *, workdir: str, timeout_s: float
) -> ExecResult:
    """Run ``argv`` in a running container; at ``timeout_s`` its whole process tree is killed.

    On a local Unix-socket engine the output is read by `read_exec_output` over its own
    connection (docker-py's ``exec_start`` can drop output that arrives with the response head);
    on a tcp / TLS engine docker-py's ``exec_start`` is used as it is.
    """
    what = f"running {list(argv)[:3]!r} in container {container_id[:12]}"
    with engine_errors(what, container=container_id):
        exec_id = api.exec_create(container_id, list(argv), workdir=workdir)["Id"]

    def kill() -> None:
        kill_exec(api, exec_id, what, container_id)

    started = time.perf_counter()
    socket_path = engine_socket_path(api)
    if socket_path is not None:
        with engine_errors(what, container=container_id):
            stdout, stderr, timed_out = read_exec_output(
                socket_path,
                str(api.api_version),
                exec_id,
                timeout_s=timeout_s,
                kill=kill,
                what=what,
                connect_timeout_s=float(getattr(api, "timeout", None) or 60),
            )
    else:
        stdout, stderr, timed_out = _exec_start_sdk(api, exec_id, what, container_id, timeout_s, kill)
    duration_s = time.perf_counter() - started
    with engine_errors(what, container=container_id):
        info = api.exec_inspect(exec_id)
        # The stream can end a moment before the engine records the exit code.
        settle = time.monotonic() + 30
        while info.get("Running") and time.monotonic() < settle:
            time.sleep(0.02)
            info = api.exec_inspect(exec_id)
    code = info.get("ExitCode")
    return ExecResult(
        stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
        int(code) if code is not None and not info.get("Running") else -1,
        duration_s,
        timed_out,
    )


def _exec_start_sdk(
    api: Any, exec_id: str, what: str, container_id: str, timeout_s: float, kill: Callable[[], None]
) -> tuple[bytes, bytes, bool]:
    """docker-py's ``exec_start`` in a thread (the path for engines that are not a Unix socket)."""
    output: list[tuple[bytes | None, bytes | None]] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            output.append(api.exec_start(exec_id, demux=True))
        except Exception as exc:  # re-raised, translated, in the calling thread
            failure.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout_s)
    timed_out = runner.is_alive()
    if timed_out:
        kill()
        runner.join(30)
    with engine_errors(what, container=container_id):
        if failure:
            raise failure[0]
    stdout, stderr = output[0] if output else (b"", b"")
    return stdout or b"", stderr or b"", timed_out
