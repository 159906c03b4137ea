"""Benchmark: rollout-time increase over failure-free under adaptive, always, every-3 and never.

SWE-like trajectories (20 rounds, LLM responses 5-60 s, actions 0.1-10 s, checkpoints 0.3-1 s),
p = 0.01 and 0.05 per step, 64 trajectories a batch, every policy on the same seeded batches.
Targets: adaptive cuts the increase by >= 80 % against never; checkpoint time visible on the
critical path < 1 % of failure-free rollout time.  A stress scenario (checkpoints longer than
responses) shows where the rule's one-step view falls short.  Then the cost of one decision.

    python benchmarks/bench_policy.py [--runs 100] [--out benchmarks/results/bench_policy.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

from belayer_policy import (
    PolicySpec,
    SharedEstimators,
    SimulationConfig,
    StepObservation,
    UniformRange,
    Workload,
    compare_policies,
)

POLICIES = ("adaptive", "always", "every:3", "never")
SWE = Workload(20, UniformRange(5.0, 60.0), UniformRange(0.1, 10.0), UniformRange(0.3, 1.0))
STRESS = Workload(20, UniformRange(1.0, 5.0), UniformRange(0.1, 2.0), UniformRange(2.0, 8.0))


def _scenario(name: str, workload: Workload, fail_prob: float, runs: int) -> dict[str, object]:
    summaries = compare_policies(
        [PolicySpec.parse(p) for p in POLICIES],
        config=SimulationConfig(fail_prob=fail_prob, restore_s=2.0),
        runs=runs,
        seed=2024,
        workload=workload,
        num_trajectories=64,
    )
    by_name = {s.policy: s for s in summaries}
    never = by_name["never"].metrics["increase_s"].mean
    adaptive = by_name["adaptive"].metrics["increase_s"].mean
    return {
        "scenario": name,
        "fail_prob": fail_prob,
        "runs": runs,
        "policies": [s.to_dict() for s in summaries],
        "adaptive_cut_vs_never_pct": 100.0 * (never - adaptive) / never if never > 0 else None,
        "adaptive_visible_pct": by_name["adaptive"].metrics["visible_checkpoint_pct"].mean,
    }


def _rows(result: dict[str, object]) -> list[str]:
    rows = []
    for p in result["policies"]:  # type: ignore[attr-defined]
        rows.append(
            f"| {result['scenario']} | {result['fail_prob']} | {p['policy']} "
            f"| {p['failure_free_s_mean']:.1f} "
            f"| {p['rollout_s_mean']:.1f} / {p['rollout_s_p95']:.1f} "
            f"| {p['increase_pct_mean']:.2f} / {p['increase_pct_p95']:.2f} | {p['lost_s_mean']:.1f} "
            f"| {p['visible_checkpoint_s_mean']:.3f} ({p['visible_checkpoint_pct_mean']:.3f} %) "
            f"| {p['checkpoints_mean']:.0f} | {p['failures_mean']:.1f} |"
        )
    return rows


def _decision_cost(name: str, calls: int) -> float:
    """Microseconds per decide() on a warmed policy (full response-time window)."""
    shared = SharedEstimators()
    policy = PolicySpec.parse(name).build(shared)
    rng = random.Random(0)
    observations = [
        StepObservation(k % 20 + 1, rng.uniform(5, 60), rng.uniform(0.1, 10), now=float(k))
        for k in range(calls)
    ]
    for obs in observations[:200]:
        shared.response_times.observe(obs.response_s)
    start = time.perf_counter()
    for obs in observations:
        if policy.decide(obs).checkpoint:
            policy.on_checkpoint_ready(0.5)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--calls", type=int, default=50_000)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_policy.json"))
    args = parser.parse_args()

    results = [_scenario("swe", SWE, p, args.runs) for p in (0.01, 0.05)]
    results += [_scenario("stress", STRESS, p, args.runs) for p in (0.01, 0.05)]
    header = (
        "| scenario | p | policy | failure-free s | rollout s (mean / p95) | increase % (mean / p95) "
        "| lost s | visible ckpt s (% of failure-free) | checkpoints / batch | failures / batch |"
    )
    lines = [header, "|" + "---|" * 10]
    for result in results:
        lines += _rows(result)
    lines.append("")
    lines.append(
        "| scenario | p | adaptive cuts increase vs never (target >= 80 %) "
        "| adaptive visible % (target < 1 %) |"
    )
    lines.append("|---|---|---|---|")
    for r in results:
        cut, visible = r["adaptive_cut_vs_never_pct"], r["adaptive_visible_pct"]
        lines.append(f"| {r['scenario']} | {r['fail_prob']} | {cut:.1f} % | {visible:.3f} % |")
    decision_us = {name: _decision_cost(name, args.calls) for name in ("adaptive", "always", "never")}
    lines.append("")
    lines.append("| decide() | microseconds per call |")
    lines.append("|---|---|")
    lines += [f"| {name} | {us:.2f} |" for name, us in decision_us.items()]
    table = "\n".join(lines)
    print(table)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "runs": args.runs,
                "scenarios": results,
                "decision_microseconds": decision_us,
                "table": table,
            },
            indent=2,
        )
    )
    print(f"\nsaved {out}")


if __name__ == "__main__":
    main()
