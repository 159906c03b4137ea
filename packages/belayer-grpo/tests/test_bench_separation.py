"""The env-failures experiment: the repeat rule at p = 0.01 (confidence intervals, the stop reason)
and the check of belayer-policy's simulator against the measured batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from belayer_grpo._bench import load_bench_config
from belayer_grpo._bench.env_failures import separation
from belayer_grpo._bench.report import render_markdown
from belayer_grpo._bench.simcheck import compare_with_simulator, simulated_rollout_s
from belayer_grpo._bench.stats import intervals_separate, mean_ci95


def test_mean_ci95_uses_students_t() -> None:
    assert mean_ci95([1.0]) is None
    mean, half = mean_ci95([1.0, 2.0, 3.0]) or (0.0, 0.0)
    assert mean == 2.0
    assert half == pytest.approx(4.303 * 1.0 / 3**0.5)
    assert intervals_separate([0.0, 0.1, 0.2], [1.0, 1.1, 1.2])
    assert not intervals_separate([0.0, 1.0, 2.0], [0.5, 1.5, 2.5])
    assert not intervals_separate([0.0], [5.0])  # one value has no interval


def _runs(policy: str, increases: list[float], failures: int = 1) -> list[dict[str, Any]]:
    return [
        {"policy": policy, "kill_p": 0.01, "seed": seed, "baseline": False, "increase": inc,
         "num_failures": failures, "num_checkpoints": 3}
        for seed, inc in enumerate(increases)
    ]  # fmt: skip


def test_separation_says_what_stopped_the_repeats() -> None:
    bench = load_bench_config()
    bench = attrs.evolve(bench, env_failures=attrs.evolve(bench.env_failures, max_repeats=3))
    apart = _runs("never", [0.30, 0.32, 0.31]) + _runs("adaptive", [0.02, 0.03, 0.01])
    result = separation(apart, 0.01, bench)
    assert result["separated"]
    assert result["stopped_by"] == "separated"
    assert result["arms"]["never"]["num_failures"] == 3
    low, high = result["arms"]["never"]["increase_ci95"]
    assert low < 0.31 < high
    overlapping = _runs("never", [0.0, 0.3, 0.0]) + _runs("adaptive", [0.1, 0.0, 0.2])
    assert separation(overlapping, 0.01, bench)["stopped_by"] == "max_repeats"
    short = _runs("never", [0.0, 0.3]) + _runs("adaptive", [0.1, 0.0])
    assert separation(short, 0.01, bench)["stopped_by"] == "max_repeat_s"


def test_report_states_whether_the_intervals_separate() -> None:
    bench = load_bench_config()
    runs = _runs("never", [0.0, 0.3, 0.0]) + _runs("adaptive", [0.1, 0.0, 0.2])
    env = {"rows": [], "separation": separation(runs, 0.01, bench), "runs": runs}
    results = {
        "experiments": {"env-failures": env},
        "descriptions": {},
        "meta": {"command": "x", "scale": "small", "machine": "m", "started": "t", "wall_s": 1.0},
    }
    text = render_markdown(results, {})
    assert "**do not separate** after 3 seeds" in text
    assert "| never | 3 |" in text


def _line(steps: int, failures: tuple[int, ...] = (), restore_s: float = 1.0) -> dict[str, Any]:
    return {
        "response_s": [2.0] * steps,
        "action_s": [0.5] * steps,
        "checkpoint_s": [None] * steps,
        "failures": [{"step": s, "at": 0.99} for s in failures],
        "restore_s": [restore_s] * len(failures),
        "task": "t",
    }


def test_simulator_replay_of_recorded_batches() -> None:
    # never, one failure at step 2 (0-based) of the longest trajectory: it redoes steps 0-1 (5 s),
    # 0.99 of step 2 (2.475 s) and restores (1 s): 8.475 s more than the failure-free batch.
    base = [_line(4), _line(2)]
    failed = [_line(4, (2,)), _line(2)]
    assert simulated_rollout_s(failed, "never", 0.01) - simulated_rollout_s(base, "never", 0.01) == (
        pytest.approx(8.475)
    )
    runs: list[dict[str, Any]] = []
    for seed, noise in enumerate([0.3, -0.2, 0.1, -0.25]):
        runs.append({"seed": seed, "baseline": True, "trace": base, "rollout_s": 30.0, "num_failures": 0,
                     "policy": "never", "kill_p": 0.0})  # fmt: skip
        runs.append({"seed": seed, "baseline": False, "trace": failed, "rollout_s": 38.475 + noise,
                     "num_failures": 1, "policy": "never", "kill_p": 0.01})  # fmt: skip
    check = compare_with_simulator(runs, every_k=3)
    assert check["batches"] == 4
    assert check["agrees"]
    for run in runs:
        if not run["baseline"]:
            run["rollout_s"] += 5.0  # the direct run lost 5 s the simulator does not see
    assert not compare_with_simulator(runs, every_k=3)["agrees"]


def test_simulator_agrees_with_the_recorded_end_to_end_run() -> None:
    # The committed env-failures run at p = 0.01 (benchmarks/env-failures-p001): real router, agent
    # loop, Docker + CRIU sandboxes.  Replaying each failed batch's recorded trace (and its seed's
    # baseline) through belayer-policy's simulator must land within the interval of the measured
    # increase; a change to the simulator or to what the trace records that breaks this fails here.
    results = Path(__file__).parents[1] / "benchmarks" / "env-failures-p001" / "results.json"
    runs = json.loads(results.read_text())["experiments"]["env-failures"]["runs"]
    check = compare_with_simulator(runs, every_k=3)
    assert check["batches"] >= 4
    assert check["agrees"], check["difference_ci95_s"]
