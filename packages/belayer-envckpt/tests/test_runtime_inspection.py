"""How a checkpoint reads a sandbox's processes from the host: a process is the stateless init only
when its executable is the image's program (not when its argv says so), and /proc reads that race
with the sandbox or are refused are handled or in a typed error, never in a stray OSError."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import BUSYBOX, DEBIAN

from belayer_envckpt import (
    CheckpointFailedError,
    CheckpointKind,
    CheckpointStore,
    RuntimeUnreadableError,
    Sandbox,
    _runtime,
    checkpoint,
    full_checkpoint,
    next_checkpoint_kind,
)
from belayer_envckpt._runtime import read_runtime, refuse_uncaptured, sandbox_runtime, still_running

# A python program that holds state in memory; run as `exec -a sleep python3 3600` it shows the
# argv of the keep-alive's `sleep 3600`.
HOLDER = "import time\\nn = 0\\nwhile True:\\n    n += 1\\n    time.sleep(0.05)\\n"


def init_pid(sandbox: Sandbox) -> int:
    sandbox.status()
    return int(sandbox._container.attrs["State"]["Pid"])


def children_argv(pid: int) -> list[tuple[str, ...]]:
    """The argv of each child of ``pid`` (read from /proc)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        raw = Path(f"/proc/{child}/cmdline").read_bytes()
        found.append(tuple(part.decode() for part in raw.split(b"\0")[:-1]))
    return found


def wait_for_children(pid: int, argv: list[tuple[str, ...]], timeout: float = 20.0) -> None:
    """Until ``pid``'s children have exactly these argv (a forked child has exec'd)."""
    deadline = time.monotonic() + timeout
    while children_argv(pid) != argv:
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} has children {children_argv(pid)}, never {argv}")
        time.sleep(0.05)


@pytest.mark.parametrize("child", ["exec -a sleep python3 3600", "sleep 3600"])
def test_a_child_is_the_declared_sleep_only_when_it_runs_the_images_sleep(make_sandbox, child):
    # An init shaped like the keep-alive (one child with argv `sleep 3600`): argv alone would call
    # the python child a stateless sleep.
    command = ("/bin/bash", "-c", f"printf '{HOLDER}' > /3600; cd /; {child} & wait")
    sandbox = make_sandbox(DEBIAN, "argv", command=command)
    pid = init_pid(sandbox)
    wait_for_children(pid, [("sleep", "3600")])
    view = read_runtime(pid, command, command)
    assert [p.argv for p in view.processes if p.pid != pid] == [("sleep", "3600")]
    if child.startswith("exec -a"):
        assert not view.fresh
        assert "does not execute the image's sleep" in view.why_not_fresh
    else:
        assert view.fresh, view.why_not_fresh  # the control: the image's own sleep is the stateless init


def test_a_sleep_the_sandbox_put_first_in_its_path_makes_the_checkpoint_full(make_sandbox, track, tmp_path):
    sandbox = make_sandbox(DEBIAN, "hijack")
    store = CheckpointStore(tmp_path / "store")
    assert next_checkpoint_kind(sandbox, store, "hijack") is CheckpointKind.FRESH_RUNTIME
    # The keep-alive runs `sleep 3600` by name: a `sleep` earlier in PATH that is python, and the
    # current sleep killed, makes its next child a python program holding state, argv `sleep 3600`.
    sandbox.exec(f"printf '{HOLDER}' > /3600 && ln -s /usr/bin/python3 /usr/local/bin/sleep")
    pid = init_pid(sandbox)
    old = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in old:
        os.kill(int(child), 15)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children and children != old:
            break
        time.sleep(0.05)
    wait_for_children(pid, [("sleep", "3600")])
    view = sandbox_runtime(sandbox)
    others = [p for p in view.processes if p.pid != pid]
    assert [p.argv for p in others] == [("sleep", "3600")]
    assert Path(f"/proc/{others[0].pid}/exe").resolve().name.startswith("python3")
    assert not view.fresh
    assert next_checkpoint_kind(sandbox, store, "hijack") is CheckpointKind.FULL
    ckpt = checkpoint(sandbox, "hijack", store=store)
    assert (ckpt.kind, ckpt.runtime) == ("full", "criu")


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_process_that_exits_between_the_listing_and_its_read_makes_a_new_scan(make_sandbox, monkeypatch):
    sandbox = make_sandbox(DEBIAN, "gone")
    listing = _runtime._pids_of
    calls = []

    def first_listing_holds_an_exited_process(pid: int) -> list[int]:
        calls.append(pid)
        found = listing(pid)
        return [*found, dead_pid()] if len(calls) == 1 else found

    monkeypatch.setattr(_runtime, "_pids_of", first_listing_holds_an_exited_process)
    view = sandbox_runtime(sandbox)
    assert len(calls) == 2
    assert (view.fresh, view.unreadable, view.outside_init) == (True, "", ())


