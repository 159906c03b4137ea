"""Benchmark: the adaptive policy against the best fixed policy in hindsight, on every workload.

Workloads (64 trajectories a batch unless a trace gives them, restore 2 s):
  swe     20 rounds, responses 5-60 s, actions 0.1-10 s, checkpoints 0.3-1 s (hidden by responses)
  math    6 rounds, responses 2-20 s, actions 0.05-1 s, checkpoints 0.3-1.5 s (short tool calls)
  stress  20 rounds, responses 1-5 s, actions 0.1-2 s, checkpoints 2-8 s (mostly visible)
  recorded traces (``--trace NAME=PATH``, default: the shipped ``traces/*.jsonl``): their measured
  response, action and checkpoint times; their recorded failures (injected at the recording run's
  chaos rate) are dropped so that p decides here too
at p = 0.01 and 0.05 failures per step.  Policies: adaptive, paper (the round-1 rule), never,
always, every:2..every:8, all on the same seeded batches and failure streams.  The failure
probability is known to the policies as it is in ``belayer-grpo``'s fault-injection runs
(``FixedStepProbability``), and each policy keeps its estimators over the runs as a training run
does; ``adaptive-learned`` learns the hazard online from a prior of one failure per container hour
instead, ``adaptive-cold`` starts every batch with fresh estimators.  Then the cost of one
``decide()`` call per rule.

    python benchmarks/bench_policy.py [--runs 40] [--jobs 2] [--out benchmarks/results/bench_policy.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from belayer_policy import (
    FixedStepProbability,
    PolicySpec,
    PolicySummary,
    SharedEstimators,
    SimulationConfig,
    StepObservation,
    Trajectory,
    UniformRange,
    Workload,
    compare_policies,
    load_trace,
)

HERE = Path(__file__).parent
FIXED: tuple[str, ...] = ("never", "always", *(f"every:{k}" for k in range(2, 9)))
POLICIES: tuple[str, ...] = ("adaptive", "paper", *FIXED)
VARIANTS: tuple[str, ...] = ("learned", "cold")
# Batches per row = --runs x this: a row's differences are a few percent, and a short recorded
# trace sees well under one failure a batch, so a few failures would decide a row of 40 batches.
RUN_SCALE = {"swe": 1, "math": 2, "stress": 3, "recorded": 25}
WORKLOADS = {
    "swe": Workload(20, UniformRange(5.0, 60.0), UniformRange(0.1, 10.0), UniformRange(0.3, 1.0)),
    "math": Workload(6, UniformRange(2.0, 20.0), UniformRange(0.05, 1.0), UniformRange(0.3, 1.5)),
    "stress": Workload(20, UniformRange(1.0, 5.0), UniformRange(0.1, 2.0), UniformRange(2.0, 8.0)),
}


def _run(
    specs: Sequence[str],
    estimators: Callable[[], SharedEstimators],
    p: float,
    runs: int,
    workload: Workload | None,
    trace: list[Trajectory] | None,
    carry: bool = True,
) -> list[PolicySummary]:
    return compare_policies(
        [PolicySpec.parse(s) for s in specs],
        config=SimulationConfig(fail_prob=p, restore_s=2.0),
        runs=runs,
        seed=2024,
        workload=workload,
        num_trajectories=64,
        trace=trace,
        estimators=estimators,
        carry_estimators=carry,
    )


def _one(
    spec: str, variant: str, p: float, runs: int, workload: Workload | None, trace: list[Trajectory] | None
) -> PolicySummary:
    """One policy on one row: ``known`` p, ``learned`` hazard, or ``cold`` (fresh estimators each batch)."""

    def known() -> SharedEstimators:
        return SharedEstimators(failure_model=FixedStepProbability(p))

    estimators = SharedEstimators if variant == "learned" else known
    return _run((spec,), estimators, p, runs, workload, trace, carry=variant != "cold")[0]


def _submit(
    pool: ProcessPoolExecutor,
    name: str,
    p: float,
    runs: int,
    workload: Workload | None = None,
    trace: list[Trajectory] | None = None,
) -> tuple[str, float, int, list[tuple[str, Future[PolicySummary]]]]:
    runs *= RUN_SCALE["recorded" if trace is not None else name]
    jobs = [(spec, "known") for spec in POLICIES] + [("adaptive", v) for v in VARIANTS]
    futures = [
        (
            spec if variant == "known" else f"adaptive-{variant}",
            pool.submit(_one, spec, variant, p, runs, workload, trace),
        )
        for spec, variant in jobs
    ]
    return name, p, runs, futures


def _scenario(name: str, p: float, runs: int, done: dict[str, PolicySummary]) -> dict[str, Any]:
    summaries = [done[spec] for spec in POLICIES]
    variants = {f"adaptive-{v}": done[f"adaptive-{v}"] for v in VARIANTS}
    rollouts = {s.policy: s.rollouts_s for s in summaries} | {k: v.rollouts_s for k, v in variants.items()}
    records = [s.to_dict() for s in summaries]
    records += [v.to_dict() | {"policy": k} for k, v in variants.items()]
    by_name = {r["policy"]: r for r in records}
    best = min(FIXED, key=lambda n: by_name[n]["rollout_s_mean"])
    best_rollout = by_name[best]["rollout_s_mean"]
    never_increase = by_name["never"]["increase_s_mean"]

    def judged(policy: str) -> dict[str, float | None]:
        r = by_name[policy]
        # Paired over the same seeded batches: mean and 95 % half-width of the per-batch difference.
        diffs = [a - b for a, b in zip(rollouts[policy], rollouts[best], strict=True)]
        half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        return {
            "vs_best_fixed_pct": 100.0 * (r["rollout_s_mean"] - best_rollout) / best_rollout,
            "vs_best_fixed_ci95_pct": 100.0 * half / best_rollout,
            "cut_vs_never_pct": 100.0 * (never_increase - r["increase_s_mean"]) / never_increase
            if never_increase > 0
            else None,
            "visible_pct": r["visible_checkpoint_pct_mean"],
        }

    return {
        "scenario": name,
        "fail_prob": p,
        "runs": runs,
        "best_fixed": best,
        "policies": records,
        "judged": {
            policy: judged(policy)
            for policy in ("adaptive", *(f"adaptive-{v}" for v in VARIANTS), "paper", best)
        },
    }


def _decision_cost(name: str, calls: int) -> float:
    """Microseconds per decide() on a warmed policy (full response-time window, 20-step horizon)."""
    shared = SharedEstimators(failure_model=FixedStepProbability(0.01), batch_size=64)
    policy = PolicySpec.parse(name).build(shared)
    rng = random.Random(0)
    observations = [
        StepObservation(
            k % 20 + 1, rng.uniform(1, 5), rng.uniform(0.1, 2), now=float(k), remaining_steps=19 - k % 20
        )
        for k in range(calls)
    ]
    for obs in observations[:200]:
        shared.response_times.observe(obs.response_s)
    start = time.perf_counter()
    for obs in observations:
        if policy.decide(obs).checkpoint:
            policy.on_checkpoint_ready(5.0)
    return (time.perf_counter() - start) / calls * 1e6


def _table(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| workload | p | best fixed (hindsight) | policy | rollout s (mean / p95) | vs best fixed (paired 95 % CI) | "
        "increase cut vs never | visible ckpt % | checkpoints / batch | failures / batch |",
        "|" + "---|" * 10,
    ]
    for r in results:
        by_name = {p["policy"]: p for p in r["policies"]}
        names = ("adaptive", *(f"adaptive-{v}" for v in VARIANTS), "paper", r["best_fixed"], "never")
        for policy in dict.fromkeys(names):  # the best fixed policy may be never
            rec = by_name[policy]
            j = r["judged"].get(policy)
            vs = f"{j['vs_best_fixed_pct']:+.2f} ± {j['vs_best_fixed_ci95_pct']:.2f} %" if j else "-"
            cut = f"{j['cut_vs_never_pct']:.1f} %" if j and j["cut_vs_never_pct"] is not None else "-"
            lines.append(
                f"| {r['scenario']} | {r['fail_prob']} | {r['best_fixed']} | {policy} "
                f"| {rec['rollout_s_mean']:.1f} / {rec['rollout_s_p95']:.1f} | {vs} | {cut} "
                f"| {rec['visible_checkpoint_pct_mean']:.2f} | {rec['checkpoints_mean']:.0f} | {rec['failures_mean']:.1f} |"
            )
    return lines


def main() -> None:
    global FIXED, POLICIES, VARIANTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="batches per row before RUN_SCALE")
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--jobs", type=int, default=2, help="policies simulated in parallel")
    parser.add_argument(
        "--fixed", nargs="+", default=list(FIXED), help="the fixed policies to pick the best from"
    )
    parser.add_argument("--no-variants", action="store_true", help="skip adaptive-learned and adaptive-cold")
    parser.add_argument("--probabilities", type=float, nargs="+", default=[0.01, 0.05])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--trace", action="append", default=None, metavar="NAME=PATH")
    parser.add_argument("--no-traces", action="store_true", help="skip the recorded traces' rows")
    parser.add_argument("--out", default=str(HERE / "results" / "bench_policy.json"))
    args = parser.parse_args()
    FIXED = tuple(args.fixed)
    POLICIES = ("adaptive", "paper", *FIXED)
    VARIANTS = () if args.no_variants else VARIANTS

    traces = (
        {}
        if args.no_traces
        else dict(item.split("=", 1) for item in args.trace)
        if args.trace
        else {f"recorded:{path.stem}": str(path) for path in sorted((HERE / "traces").glob("*.jsonl"))}
    )
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = []
        for p in args.probabilities:
            for name in args.workloads:
                rows.append(_submit(pool, name, p, args.runs, workload=WORKLOADS[name]))
            for name, path in traces.items():
                # The recorded failures were injected at the recording run's chaos rate; here p decides.
                replayed = [attrs.evolve(t, failures=()) for t in load_trace(path)]
                rows.append(_submit(pool, name, p, args.runs, trace=replayed))
        results = [
            _scenario(name, p, runs, {label: future.result() for label, future in futures})
            for name, p, runs, futures in rows
        ]
    simulate_s = time.perf_counter() - started
    decision_us = {
        name: _decision_cost(name, args.calls) for name in ("adaptive", "paper", "always", "never")
    }
    lines = _table(results)
    lines += ["", "| decide() | microseconds per call |", "|---|---|"]
    lines += [f"| {name} | {us:.2f} |" for name, us in decision_us.items()]
    table = "\n".join(lines)
    print(table)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": "python benchmarks/bench_policy.py " + " ".join(sys.argv[1:]),
                "python": platform.python_version(),
                "machine": platform.machine(),
                "runs": args.runs,
                "run_scale": RUN_SCALE,
                "traces": traces,
                "simulate_s": simulate_s,
                "scenarios": results,
                "decision_microseconds": decision_us,
                "table": table,
            },
            indent=2,
        )
    )
    print(f"\nsaved {out} ({simulate_s:.0f} s of simulation)")


if __name__ == "__main__":
    main()
