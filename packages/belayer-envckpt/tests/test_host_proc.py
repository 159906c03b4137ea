"""What a sandbox host on a node of its own needs from envckpt (belayer-cluster's isolated nodes):
a restored container labelled with its new owner, and the containers' processes read through the
host's /proc where the caller's own /proc is another PID namespace's (`BELAYER_ENVCKPT_HOST_PROC`)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from belayer_envckpt import CheckpointStore, full_checkpoint, full_restore
from belayer_envckpt._procfs import HOST_PROC_ENV, host_proc, kill_host_process
from belayer_envckpt._runtime import sandbox_runtime


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
        # A signal cannot reach a host process by pid from another PID namespace: none is sent.
        with pytest.raises(ProcessLookupError, match="PID namespace of its own"):
            kill_host_process(os.getpid(), signal.SIGKILL)
        empty = tmp_path / "empty"
        empty.mkdir()
        monkeypatch.setenv(HOST_PROC_ENV, str(empty))  # the setting is what is read: nothing there
        assert not sandbox_runtime(sandbox).fresh
    finally:
        subprocess.run(["umount", str(bound)], check=True)
    monkeypatch.delenv(HOST_PROC_ENV)
    assert host_proc() == "/proc"
    assert Path(host_proc(), str(os.getpid())).is_dir()
