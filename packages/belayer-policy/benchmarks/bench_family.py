"""Benchmark: the adaptive policy on a generated family of workloads it was not tuned on.

Each of ``--workloads`` workloads (seeded) draws, log-uniformly unless said otherwise:
  steps per trajectory 4-40 (uniform); mean LLM response 0.5-60 s, heavy-tailed per step
  (log-normal, sigma 0.3-1.5); mean action 0.05-60 s (log-normal, sigma 0.5);
  checkpoint-to-response cost ratio 0.1-10 (each checkpoint +-30 % around its mean);
  failure probability per step 0.001-0.2 (known to the policy, as in grpo's fault-injection runs);
  and a bias of the policy's cost estimates, uniform in 0.5-1.5: every measured checkpoint cost the
  policy learns from is multiplied by it (the simulator charges the true cost).  The bias is in what
  the policy is told, not only in its prior; the simulator's clock (``StepObservation.now``) is
  true, as a trainer's is, so since 0.6.0 the policy calibrates its estimates against the waits it
  sees there (``CostCalibration``).
Each workload runs ``--runs`` batches of ``--trajectories`` trajectories, for adaptive and the fixed
policies never, always, every:2..every:8.  With ``--batches fresh`` (the default since 0.8.1) every
batch draws new trajectories from the workload's distributions, as every GRPO step samples new
prompts and responses; with ``--batches same`` (the only way before 0.8.1) every batch replays one
drawn batch with fresh failure streams, so a fixed period also profits in hindsight from where that
one batch's long responses fall (a checkpoint every k steps hidden behind them), which no policy
chosen in advance could know.  Every policy sees the same trajectories in a batch and the same
failures: one random stream per step of each trajectory (the simulator's
``failure_streams="per-step"``), so the ``n``-th attempt of a step fails alike under every policy,
also after a restore.  Reported: adaptive's mean batch rollout against the best fixed policy in
hindsight of that workload, in percent; its distribution and worst cases.

The comparison is noisy: a workload whose failures are rare pays a checkpoint in every batch and
recovers it only in the batches that fail.  A workload therefore starts with enough batches for
``--min-failures`` expected failures (since 0.8.1; 24 batches of 16 trajectories of 11 steps at
p = 0.001 expect 4, and a paired spread measured on batches that saw no failure says the noise is
nil).  Each workload reports the standard error of its paired
difference (adaptive minus the best fixed, batch by batch, in percent of the best fixed).  A
workload runs ``--runs`` batches; where that error is above ``--target-se`` and the result lies
within two errors of 1 % or 3 % (the goal's thresholds), it runs again with four times the batches,
up to ``--max-runs`` (the same seeds: the first batches repeat), as long as the run is younger than
``--escalate-for-s`` seconds.  The best of nine noisy means favours the fixed policies by up to
about the standard error.  `never` is not simulated where its expected failures alone
(``(1 - p)^-N - 1`` restores of 2 s) exceed three times the best other fixed policy's mean.

    python benchmarks/bench_family.py [--workloads 200] [--runs 24] [--max-runs 384]
        [--target-se 0.3] [--escalate-for-s 900] [--min-failures 20] [--trajectories 16] [--jobs 2]
        [--indices 3,50,73] [--exact-costs] [--batches fresh|same] [--out benchmarks/results/bench_family.json]

``--indices`` judges only those workloads of the family (the same draws and failure streams as in
a full run), for a quick check of a change on chosen workloads.  ``--exact-costs`` lets the policy
learn the true checkpoint costs (no bias; the fixed policies do not use them): how much of a loss
the biased estimates explain.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from belayer_policy import (
    PER_STEP,
    CheckpointCostModel,
    FixedStepProbability,
    PolicySpec,
    PolicySummary,
    SharedEstimators,
    SimulationConfig,
    Trajectory,
    Workload,
    compare_policies,
)

FIXED = ("never", "always", *(f"every:{k}" for k in range(2, 9)))


@attrs.define
class BiasedCostModel(CheckpointCostModel):
    """The policy's checkpoint-cost estimate, learning every measurement times ``bias``."""

    bias: float = 1.0

    def observe(self, cost_s: float) -> None:
        """Learn ``cost_s * bias``."""
        super().observe(cost_s * self.bias)


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


@attrs.frozen
class FamilyWorkload(Workload):
    """One workload of the family: its parameters, and trajectories drawn from them."""

    params: dict[str, Any] = attrs.field(factory=dict, kw_only=True)

    def draw(self, rng: random.Random) -> Trajectory:
        """One trajectory: heavy-tailed responses, log-normal actions, checkpoints +-30 % of the mean."""
        params = self.params
        checkpoint_mean = params["cost_ratio"] * params["response_mean_s"]

        def lognormal(mean: float, sigma: float) -> float:
            return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)  # that mean

        n = params["steps"]
        return Trajectory(
            [lognormal(params["response_mean_s"], params["response_sigma"]) for _ in range(n)],
            [lognormal(params["action_mean_s"], 0.5) for _ in range(n)],
            [checkpoint_mean * rng.uniform(0.7, 1.3) for _ in range(n)],
        )


