"""Invalid arguments raise ValueError (PolicyArgumentError) with a message naming the argument."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from belayer_policy import (
    BelayerPolicyError,
    CheckpointCostModel,
    CheckpointPolicy,
    ConstantHazard,
    FixedStepProbability,
    OnlineHazard,
    PolicyArgumentError,
    PolicySpec,
    ResponseTimeModel,
    ScheduledFailure,
    SimulationConfig,
    StepObservation,
    TraceFormatError,
    Trajectory,
    UniformRange,
    Workload,
    compare_policies,
    load_trace,
    percentile,
    save_trace,
)


@pytest.mark.parametrize(
    ("build", "argument"),
    [
        (lambda: ConstantHazard(-0.1), "rate"),
        (lambda: ConstantHazard(float("nan")), "rate"),
        (lambda: ConstantHazard(0.1).failure_probability(-1.0), "duration"),
        (lambda: FixedStepProbability(1.5), "probability"),
        (lambda: FixedStepProbability(-0.01), "probability"),
        (lambda: OnlineHazard(prior_failures=-1.0), "prior_failures"),
        (lambda: OnlineHazard(prior_exposure_s=0.0), "prior_exposure_s"),
        (lambda: OnlineHazard().observe_exposure(-5.0), "exposure_s"),
        (lambda: ResponseTimeModel(window=0), "window"),
        (lambda: ResponseTimeModel().observe(-1.0), "response_s"),
        (lambda: ResponseTimeModel().hidden_probability(-1.0, 1.0), "elapsed"),
        (lambda: ResponseTimeModel().hidden_probability(0.0, -1.0), "cost"),
        (lambda: CheckpointCostModel(initial_s=-1.0), "initial_s"),
        (lambda: CheckpointCostModel(smoothing=1.5), "smoothing"),
        (lambda: CheckpointCostModel().observe(float("inf")), "cost_s"),
        (lambda: StepObservation(0, 1.0, 1.0, 1.0), "step_index"),
        (lambda: StepObservation(1, -1.0, 1.0, 1.0), "response_s"),
        (lambda: StepObservation(1, 1.0, "1", 1.0), "action_s"),  # type: ignore[arg-type]  # on purpose
        (lambda: StepObservation(1, 1.0, 1.0, 1.0, next_step_s=-2.0), "next_step_s"),
        (lambda: CheckpointPolicy(extra_cost_s=-1.0), "extra_cost_s"),
        (lambda: CheckpointPolicy(cooldown_s=-1.0), "cooldown_s"),
        (lambda: CheckpointPolicy().on_checkpoint_timeout(now=-1.0), "now"),
        (lambda: PolicySpec.parse("every:0"), "every:K"),
        (lambda: PolicySpec.parse("every:x"), "every:K"),
        (lambda: PolicySpec.parse("sometimes"), "policy"),
        (lambda: SimulationConfig(fail_prob=1.2), "fail_prob"),
        (lambda: SimulationConfig(restore_s=-1.0), "restore_s"),
        (lambda: SimulationConfig(checkpoint_timeout_s=0.0), "checkpoint_timeout_s"),
        (lambda: Trajectory([], [], []), "response_s"),
        (lambda: Trajectory([1.0], [1.0, 2.0], [1.0]), "action_s"),
        (lambda: Trajectory([1.0], [-1.0], [1.0]), "action_s[0]"),
        (lambda: Trajectory([1.0], [1.0], [1.0], [ScheduledFailure(3)]), "failures"),
        (lambda: ScheduledFailure(-1), "step"),
        (lambda: ScheduledFailure(0, at=1.0), "at"),
        (lambda: UniformRange(5.0, 1.0), "high"),
        (lambda: Workload(num_steps=0), "num_steps"),
        (lambda: percentile([], 50), "values"),
        (lambda: compare_policies([], config=SimulationConfig(), runs=1), "specs"),
        (lambda: compare_policies([PolicySpec.parse("never")], config=SimulationConfig(), runs=0), "runs"),
        (
            lambda: compare_policies(
                [PolicySpec.parse("never")],
                config=SimulationConfig(),
                runs=1,
                num_trajectories=2.5,  # type: ignore[arg-type]
            ),
            "num_trajectories",
        ),
    ],
)
def test_invalid_argument_names_itself(build: Callable[[], object], argument: str) -> None:
    with pytest.raises(ValueError, match=f"^{_escape(argument)}|{_escape(argument)}") as info:
        build()
    assert isinstance(info.value, PolicyArgumentError)
    assert isinstance(info.value, BelayerPolicyError)


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_trace_round_trip(tmp_path: Path) -> None:
    trajectories = [
        Trajectory([1.0, 2.0], [0.5, 0.5], [0.3, 0.4], [ScheduledFailure(1, 0.5)]),
        Trajectory([3.0], [1.0], [0.2]),
    ]
    save_trace(tmp_path / "t.jsonl", trajectories)
    assert load_trace(tmp_path / "t.jsonl") == trajectories


def test_trace_checkpoint_costs_are_optional(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"response_s": [1, 2], "action_s": [0, 1]}\n\n')
    (trajectory,) = load_trace(path)
    assert trajectory.checkpoint_s == (0.5, 0.5)


def test_trace_fills_unmeasured_checkpoints_and_keeps_labels(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"response_s": [1, 2, 3], "action_s": [0, 1, 1], "checkpoint_s": [0.4, null, 0.8], '
        '"restore_s": [1.5], "task": "calc", "node": "a", "trajectory_id": "t1", "meta": {"p": 1}}\n'
        '{"response_seconds": [1], "action_seconds": [2], "checkpoint_seconds": [null]}\n'
    )
    first, old = load_trace(path)
    assert first.checkpoint_s == pytest.approx((0.4, 0.6, 0.8))
    assert (first.restore_s, first.task, first.node) == ((1.5,), "calc", "a")
    assert (old.response_s, old.action_s, old.checkpoint_s) == ((1.0,), (2.0,), (0.5,))
    save_trace(tmp_path / "again.jsonl", [first])
    assert load_trace(tmp_path / "again.jsonl") == [first]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty"),
        ("\n  \n", "empty"),
        ("{not json}\n", "line 1: not JSON"),
        ("[1, 2]\n", "line 1: each line must be a JSON object"),
        ('{"response_s": [1]}\n', "line 1: action_s"),
        (
            '{"response_s": [1], "action_s": [1]}\n{"response_s": [1], "action_s": [-1]}\n',
            "line 2: action_s[0]",
        ),
        ('{"response_s": [1], "action_s": [1], "colour": 1}\n', "unknown keys"),
        ('{"response_s": [1], "action_s": [1], "failures": [{"at": 0.5}]}\n', "failure"),
        ('{"response_s": ["a"], "action_s": [1]}\n', "response_s[0]"),
        ('{"response_s": [1], "action_s": [1], "checkpoint_s": 3}\n', "checkpoint_s must be a list"),
        ('{"response_s": [1], "action_s": [1], "task": 7}\n', "task must be a string"),
        ('{"response_s": [1], "action_s": [1], "restore_s": [-2]}\n', "restore_s[0]"),
        ('{"response_s": [1], "action_s": [1], "meta": []}\n', "meta must be an object"),
    ],
)
def test_malformed_trace_is_refused_with_the_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceFormatError, match="trace") as info:
        load_trace(path)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_binary_trace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        load_trace(path)


def test_missing_trace_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot be read"):
        load_trace(tmp_path / "absent.jsonl")


def test_the_shipped_recorded_trace_loads() -> None:
    path = Path(__file__).parent.parent / "benchmarks" / "traces" / "grpo-swe.jsonl"
    trajectories = load_trace(path)
    assert len(trajectories) == 12
    assert all(t.task is not None and t.node is not None for t in trajectories)
    assert sum(len(t.failures) for t in trajectories) == 9
