"""Per-checkpoint kinds in the trace: read (old traces unchanged), written, recorded and replayed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from belayer_policy import (
    FixedStepProbability,
    PolicyArgumentError,
    PolicySpec,
    SharedEstimators,
    SimulationConfig,
    TraceFormatError,
    Trajectory,
    load_trace,
    save_trace,
    simulate_trajectory,
)


def test_an_old_trace_reads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    path.write_text('{"response_s": [1, 2, 3], "action_s": [0, 1, 1], "checkpoint_s": [0.4, null, 0.8]}\n')
    (trajectory,) = load_trace(path)
    assert trajectory.checkpoint_kind == ()
    assert trajectory.checkpoint_s == pytest.approx((0.4, 0.6, 0.8))
    save_trace(tmp_path / "again.jsonl", [trajectory])
    assert "checkpoint_kind" not in (tmp_path / "again.jsonl").read_text()


def test_unmeasured_checkpoints_cost_what_their_kind_costs(tmp_path: Path) -> None:
    path = tmp_path / "kinds.jsonl"
    path.write_text(
        '{"response_s": [1, 1, 1, 1, 1], "action_s": [1, 1, 1, 1, 1], '
        '"checkpoint_s": [4.0, null, null, 0.02, null], '
        '"checkpoint_kind": ["full", null, "reference", "fresh-runtime", "fresh-runtime"]}\n'
    )
    (trajectory,) = load_trace(path)
    assert trajectory.checkpoint_kind == ("full", None, "reference", "fresh-runtime", "fresh-runtime")
    # unknown is full (the full mean), a reference never measured its prior, fresh-runtime its mean
    assert trajectory.checkpoint_s == pytest.approx((4.0, 4.0, 0.005, 0.02, 0.02))
    save_trace(tmp_path / "again.jsonl", [trajectory])
    assert load_trace(tmp_path / "again.jsonl") == [trajectory]


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        ('["full"]', "checkpoint_kind must be a list of 2"),
        ('["full", "snapshot"]', "checkpoint_kind must be one of"),
    ],
)
def test_bad_kinds_are_refused_with_the_line(tmp_path: Path, kinds: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"response_s": [1, 1], "action_s": [1, 1], "checkpoint_kind": {kinds}}}\n')
    with pytest.raises(TraceFormatError, match="line 1") as info:
        load_trace(path)
    assert message in str(info.value)
    with pytest.raises(PolicyArgumentError, match="checkpoint_kind must have 2"):
        Trajectory([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], checkpoint_kind=["full"])


def test_the_replay_tells_each_kind_and_charges_its_cost(tmp_path: Path) -> None:
    # Full checkpoints (30 s) cost more than 1 s steps at p = 0.02 lose; references are nearly free.
    kinds = ["full", "reference", "full", "reference", "full", "full"]
    trace = Trajectory([1.0] * 6, [1.0] * 6, [30.0, 0.005, 30.0, 0.005, 30.0, 30.0], checkpoint_kind=kinds)
    shared = SharedEstimators(failure_model=FixedStepProbability(0.02))
    shared.checkpoint_costs.observe(30.0)
    policy = PolicySpec.parse("adaptive").build(shared)
    outcome = simulate_trajectory(trace, policy, SimulationConfig(), random.Random(0))
    assert outcome.num_checkpoints == 2
    assert outcome.visible_checkpoint_s == 0.0
    recorded = policy.recorded_trajectory()
    assert recorded is not None
    assert recorded.checkpoint_kind == tuple(kinds)  # the kinds told, the taken ones measured
    assert recorded.checkpoint_s[1] == recorded.checkpoint_s[3] == 0.005
    # Without kinds every checkpoint weighs (and costs) as full: none pays.
    plain = Trajectory(trace.response_s, trace.action_s, trace.checkpoint_s)
    policy = PolicySpec.parse("adaptive").build(shared)
    assert simulate_trajectory(plain, policy, SimulationConfig(), random.Random(0)).num_checkpoints == 0
