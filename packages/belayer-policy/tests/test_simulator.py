"""Simulator: hand-computed cases, the time identity, batches and seeded comparisons."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from belayer_policy import (
    CheckpointPolicy,
    FixedStepProbability,
    PolicySpec,
    ScheduledFailure,
    SharedEstimators,
    SimulationConfig,
    Trajectory,
    Workload,
    append_trace,
    compare_policies,
    load_trace,
    simulate_batch,
    simulate_trajectory,
)


def _traj(responses: list[float], actions: list[float], ckpts: list[float], failures=()) -> Trajectory:  # type: ignore[no-untyped-def]
    return Trajectory(responses, actions, ckpts, [ScheduledFailure(s, a) for s, a in failures])


def _run(name: str, trajectory: Trajectory, **config: Any) -> tuple[float, float, float, int, int]:
    outcome = simulate_trajectory(
        trajectory, PolicySpec.parse(name).build(), SimulationConfig(**config), random.Random(0)
    )
    return (
        outcome.rollout_s,
        outcome.lost_s,
        outcome.visible_checkpoint_s,
        outcome.num_checkpoints,
        outcome.num_failures,
    )


THREE_STEPS = _traj([10, 10, 10], [1, 1, 1], [0.5, 0.5, 0.5], failures=[(2, 0.5)])


def test_never_restarts_from_the_start() -> None:
    # 22 s done, fail 5.5 s into step 3, restore 2 s, redo all 33 s: 22 + 5.5 + 2 + 33
    assert _run("never", THREE_STEPS, restore_s=2.0) == (62.5, 29.5, 0.0, 0, 1)


def test_always_restarts_from_the_ready_checkpoint() -> None:
    # the checkpoint after step 2 (0.5 s) is ready 5.5 s into step 3: only 5.5 + 2 s are lost
    assert _run("always", THREE_STEPS, restore_s=2.0) == (40.5, 7.5, 0.0, 2, 1)


def test_every_k_restarts_from_its_older_checkpoint() -> None:
    # every:2 checkpoints only after step 2 -> same as always here; every:3 never checkpoints (last step)
    assert _run("every:2", THREE_STEPS, restore_s=2.0) == (40.5, 7.5, 0.0, 1, 1)
    assert _run("every:3", THREE_STEPS, restore_s=2.0) == (62.5, 29.5, 0.0, 0, 1)


def test_checkpoint_longer_than_the_response_is_visible() -> None:
    # 3 s checkpoint, 1 s response: the next action waits 2 s
    assert _run("always", _traj([1, 1], [1, 1], [3, 3])) == (6.0, 0.0, 2.0, 1, 0)


def test_failure_before_the_checkpoint_is_ready_loses_it() -> None:
    # step 2 wall = 1 + 2 (wait) + 1; failure at 0.25 * 4 = 1 s < 3 s: back to the start.
    # lost = step 1 (2) + 1 + restore 2 = 5; then step 1, step 2 (+2 wait), step 3 (+2 wait).
    trajectory = _traj([1, 1, 1], [1, 1, 1], [3, 3, 3], failures=[(1, 0.25)])
    assert _run("always", trajectory, restore_s=2.0) == (15.0, 5.0, 4.0, 3, 1)


def test_failure_during_the_visible_wait_counts_the_waited_part_as_visible() -> None:
    # failure at 0.5 * 4 = 2 s into step 2: 1 s response, then 1 s of waiting
    trajectory = _traj([1, 1], [1, 1], [3, 3], failures=[(1, 0.5)])
    assert _run("always", trajectory, restore_s=0.0) == (10.0, 3.0, 3.0, 2, 1)


def test_timed_out_checkpoint_is_cut_short_and_starts_the_cooldown() -> None:
    # 3 s checkpoint cut at the 1 s timeout (0.5 s visible); the cooldown blocks the next one
    trajectory = _traj([0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [3, 3, 3])
    assert _run("always", trajectory, checkpoint_timeout_s=1.0) == (3.5, 0.0, 0.5, 1, 0)


def test_two_failures_on_the_same_step() -> None:
    trajectory = _traj([4], [0], [0], failures=[(0, 0.5), (0, 0.25)])
    # 2 + 1 lost (plus restore 1 each), then the full 4 s
    assert _run("never", trajectory, restore_s=1.0) == (9.0, 5.0, 0.0, 0, 2)


def test_batch_reports_the_critical_path() -> None:
    short = _traj([1, 1], [0, 0], [0, 0])
    long = _traj([5, 5], [0, 0], [0, 0], failures=[(1, 0.5)])
    spec = PolicySpec.parse("never")
    shared = SharedEstimators()
    outcome = simulate_batch(
        [short, long],
        [spec.build(shared), spec.build(shared)],
        SimulationConfig(restore_s=1.0),
        [random.Random(1), random.Random(2)],
    )
    # step 1 (5 s) done, failure 2.5 s into step 2, restore 1 s, both steps again (10 s)
    assert outcome.rollout_s == pytest.approx(5 + 2.5 + 1 + 10)
    assert outcome.failure_free_s == 10.0
    assert outcome.lost_s == pytest.approx(5 + 2.5 + 1)
    assert outcome.num_failures == 1
    assert [t.rollout_s for t in outcome.trajectories] == [2.0, 18.5]


trajectories = st.integers(min_value=1, max_value=8).flatmap(
    lambda n: st.builds(
        Trajectory,
        st.lists(st.floats(0.0, 30.0), min_size=n, max_size=n),
        st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n),
        st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n),
        st.lists(st.builds(ScheduledFailure, st.integers(0, n - 1), st.floats(0.0, 0.99)), max_size=3),
    )
)


@settings(max_examples=150, deadline=None)
@given(
    trajectories,
    st.sampled_from(["adaptive", "always", "never", "every:2"]),
    st.floats(0.0, 0.3),
    st.floats(0.0, 5.0),
    st.one_of(st.none(), st.floats(0.5, 5.0)),
    st.integers(0, 2**32),
)
def test_rollout_s_is_failure_free_plus_lost_plus_visible(
    trajectory: Trajectory,
    name: str,
    fail_prob: float,
    restore: float,
    timeout: float | None,
    seed: int,
) -> None:
    config = SimulationConfig(fail_prob=fail_prob, restore_s=restore, checkpoint_timeout_s=timeout)
    outcome = simulate_trajectory(trajectory, PolicySpec.parse(name).build(), config, random.Random(seed))
    total = outcome.failure_free_s + outcome.lost_s + outcome.visible_checkpoint_s
    assert outcome.rollout_s == pytest.approx(total, abs=1e-6)
    assert outcome.num_failures >= len(trajectory.failures)
    assert outcome.lost_s >= outcome.num_failures * restore - 1e-9


def test_adaptive_with_zero_failure_probability_never_checkpoints() -> None:
    trajectory = Workload(num_steps=10).draw(random.Random(3))
    policy = CheckpointPolicy(failure_model=FixedStepProbability(0.0))
    outcome = simulate_trajectory(trajectory, policy, SimulationConfig(), random.Random(0))
    assert outcome.num_checkpoints == 0
    assert outcome.rollout_s == pytest.approx(trajectory.failure_free_s)


def test_seeded_comparison_is_reproducible_and_fair() -> None:
    specs = [PolicySpec.parse(n) for n in ("adaptive", "never")]
    config = SimulationConfig(fail_prob=0.05)
    kwargs = {
        "config": config,
        "runs": 3,
        "seed": 7,
        "workload": Workload(num_steps=6),
        "num_trajectories": 4,
    }
    first = compare_policies(specs, **kwargs)  # type: ignore[arg-type]
    second = compare_policies(specs, **kwargs)  # type: ignore[arg-type]
    assert [s.to_dict() for s in first] == [s.to_dict() for s in second]
    adaptive, never = first
    # same trajectories for both policies (common random numbers)
    assert adaptive.metrics["failure_free_s"] == never.metrics["failure_free_s"]
    assert never.metrics["checkpoints"].mean == 0.0
    other_seed = compare_policies(specs, **{**kwargs, "seed": 8})  # type: ignore[arg-type]
    assert other_seed[0].metrics["failure_free_s"] != adaptive.metrics["failure_free_s"]


def test_trace_batches_replay_the_same_trajectories_every_run() -> None:
    trace = [_traj([3, 3], [1, 1], [0.5, 0.5])]
    (summary,) = compare_policies(
        [PolicySpec.parse("always")], config=SimulationConfig(fail_prob=0.2), runs=5, seed=1, trace=trace
    )
    assert summary.metrics["failure_free_s"].p95 == summary.metrics["failure_free_s"].mean == 8.0
    assert summary.runs == 5


def test_the_policy_records_the_trace_the_simulator_replays(tmp_path: Path) -> None:
    original = Trajectory(
        [4.0, 5.0, 6.0, 7.0], [1.0, 1.0, 2.0, 1.0], [0.5, 0.7, 0.9, 1.1], [ScheduledFailure(2, 0.5)]
    )
    policy = PolicySpec.parse("every:2").build(SharedEstimators(failure_model=FixedStepProbability(0.0)))
    outcome = simulate_trajectory(original, policy, SimulationConfig(restore_s=1.5), random.Random(0))
    assert outcome.num_failures == 1
    recorded = policy.recorded_trajectory(task="calc", node="a")
    assert recorded is not None
    assert (recorded.response_s, recorded.action_s) == (original.response_s, original.action_s)
    # checkpoints of prefixes 2 (ready) measured; the others get their mean
    assert recorded.checkpoint_s[1] == 0.7
    assert recorded.failures == (ScheduledFailure(2, 0.5),)
    assert (recorded.restore_s, recorded.task, recorded.node) == ((1.5,), "calc", "a")
    path = tmp_path / "trace.jsonl"
    append_trace(path, [recorded])
    append_trace(path, [recorded])
    assert load_trace(path) == [recorded, recorded]
    again = PolicySpec.parse("every:2").build(SharedEstimators(failure_model=FixedStepProbability(0.0)))
    replay = simulate_trajectory(recorded, again, SimulationConfig(restore_s=1.5), random.Random(0))
    assert replay == outcome