def test_processes_that_keep_exiting_make_the_view_unreadable_and_the_checkpoint_a_typed_refusal(
    make_sandbox, monkeypatch, tmp_path
):
    sandbox = make_sandbox(DEBIAN, "churn")
    store = CheckpointStore(tmp_path / "store")
    listing = _runtime._pids_of
    monkeypatch.setattr(_runtime, "_pids_of", lambda pid: [*listing(pid), dead_pid()])
    view = sandbox_runtime(sandbox)
    assert not view.fresh
    assert "kept exiting" in view.unreadable
    assert next_checkpoint_kind(sandbox, store, "churn") is CheckpointKind.FULL
    for take in (checkpoint, full_checkpoint):
        with pytest.raises(RuntimeUnreadableError, match="cannot be ruled out"):
            take(sandbox, "churn", store=store)
    assert store.latest_ready("churn") is None
    assert store.leftovers("churn") == []
    assert sandbox.status() == "running"  # thawed after the refusal


def test_an_init_that_is_gone_reads_as_not_running():
    view = read_runtime(dead_pid(), ("sleep", "1"), ("sleep", "1"))
    assert (view.fresh, view.why_not_fresh, view.unreadable) == (False, "its init is not running", "")


def test_a_permission_refused_by_proc_is_an_unreadable_view_not_an_oserror(make_sandbox):
    sandbox = make_sandbox(DEBIAN, "perm")
    pid = init_pid(sandbox)
    # Read as an unprivileged user: /proc/PID/exe of a root process refuses it (EACCES).  A forked
    # child drops to nobody and reads with the modules already loaded (nothing to import from a
    # folder nobody may not read), and sends what it saw back through a pipe.
    command = tuple(sandbox.config.command)
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        code = 1
        try:
            os.close(reader)
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(65534, 65534, 65534)
            view = read_runtime(pid, command, command)
            try:
                refuse_uncaptured(view, "x")
                refused = ""
            except RuntimeUnreadableError as exc:
                refused = str(exc)
            answer = {"fresh": view.fresh, "unreadable": view.unreadable, "refused": refused}
            os.write(writer, json.dumps(answer).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        raw = pipe.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, raw
    result = json.loads(raw)
    assert result["fresh"] is False
    assert "Permission denied" in result["unreadable"]
    assert "cannot be ruled out" in result["refused"]


def test_a_running_sandbox_is_checkpointed_without_asking_the_engine_until_it_stops_being_so(
    make_sandbox, monkeypatch, tmp_path
):
    sandbox = make_sandbox(BUSYBOX, "fast")
    store = CheckpointStore(tmp_path / "store")
    assert checkpoint(sandbox, "fast", store=store).kind == "fresh-runtime"
    asked = []
    real_status = Sandbox.status

    def counted(self: Sandbox) -> str:
        asked.append(self.id)
        return real_status(self)

    monkeypatch.setattr(Sandbox, "status", counted)
    assert still_running(sandbox)
    assert checkpoint(sandbox, "fast", store=store).kind == "reference"
    assert asked == []  # the same init, alive and thawed: no engine round trip
    sandbox.pause()  # the engine's pause freezes the cgroup: the engine is asked again
    assert not still_running(sandbox)
    with pytest.raises(CheckpointFailedError, match="paused"):
        checkpoint(sandbox, "fast", store=store)
    assert asked
    sandbox.unpause()
    assert checkpoint(sandbox, "fast", store=store).kind == "reference"
    sandbox.kill()  # the init is gone
    assert not still_running(sandbox)
    with pytest.raises(CheckpointFailedError, match="not running"):
        checkpoint(sandbox, "fast", store=store)
    assert next_checkpoint_kind(sandbox, store, "fast") is CheckpointKind.FULL
