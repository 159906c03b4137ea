"""`belayer-grpo train`'s own ``trace.jsonl`` (issue 16): the lines the train path writes load with
belayer-policy's trace loader and carry what the simulator check compares against (the measured
wall time, each checkpoint's critical-path wait, each recovery's restore time and rounds
regenerated), the same fields as the bench's traces, so a recorded train trace replays the same way.
No Docker: the trajectory is built from the records the agent loop fills in."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import attrs

from belayer_grpo._agentic import AgenticTrajectory, CheckpointRecord, RecoveryRecord
from belayer_grpo._bench.simcheck import simulated_rollout_s
from belayer_grpo._bench.swe import _trace_line
from belayer_policy import load_trace


def _checkpoint(prefix: int, duration_s: float, waited_s: float) -> CheckpointRecord:
    return CheckpointRecord(prefix, prefix, f"ctx-{prefix}", "c" * 64, "r" * 64, duration_s, waited_s)


def _recovery(failed: int, restored: int, restore_s: float, rounds: int) -> RecoveryRecord:
    return RecoveryRecord(
        failed_prefix=failed,
        failed_turn=failed,
        reason="killed by chaos",
        restored_prefix=restored,
        restored_turn=restored,
        from_checkpoint=restored > 0,
        restore_s=restore_s,
        tokens_regenerated=7,
        rounds_regenerated=rounds,
        expected_repo_hash="a" * 64,
        actual_repo_hash="a" * 64,
        context_matches=True,
        prefix_matches=True,
    )


def _trajectory(index: int) -> AgenticTrajectory:
    """Four committed steps, checkpoints after steps 1 and 2, a failure at step 3 restored to 2."""
    return AgenticTrajectory(
        f"run-g0-s{index}", "calc-1", 0, index, [1, 2], [0, 1], [0.0, -1.0], 1, 0.0, "max_rounds", 4, 4, 5,
        1, "", "adaptive", 31.5 + index,
        [_checkpoint(0, 0.0, 0.0), _checkpoint(1, 6.0, 2.5), _checkpoint(2, 5.0, 1.25)],
        [_recovery(3, 2, 1.75 + index, 1)],
        step_response_s=[3.0, 4.0, 2.5, 3.5],
        step_action_s=[0.5, 0.25, 0.5, 0.75],
        step_checkpoint_s=[6.0, 5.0, None, None],
        failed_steps=[2],
    )  # fmt: skip


def _write_as_train_does(path: Path, trajectories: list[AgenticTrajectory], step: int) -> None:
    # The call `belayer_grpo._run` makes for every trajectory with a committed step.
    with path.open("a") as trace:
        for trajectory in trajectories:
            trace.write(json.dumps(trajectory.trace_line(node=platform.node(), meta={"step": step})) + "\n")


def test_the_train_trace_loads_and_carries_what_the_simulator_check_needs(tmp_path: Path) -> None:
    batch = [_trajectory(0), _trajectory(1)]
    path = tmp_path / "trace.jsonl"
    _write_as_train_does(path, batch, step=3)

    loaded = load_trace(path)
    assert [t.response_s for t in loaded] == [(3.0, 4.0, 2.5, 3.5)] * 2
    assert loaded[0].checkpoint_s == (6.0, 5.0, 5.5, 5.5)  # the mean measured cost fills the rest
    assert [(f.step, f.at) for f in loaded[0].failures] == [(2, 0.99)]
    assert [t.restore_s for t in loaded] == [(1.75,), (2.75,)]
    assert {t.node for t in loaded} == {platform.node()}

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for trajectory, line in zip(batch, lines, strict=True):
        meta = line["meta"]
        assert meta["step"] == 3
        assert meta["policy"] == "adaptive"
        assert meta["wall_s"] == trajectory.wall_s
        assert meta["checkpoint_waited_s"] == {"1": 2.5, "2": 1.25}  # the base record is no checkpoint
        assert meta["recoveries"] == [
            {"failed_step": 3, "restored_step": 2, "restore_s": trajectory.recoveries[0].restore_s,
             "rounds_regenerated": 1}
        ]  # fmt: skip


def test_a_train_trace_replays_like_a_bench_trace() -> None:
    batch = [_trajectory(0), _trajectory(1)]
    train = [t.trace_line(meta={"step": 1}) for t in batch]
    bench = [_trace_line(t) for t in batch]
    # Same fields: the train trace is the bench's plus the training step.
    assert [
        {**line, "meta": {k: v for k, v in line["meta"].items() if k != "step"}} for line in train
    ] == bench
    # And the simulator check replays it the same way (a failure at its step, its mean restore).
    with_failure = simulated_rollout_s(train, "never", 0.05)
    assert with_failure == simulated_rollout_s(bench, "never", 0.05)
    clean = [{**line, "failures": []} for line in train]
    assert with_failure > simulated_rollout_s(clean, "never", 0.05)


def test_each_step_says_its_checkpoint_kind_and_the_simulator_charges_it(tmp_path: Path) -> None:
    """Issue 34: the kind of each step's checkpoint (the one taken, else the one it would have
    taken) reaches the trace, and belayer-policy fills an unmeasured step with its kind's cost."""
    trajectory = attrs.evolve(
        _trajectory(0),
        step_checkpoint_s=[6.0, 0.04, None, None],
        step_checkpoint_kind=["full", "fresh-runtime", "fresh-runtime", None],
    )
    path = tmp_path / "trace.jsonl"
    _write_as_train_does(path, [trajectory], step=1)
    line = json.loads(path.read_text())
    assert line["checkpoint_kind"] == ["full", "fresh-runtime", "fresh-runtime", None]
    (loaded,) = load_trace(path)
    assert loaded.checkpoint_kind == ("full", "fresh-runtime", "fresh-runtime", None)
    # Step 3 costs what the trajectory's fresh-runtime checkpoint cost, step 4 (unknown: a full one)
    # what its full one did; without the kinds both would be the mean of the two.
    assert loaded.checkpoint_s == (6.0, 0.04, 0.04, 6.0)
    # A trajectory whose policy did not weigh kinds writes no checkpoint_kind (old format).
    assert "checkpoint_kind" not in _trajectory(0).trace_line()
