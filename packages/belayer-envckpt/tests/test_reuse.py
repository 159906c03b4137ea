"""`Sandbox.reset_for_reuse`: what a pool runs before handing a done trajectory's sandbox on."""

from __future__ import annotations

from belayer_envckpt import CheckpointStore, Sandbox, full_checkpoint


def _processes(sandbox: Sandbox) -> str:
    return sandbox.probe(["ps", "-o", "args"]).stdout


def test_reset_kills_leftovers_empties_the_working_folder_and_keeps_it_checkpointable(make_sandbox, tmp_path):
    sandbox = make_sandbox(trajectory="reuse", working_dir="/work")
    sandbox.exec("mkdir -p sub && echo x > sub/f && echo y > .hidden && echo z > /tmp/outside")
    sandbox.exec("sleep 1000 > /dev/null 2>&1 &")
    assert "sleep 1000" in _processes(sandbox)
    assert sandbox.probe("ls -A").stdout.split() == [".hidden", "sub"]

    assert sandbox.reset_for_reuse() is True
    assert "sleep 1000" not in _processes(sandbox)
    assert sandbox.probe("ls -A").stdout == ""
    assert sandbox.probe("cat /tmp/outside").stdout == "z\n"  # outside the working folder: kept
    assert sandbox.is_running()
    # The folder itself survived (CRIU could not checkpoint a process whose cwd was deleted).
    sandbox.exec("echo again > f")
    checkpoint = full_checkpoint(sandbox, "reused", store=CheckpointStore(tmp_path))
    assert checkpoint.prefix == sandbox.prefix


def test_a_root_working_folder_is_not_reset(make_sandbox):
    sandbox = make_sandbox(trajectory="reuse-root")  # working_dir "/": emptying it wipes the container
    sandbox.exec("echo kept > /kept && sleep 1000 > /dev/null 2>&1 &")
    assert sandbox.reset_for_reuse() is False
    assert sandbox.probe("cat /kept").stdout == "kept\n"
    assert "sleep 1000" in _processes(sandbox)
