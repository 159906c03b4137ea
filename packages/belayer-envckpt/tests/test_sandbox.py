"""Actions: results, timeouts, the prefix counter, and exclusion with checkpoints."""

from __future__ import annotations

import threading

import pytest
from conftest import read_from_layer, wait_for_layer_file

from belayer_envckpt import CheckpointStore, FaultAction, FaultInjector, InvalidConfigError, full_checkpoint


def test_exec_reports_output_and_counts_boundaries(make_sandbox):
    sandbox = make_sandbox(trajectory="exec")
    result = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("out\n", "err\n", 3, False)
    assert result.duration_s > 0
    sandbox.exec(["ls", "/"])
    assert sandbox.prefix == 2


def test_exec_timeout_kills_the_action_tree(make_sandbox):
    sandbox = make_sandbox(trajectory="timeout")
    result = sandbox.exec("sleep 30 & sleep 30; echo never", timeout_s=0.5)
    assert result.timed_out
    assert "never" not in result.stdout
    assert "sleep 30" not in sandbox.exec(["ps", "-o", "args"]).stdout
    assert sandbox.status() == "running"


def test_checkpoint_waits_for_the_action_boundary(make_sandbox, tmp_path):
    sandbox = make_sandbox(trajectory="boundary")
    started = threading.Event()

    def action() -> None:
        started.set()
        sandbox.exec("mkdir -p /work && touch /work/started; sleep 1; echo done > /work/done")

    worker = threading.Thread(target=action)
    worker.start()
    started.wait()
    wait_for_layer_file(sandbox, "work/started")  # the action is under way, not about to start
    ckpt = full_checkpoint(sandbox, "boundary", store=CheckpointStore(tmp_path))
    worker.join()
    # The checkpoint saw the action's effect and its committed boundary, never the middle of it.
    assert read_from_layer(ckpt.path / "layer.tar", "work/done") == b"done\n"
    assert ckpt.prefix == 1


def test_fault_injector_rate_and_actions(make_sandbox):
    with pytest.raises(InvalidConfigError, match="probability"):
        FaultInjector(1.5)
    never = FaultInjector(0.0, seed=1)
    sandbox = make_sandbox(trajectory="faults")
    assert not any(never.step(sandbox) for _ in range(100))
    always = FaultInjector(1.0, action=FaultAction.PAUSE)
    assert always.step(sandbox)
    assert sandbox.status() == "paused"
    killer = FaultInjector(1.0, action=FaultAction.KILL)
    victim = make_sandbox(trajectory="faults-kill")
    assert killer.step(victim)
    assert victim.status() == "exited"
    assert (always.num_injected, killer.num_injected, never.num_injected) == (1, 1, 0)
