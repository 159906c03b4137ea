"""Diagnosis: one workload of ``bench_family.py``, batch by batch, with adaptive's checkpoint decisions.

Runs adaptive and the given fixed policy on the workload's batches exactly as ``bench_family.py``
judges them (same draws, streams and carried estimators; ``--runs`` batches: it does not apply
``bench_family.py``'s ``--min-failures``) and records each batch's rollout under
both and every checkpoint adaptive decided: batch, trajectory, step, the saving it weighed
(``benefit_s``), the visible cost it estimated, its cost estimate and the true cost of that
checkpoint.  With ``--exact-costs`` the policy learns unbiased costs.

    python benchmarks/family_decisions.py --index 174 --against never [--runs 24] [--exact-costs]
        [--batches fresh|same] [--out benchmarks/results/family_decisions-174.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from bench_family import PER_STEP, BiasedCostModel, batch_source, draw_workload

from belayer_policy import (
    CheckpointPolicy,
    Decision,
    FixedStepProbability,
    PolicySpec,
    SharedEstimators,
    SimulationConfig,
    StepObservation,
    compare_policies,
)


class _Logged:
    """Wraps a policy's ``decide`` to keep the decisions that took a checkpoint, with the batch and
    the trajectory they belong to."""

    def __init__(
        self, policy: CheckpointPolicy, log: list[tuple[int, int, Decision]], where: tuple[int, int]
    ) -> None:
        self._policy, self._log, self._where = policy, log, where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def decide(self, obs: StepObservation) -> Decision:
        decision = self._policy.decide(obs)
        if decision.checkpoint:
            self._log.append((*self._where, decision))
        return decision


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--against", required=True, help="the fixed policy to compare with")
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--exact-costs", action="store_true")
    parser.add_argument("--batches", choices=("fresh", "same"), default="fresh", help="as in bench_family.py")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    workload = draw_workload(args.index, args.seed, args.trajectories)
    params = workload["params"]
    bias = 1.0 if args.exact_costs else params["cost_bias"]

    def estimators() -> SharedEstimators:
        return SharedEstimators(
            failure_model=FixedStepProbability(params["fail_prob"]),
            checkpoint_costs=BiasedCostModel(bias=bias),
        )

    log: list[tuple[int, int, Decision]] = []
    adaptive = PolicySpec.parse("adaptive")
    built = 0

    class LoggedSpec:
        # compare_policies builds one policy per trajectory, batch after batch
        name = adaptive.name

        def build(self, shared: SharedEstimators, **labels: str | None) -> Any:
            nonlocal built
            where = divmod(built, args.trajectories)
            built += 1
            return _Logged(adaptive.build(shared, **labels), log, where)

    summaries = compare_policies(
        [LoggedSpec(), PolicySpec.parse(args.against)],  # type: ignore[list-item]
        config=SimulationConfig(fail_prob=params["fail_prob"], restore_s=2.0, failure_streams=PER_STEP),
        runs=args.runs,
        seed=args.seed + args.index,
        **batch_source(workload, args.batches, args.trajectories),
        estimators=estimators,
        carry_estimators=True,
    )
    rollouts = {s.policy: s.rollouts_s for s in summaries}

    def true_cost(batch: int, trajectory: int, step: int) -> float:
        if args.batches == "same":
            return workload["batch"][trajectory].checkpoint_s[step - 1]
        # the trajectory compare_policies drew for that batch (its seeded stream, `_report._rng`)
        rng = random.Random(f"work:{args.seed + args.index}:{batch}:{trajectory}")
        return workload["generator"].draw(rng).checkpoint_s[step - 1]

    decisions = [
        {
            "batch": batch,
            "trajectory": trajectory,
            "step": d.step_index,
            "now_s": d.now,
            "benefit_s": d.benefit_s,
            "visible_cost_s": d.visible_cost_s,
            "checkpoint_cost_s": d.checkpoint_cost_s,
            "true_cost_s": true_cost(batch, trajectory, d.step_index),
            "regeneration_s": d.regeneration_s,
            "hazard": d.hazard,
            "contenders": d.contenders,
        }
        for batch, trajectory, d in log
    ]
    result = {
        "args": vars(args),
        "params": params,
        "true_checkpoint_mean_s": params["cost_ratio"] * params["response_mean_s"],
        "rollouts_s": rollouts,
        "mean_s": {name: statistics.fmean(values) for name, values in rollouts.items()},
        "checkpoints_per_batch": {s.policy: s.metrics["checkpoints"].mean for s in summaries},
        "decisions": decisions,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(
        json.dumps(
            {k: result[k] for k in ("params", "true_checkpoint_mean_s", "mean_s", "checkpoints_per_batch")},
            indent=1,
        )
    )
    for name, values in rollouts.items():
        print(name, " ".join(f"{v:.1f}" for v in values))
    for d in decisions[:40]:
        print(d)


if __name__ == "__main__":
    main()
