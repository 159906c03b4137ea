"""Does belayer-policy's simulator agree with the end-to-end run?  Per batch of the env-failures
experiment: the rollout-time increase over the failure-free batch of the same seed, measured,
against the increase the simulator predicts from the two batches' recorded traces (their measured
response, action and checkpoint times, their observed failures at the steps they hit, their mean
measured restore time; the same policy).  What neither models (sandbox start, the final test run)
is in both batches of a seed and cancels in the increase.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from belayer_grpo._bench.stats import mean_ci95
from belayer_policy import (
    BelayerPolicyError,
    FixedStepProbability,
    PolicySpec,
    SharedEstimators,
    SimulationConfig,
    Trajectory,
    load_trace,
    simulate_batch,
)

__all__ = ["compare_with_simulator", "simulated_rollout_s"]


def _trajectories(lines: Sequence[dict[str, Any]]) -> list[Trajectory]:
    with tempfile.TemporaryDirectory(prefix="belayer-simcheck-") as folder:
        path = Path(folder) / "trace.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return load_trace(path)


def simulated_rollout_s(lines: Sequence[dict[str, Any]], policy: str, kill_p: float) -> float:
    """The simulator's batch rollout time for a recorded batch: its failures where they happened
    (no random ones), its mean measured restore time, ``policy`` knowing ``kill_p`` as the agent
    loop does."""
    trajectories = _trajectories(lines)
    restores = [r for t in trajectories for r in t.restore_s]
    config = SimulationConfig(fail_prob=0.0, restore_s=statistics.fmean(restores) if restores else 0.0)
    shared = SharedEstimators(failure_model=FixedStepProbability(kill_p), batch_size=len(trajectories))
    spec = PolicySpec.parse(policy)
    policies = [spec.build(shared, task=t.task, node=t.node) for t in trajectories]
    rngs = [random.Random(j) for j in range(len(trajectories))]
    return simulate_batch(trajectories, policies, config, rngs).rollout_s


def compare_with_simulator(runs: Sequence[dict[str, Any]], every_k: int) -> dict[str, Any]:
    """Measured against simulated increase for every batch with failures that has a recorded trace
    and a baseline of its seed; the mean difference and its 95 % interval (``agrees``: it holds 0).
    A trace the simulator refuses is reported in ``error`` (the run's results are kept)."""
    try:
        return _compare(runs, every_k)
    except BelayerPolicyError as error:
        return {"batches": 0, "pairs": [], "difference_s": None, "difference_ci95_s": None,
                "agrees": None, "error": str(error)}  # fmt: skip


def _compare(runs: Sequence[dict[str, Any]], every_k: int) -> dict[str, Any]:
    baselines = {r["seed"]: r for r in runs if r["baseline"] and r.get("trace")}
    pairs = []
    for run in runs:
        base = baselines.get(run["seed"])
        if run["baseline"] or base is None or not run.get("trace") or not run["num_failures"]:
            continue
        name = f"every:{every_k}" if run["policy"] == "every" else run["policy"]
        simulated = simulated_rollout_s(run["trace"], name, run["kill_p"]) - simulated_rollout_s(
            base["trace"], "never", run["kill_p"]
        )
        measured = run["rollout_s"] - base["rollout_s"]
        pairs.append({"policy": run["policy"], "kill_p": run["kill_p"], "seed": run["seed"],
                      "num_failures": run["num_failures"], "measured_increase_s": measured,
                      "simulated_increase_s": simulated})  # fmt: skip
    differences = [p["measured_increase_s"] - p["simulated_increase_s"] for p in pairs]
    ci = mean_ci95(differences)
    return {
        "batches": len(pairs),
        "pairs": pairs,
        "difference_s": None if ci is None else ci[0],
        "difference_ci95_s": None if ci is None else [ci[0] - ci[1], ci[0] + ci[1]],
        "agrees": None if ci is None else ci[0] - ci[1] <= 0.0 <= ci[0] + ci[1],
    }