def draw_workload(index: int, seed: int, num_trajectories: int) -> dict[str, Any]:
    """One workload's parameters, its generator and one batch of trajectories (``--batches same``)."""
    rng = random.Random(f"family:{seed}:{index}")
    params = {
        "steps": rng.randint(4, 40),
        "response_mean_s": _log_uniform(rng, 0.5, 60.0),
        "response_sigma": rng.uniform(0.3, 1.5),
        "action_mean_s": _log_uniform(rng, 0.05, 60.0),
        "cost_ratio": _log_uniform(rng, 0.1, 10.0),
        "fail_prob": _log_uniform(rng, 0.001, 0.2),
        "cost_bias": rng.uniform(0.5, 1.5),
    }
    generator = FamilyWorkload(params["steps"], params=params)
    # the same draws, in the same order, as before the generator existed: the batch of `same`
    batch = [generator.draw(rng) for _ in range(num_trajectories)]
    return {"params": params, "generator": generator, "batch": batch}


def batch_source(workload: dict[str, Any], batches: str, num_trajectories: int) -> dict[str, Any]:
    """``compare_policies``' batch arguments: ``fresh``, every batch draws its own trajectories from
    the workload (as every GRPO step samples new prompts and responses); ``same``, every batch
    replays the one drawn batch."""
    if batches == "fresh":
        return {"workload": workload["generator"], "num_trajectories": num_trajectories}
    return {"trace": workload["batch"]}


def judge(
    index: int,
    seed: int,
    num_trajectories: int,
    runs: int,
    max_runs: int = 0,
    target_se: float = 0.0,
    escalate_before: float = math.inf,
    exact_costs: bool = False,
    batches: str = "fresh",
    min_failures: float = 0.0,
) -> dict[str, Any]:
    """Adaptive against every fixed policy on one workload.

    It starts with enough batches for ``min_failures`` expected failures (first attempts of its
    steps), at least ``runs`` and at most ``max_runs``.

    While the paired standard error exceeds ``target_se`` percent and the result is within two
    standard errors of a threshold of the goal (1 % or 3 %), the workload runs again with four times
    the batches, up to ``max_runs`` and only before the wall-clock time ``escalate_before``.
    """
    if min_failures > 0:
        # a workload whose failures are rare differs from its best fixed policy only in the few
        # batches that fail: 24 batches may hold none, and the paired spread then misses them
        params = draw_workload(index, seed, 1)["params"]
        per_batch = num_trajectories * params["steps"] * params["fail_prob"]  # first attempts alone
        runs = max(runs, min(max_runs or runs, math.ceil(min_failures / per_batch)))
    while True:
        row = _judge_once(index, seed, num_trajectories, runs, exact_costs, batches)
        pct, se = row["vs_best_fixed_pct"], row["se_pct"]
        ambiguous = any(abs(pct - threshold) < 2.0 * se for threshold in (1.0, 3.0))
        if se <= target_se or not ambiguous or runs * 4 > max_runs or time.time() > escalate_before:
            return row
        runs *= 4


