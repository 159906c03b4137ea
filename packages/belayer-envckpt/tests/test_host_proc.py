"""What a sandbox host on a node of its own needs from envckpt (belayer-cluster's isolated nodes):
a restored container labelled with its new owner, and the containers' processes read through the
host's /proc where the caller's own /proc is another PID namespace's (`BELAYER_ENVCKPT_HOST_PROC`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import DEBIAN

from belayer_envckpt import CheckpointStore, SandboxLimits, full_checkpoint, full_restore
from belayer_envckpt._procfs import HOST_PROC_ENV, container_pid, host_proc, kill_host_processes
from belayer_envckpt._runtime import _container_path, sandbox_runtime
from belayer_envckpt._sandbox import KEEPALIVE


def test_a_restore_carries_the_labels_it_is_given_over_the_checkpoints(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(trajectory="owned")
    sandbox.exec("echo one > /f")
    ckpt = full_checkpoint(sandbox, "owned", store=CheckpointStore(tmp_path))
    restored = track(full_restore(ckpt, engine=engine, labels={"belayer.node": "node-b"}))
    assert [c.id for c in engine.list_containers(["belayer.node=node-b"])] == [restored.id]
    assert restored.exec("cat /f").stdout == "one\n"
    plain = track(full_restore(ckpt, engine=engine, remove_failed=False))  # no labels: the checkpoint's
    assert plain.id not in [c.id for c in engine.list_containers(["belayer.node=node-b"])]


@pytest.mark.skipif(os.geteuid() != 0, reason="a bind mount of /proc needs root")
def test_the_runtime_is_read_through_the_host_proc_it_is_told(make_sandbox, tmp_path, monkeypatch):
    sandbox = make_sandbox(trajectory="procs")
    sandbox.status()
    expected = sandbox_runtime(sandbox)
    assert expected.fresh
    bound = tmp_path / "host-proc"
    bound.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", "/proc", str(bound)], check=True)
    try:
        monkeypatch.setenv(HOST_PROC_ENV, str(bound))
        assert host_proc() == str(bound)
        seen = sandbox_runtime(sandbox)
        assert (seen.fresh, [p.pid for p in seen.processes]) == (True, [p.pid for p in expected.processes])
        # A signal cannot reach a host process by pid from another PID namespace: without a way
        # through the engine, none is sent.
        with pytest.raises(ProcessLookupError, match="PID namespace of its own"):
            kill_host_processes([os.getpid()], signal.SIGKILL)
        empty = tmp_path / "empty"
        empty.mkdir()
        monkeypatch.setenv(HOST_PROC_ENV, str(empty))  # the setting is what is read: nothing there
        assert not sandbox_runtime(sandbox).fresh
    finally:
        subprocess.run(["umount", str(bound)], check=True)
    monkeypatch.delenv(HOST_PROC_ENV)
    assert host_proc() == "/proc"
    assert Path(host_proc(), str(os.getpid())).is_dir()


def _run_in_child_pid_namespace(bound: Path, code: str, *args: str, timeout_s: float = 120) -> Any:
    """Run Python `code` with `args` in a PID and mount namespace of its own, as a node of an
    isolated cluster is (its own /proc; the host's bound read-only at `bound`, named by
    `BELAYER_ENVCKPT_HOST_PROC`); the JSON document it prints."""
    bound.mkdir(exist_ok=True)
    positional = " ".join(f'"${i}"' for i in range(1, len(args) + 2))
    script = f'mount --bind -o ro /proc {bound} && mount -t proc proc /proc && exec "$0" -c {positional}'
    unshare = ["unshare", "--pid", "--fork", "--mount", "--propagation", "private"]
    done = subprocess.run(
        [*unshare, "sh", "-c", script, sys.executable, code, *args],
        env={**os.environ, HOST_PROC_ENV: str(bound)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


_READ_IN_CHILD_NAMESPACE = """
import json, sys
from belayer_envckpt._runtime import read_runtime
view = read_runtime(int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), path=json.loads(sys.argv[4]))
print(json.dumps({"fresh": view.fresh, "pids": sorted(p.pid for p in view.processes),
                  "outside": [p.pid for p in view.outside_init], "unreadable": view.unreadable}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="PID and mount namespaces need root")
def test_the_runtime_is_read_whole_from_a_pid_namespace_of_its_own(make_sandbox, engine, tmp_path):
    # As on a node of belayer-cluster's IsolatedRayCluster: this process's /proc is its own PID
    # namespace's, the host's is bound elsewhere. The kernel lists a cgroup's processes in the
    # reader's namespace (none of the container's there) and refuses the `ns` links of processes
    # outside it, yet the view must hold every process of the sandbox, a detached one included.
    sandbox = make_sandbox(trajectory="pidns")
    sandbox.status()
    attrs_ = sandbox._container.attrs
    init = int(attrs_["State"]["Pid"])
    bound = tmp_path / "host-proc"

    def read_from_child_namespace() -> dict[str, Any]:
        argv = [json.dumps(list(sandbox.config.command)), json.dumps(list(KEEPALIVE))]
        argv.append(json.dumps(list(_container_path(attrs_))))
        read: dict[str, Any] = _run_in_child_pid_namespace(
            bound, _READ_IN_CHILD_NAMESPACE, str(init), *argv, timeout_s=60
        )
        return read

    here = sorted(p.pid for p in sandbox_runtime(sandbox).processes)  # read in this PID namespace
    assert init in here
    seen = read_from_child_namespace()
    assert seen == {"fresh": True, "pids": here, "outside": [], "unreadable": ""}
    engine._client.api.exec_start(engine._client.api.exec_create(sandbox.id, ["sleep", "77"]), detach=True)
    for _ in range(100):  # a detached exec returns before runc has started the command
        seen = read_from_child_namespace()
        if seen["outside"]:
            break
    assert seen["fresh"] is False
    assert seen["unreadable"] == ""
    assert len(seen["outside"]) == 1
    assert seen["pids"] == sorted([*here, *seen["outside"]])


_TIMED_OUT_IN_CHILD_NAMESPACE = """
import json, sys
from belayer_envckpt import Engine, Sandbox
sandbox = Sandbox.attach(Engine.connect(), sys.argv[1])
result = sandbox.exec("sleep 301 & sleep 302; echo never", timeout_s=2)
print(json.dumps({"timed_out": result.timed_out, "stdout": result.stdout}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="PID and mount namespaces need root")
def test_an_exec_that_times_out_is_killed_from_a_pid_namespace_of_its_own(make_sandbox, tmp_path):
    # On an isolated node the caller cannot signal the exec's processes by their host pids; the
    # timeout must still kill the whole tree (through the engine, by their pids in the container).
    sandbox = make_sandbox(trajectory="pidns-kill")
    sandbox.status()
    init = int(sandbox._container.attrs["State"]["Pid"])
    assert container_pid(init) == 1  # NSpid: the innermost namespace's pid
    seen = _run_in_child_pid_namespace(tmp_path / "host-proc", _TIMED_OUT_IN_CHILD_NAMESPACE, sandbox.id)
    assert seen == {"timed_out": True, "stdout": ""}
    left = sandbox.exec("ps -o args | grep -c '^sleep 30[12]' || true").stdout.strip()
    assert left == "0"  # both sleeps, the exec's child and its background one, are gone


_FORK_LOOP_IN_CHILD_NAMESPACE = """
import json, sys
from belayer_envckpt import Engine, Sandbox, SandboxLimitError
sandbox = Sandbox.attach(Engine.connect(), sys.argv[1])
try:
    result = sandbox.exec(["python3", "-c", sys.argv[2]], timeout_s=4)
    print(json.dumps({"error": None, "timed_out": result.timed_out}))
except SandboxLimitError as error:
    print(json.dumps({"error": type(error).__name__}))
"""


_FORK_LOOP = """
import os, time
while True:
    try:
        if os.fork() == 0:
            time.sleep(100)
            os._exit(0)
    except OSError:
        pass
"""


def _host_processes_of(container_id: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if container_id in (entry / "cgroup").read_text():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="PID and mount namespaces need root")
def test_a_fork_loop_at_the_pids_limit_is_stopped_from_a_pid_namespace_of_its_own(make_sandbox, tmp_path):
    # At its pids limit, with a loop forking as fast as pids free up, the engine cannot start the
    # exec that would kill by pid inside the container ("read init-p: connection reset"): the kill
    # falls back to the whole container rather than leave the loop running.
    sandbox = make_sandbox(DEBIAN, trajectory="pidns-forks", limits=SandboxLimits(pids=8))
    sandbox.status()
    before = set(_host_processes_of(sandbox.id))  # the init and its keepalive
    seen = _run_in_child_pid_namespace(
        tmp_path / "host-proc", _FORK_LOOP_IN_CHILD_NAMESPACE, sandbox.id, _FORK_LOOP
    )
    assert seen["error"] in ("SandboxLimitError", None)
    # Whichever way the kill went (the exec in the container, or the whole container when the
    # engine could not start that exec: a race with the loop), none of the loop's processes runs.
    assert set(_host_processes_of(sandbox.id)) <= before