def _judge_once(
    index: int, seed: int, num_trajectories: int, runs: int, exact_costs: bool = False, batches: str = "fresh"
) -> dict[str, Any]:
    workload = draw_workload(index, seed, num_trajectories)
    params = workload["params"]

    def estimators() -> SharedEstimators:
        return SharedEstimators(
            failure_model=FixedStepProbability(params["fail_prob"]),
            checkpoint_costs=BiasedCostModel(bias=1.0 if exact_costs else params["cost_bias"]),
        )

    source = batch_source(workload, batches, num_trajectories)

    def simulate(names: tuple[str, ...]) -> list[PolicySummary]:
        # Each policy gets its own estimators and the same seeded streams, so simulating policies
        # apart gives exactly what one call with all of them gives.
        return compare_policies(
            [PolicySpec.parse(name) for name in names],
            config=SimulationConfig(fail_prob=params["fail_prob"], restore_s=2.0, failure_streams=PER_STEP),
            runs=runs,
            seed=seed + index,
            **source,
            estimators=estimators,
            carry_estimators=True,
        )

    summaries = simulate(("adaptive", *FIXED[1:]))
    best_other = min(statistics.fmean(s.rollouts_s) for s in summaries if s.policy != "adaptive")
    # `never` restarts from scratch: a trajectory of N steps fails (1 - p)^-N - 1 times on average
    # before it gets through, each failure costing at least the restore.  Where that alone exceeds
    # three times the best other fixed policy's mean, never cannot be the best in hindsight and its
    # simulation (hundreds of thousands of attempts at p = 0.2 over 40 steps) is skipped.
    never_floor = max(t.failure_free_s for t in workload["batch"]) + 2.0 * (
        (1.0 - params["fail_prob"]) ** -params["steps"] - 1.0
    )
    never_skipped = never_floor > 3.0 * best_other
    if not never_skipped:
        summaries += simulate(("never",))
    rollouts = {s.policy: s.rollouts_s for s in summaries}
    means = {name: statistics.fmean(values) for name, values in rollouts.items()}
    best = min((name for name in FIXED if name in means), key=lambda name: means[name])
    paired = [a - b for a, b in zip(rollouts["adaptive"], rollouts[best], strict=True)]
    se = statistics.stdev(paired) / math.sqrt(runs) if runs > 1 else math.inf
    checkpoints = {s.policy: s.metrics["checkpoints"].mean for s in summaries}
    return params | {
        "index": index,
        "runs": runs,
        "best_fixed": best,
        "adaptive_s": means["adaptive"],
        "best_fixed_s": means[best],
        "vs_best_fixed_pct": 100.0 * (means["adaptive"] - means[best]) / means[best],
        "se_pct": 100.0 * se / means[best],
        "adaptive_checkpoints": checkpoints["adaptive"],
        "best_fixed_checkpoints": checkpoints[best],
        "never_skipped": never_skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", type=int, default=200)
    parser.add_argument("--runs", type=int, default=24, help="batches per workload at first")
    parser.add_argument("--max-runs", type=int, default=384, help="at most this many batches per workload")
    parser.add_argument(
        "--target-se", type=float, default=0.3, help="percent: rerun a workload with 4x the batches above it"
    )
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument(
        "--exact-costs",
        action="store_true",
        help="the policy learns the true checkpoint costs (no bias): what the bias costs, for a diagnosis",
    )
    parser.add_argument(
        "--escalate-for-s",
        type=float,
        default=math.inf,
        help="no workload starts a rerun with more batches after this many seconds",
    )
    parser.add_argument(
        "--batches",
        choices=("fresh", "same"),
        default="fresh",
        help="fresh: each batch draws new trajectories from the workload; same: every batch replays one",
    )
    parser.add_argument(
        "--min-failures",
        type=float,
        default=20.0,
        help="start a workload with enough batches for this many expected failures (up to --max-runs)",
    )
    parser.add_argument("--indices", default="", help="comma-separated workload indices (default: all)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_family.json"))
    args = parser.parse_args()
    started, load_before = time.monotonic(), os.getloadavg()
    deadline = time.time() + args.escalate_for_s
    with ProcessPoolExecutor(args.jobs) as pool:
        indices = [int(i) for i in args.indices.split(",")] if args.indices else list(range(args.workloads))
        futures = [
            pool.submit(
                judge,
                i,
                args.seed,
                args.trajectories,
                args.runs,
                args.max_runs,
                args.target_se,
                deadline,
                args.exact_costs,
                args.batches,
                args.min_failures,
            )
            for i in indices
        ]
        rows = [f.result() for f in futures]
    pcts = sorted(r["vs_best_fixed_pct"] for r in rows)
    summary = {
        "workloads": len(rows),
        "within_1pct": sum(p <= 1.0 for p in pcts) / len(pcts),
        "within_3pct": sum(p <= 3.0 for p in pcts) / len(pcts),
        "median_pct": statistics.median(pcts),
        "p95_pct": pcts[min(len(pcts) - 1, math.ceil(0.95 * len(pcts)) - 1)],
        "worst_pct": pcts[-1],
        "best_pct": pcts[0],
        # noise: the paired standard error per workload, and the workloads whose difference is
        # more than two standard errors above 1 % (over 1 % beyond the noise) or below it
        "median_se_pct": statistics.median(r["se_pct"] for r in rows),
        "max_se_pct": max(r["se_pct"] for r in rows),
        "over_1pct_beyond_noise": sum(r["vs_best_fixed_pct"] - 2 * r["se_pct"] > 1.0 for r in rows),
        "over_3pct_beyond_noise": sum(r["vs_best_fixed_pct"] - 2 * r["se_pct"] > 3.0 for r in rows),
        "runs_total": sum(r["runs"] for r in rows),
    }
    result = {
        "args": vars(args),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "wall_s": time.monotonic() - started,
        "summary": summary,
        "worst": sorted(rows, key=lambda r: -r["vs_best_fixed_pct"])[:10],
        "workloads": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))
    for r in result["worst"]:
        print(
            f"{r['vs_best_fixed_pct']:+6.2f}% (se {r['se_pct']:.2f}, {r['runs']} runs) vs {r['best_fixed']:8s} ratio {r['cost_ratio']:5.2f} "
            f"p {r['fail_prob']:.3f} steps {r['steps']:2d} resp {r['response_mean_s']:5.1f} s "
            f"act {r['action_mean_s']:5.2f} s bias {r['cost_bias']:.2f}"
        )


if __name__ == "__main__":
    main()
