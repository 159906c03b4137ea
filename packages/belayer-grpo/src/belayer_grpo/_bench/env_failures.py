"""Environment failures: sandboxes killed with probability p per step, under each checkpoint policy.

For every seed the failure-free batch (p = 0, ``never``: no checkpoint at all) is the baseline;
each (p, policy) batch with the same seed runs the same trajectories with seeded kills, and its
rollout-time increase is relative to that baseline.  The checkpoints of every batch also feed the
checkpoint-cost distribution (`checkpoint_costs`): what each checkpoint added to its trajectory's
critical path is measured from timestamps (how long the next action waited for it).  With
``blocking_variant`` the same harness also rolls out, per seed and without failures, one batch
under ``always`` with checkpoints overlapping the next response and one with every checkpoint
blocking it: the baseline that the overlap is measured against, in the same run.

At ``separate_p`` (one failure a batch or less at p = 0.01: a few batches cannot tell the policies
apart) further seeds run ``never`` and ``adaptive`` (each with its failure-free baseline) until the
95 % confidence intervals of their increase separate, or ``max_repeats`` seeds in all, or
``max_repeat_s`` seconds of repeats; `separation` says which stopped it and how many failures
each arm saw.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from belayer_grpo._bench.settings import BenchConfig
from belayer_grpo._bench.simcheck import compare_with_simulator
from belayer_grpo._bench.stats import intervals_separate, mean_ci95, relative_change, summarize
from belayer_grpo._bench.swe import SweHarness

__all__ = ["SEPARATED_ARMS", "checkpoint_costs", "run_env_failures", "separation"]

SEPARATED_ARMS = ("never", "adaptive")


async def run_env_failures(
    bench: BenchConfig, work_dir: Path, *, blocking_variant: bool = False
) -> dict[str, Any]:
    """Every (p, policy, seed) batch and its baseline; aggregated per (p, policy)."""
    env = bench.env_failures
    runs: list[dict[str, Any]] = []
    variants: list[dict[str, Any]] = []
    baselines: dict[int, float] = {}
    async with SweHarness.start(bench, work_dir / "env-failures") as harness:
        if blocking_variant:
            for seed in env.seeds:
                for blocking in (False, True):
                    variants.append(await harness.batch("always", 0.0, seed, blocking=blocking))
        for seed in env.seeds:
            baseline = await harness.batch("never", 0.0, seed)
            baselines[seed] = baseline["rollout_s"]
            runs.append(baseline | {"increase": 0.0, "baseline": True})
            for p in env.probabilities:
                for policy in env.policies:
                    batch = await harness.batch(policy, p, seed)
                    runs.append(batch | {"increase": relative_change(batch["rollout_s"], baselines[seed]),
                                         "baseline": False})  # fmt: skip
        repeats = await _repeat_until_separate(harness, bench, runs, baselines) if env.separate_p else []
    rows = []
    for p in env.probabilities:
        for policy in env.policies:
            mine = [r for r in _arm_runs(runs, p, policy) if not r.get("repeat")]
            rows.append({
                "kill_p": p, "policy": policy,
                "increase": summarize([r["increase"] for r in mine]),
                "rollout_s": summarize([r["rollout_s"] for r in mine]),
                "baseline_s": summarize([baselines[r["seed"]] for r in mine]),
                "num_failures": sum(r["num_failures"] for r in mine),
                "num_recoveries_from_checkpoint": sum(r["num_recoveries_from_checkpoint"] for r in mine),
                "num_checkpoints": sum(r["num_checkpoints"] for r in mine),
                "tokens_regenerated": sum(r["tokens_regenerated"] for r in mine),
                "all_prefix_consistent": all(r["all_prefix_consistent"] for r in mine),
            })  # fmt: skip
    return {
        "rows": rows,
        "separation": separation(runs + repeats, env.separate_p, bench) if env.separate_p else None,
        "simulator": compare_with_simulator(runs + repeats, bench.swe.every_k),
        "runs": runs + repeats,
        "variants": variants,
        "baselines_s": summarize(list(baselines.values())),
    }


def _arm_runs(runs: list[dict[str, Any]], p: float, policy: str) -> list[dict[str, Any]]:
    return [r for r in runs if not r["baseline"] and r["kill_p"] == p and r["policy"] == policy]


async def _repeat_until_separate(
    harness: SweHarness, bench: BenchConfig, runs: list[dict[str, Any]], baselines: dict[int, float]
) -> list[dict[str, Any]]:
    """More seeds of never and adaptive at ``separate_p`` until the intervals separate or a cap."""
    env = bench.env_failures
    p = env.separate_p
    repeats: list[dict[str, Any]] = []
    started = time.monotonic()
    seed = max(env.seeds) + 1
    while True:
        done = runs + repeats
        if _stop_reason(done, p, bench, time.monotonic() - started) is not None:
            return repeats
        if seed not in baselines:
            baseline = await harness.batch("never", 0.0, seed)
            baselines[seed] = baseline["rollout_s"]
            repeats.append(baseline | {"increase": 0.0, "baseline": True, "repeat": True})
        for policy in SEPARATED_ARMS:
            if not any(r["seed"] == seed for r in _arm_runs(done, p, policy)):
                batch = await harness.batch(policy, p, seed)
                repeats.append(batch | {"increase": relative_change(batch["rollout_s"], baselines[seed]),
                                        "baseline": False, "repeat": True})  # fmt: skip
        seed += 1


def _stop_reason(runs: list[dict[str, Any]], p: float, bench: BenchConfig, spent_s: float) -> str | None:
    env = bench.env_failures
    arms = [[r["increase"] for r in _arm_runs(runs, p, policy)] for policy in SEPARATED_ARMS]
    if intervals_separate(*arms):
        return "separated"
    if min(len(a) for a in arms) >= env.max_repeats:
        return "max_repeats"
    if spent_s >= env.max_repeat_s:
        return "max_repeat_s"
    return None


def separation(runs: list[dict[str, Any]], p: float, bench: BenchConfig) -> dict[str, Any]:
    """Whether never's and adaptive's 95 % intervals of the increase at ``p`` separate, what stopped
    the repeats (``separated``, ``max_repeats`` or ``max_repeat_s``), and the failures per arm."""
    env = bench.env_failures
    arms: dict[str, Any] = {}
    for policy in SEPARATED_ARMS:
        mine = _arm_runs(runs, p, policy)
        increases = [r["increase"] for r in mine]
        ci = mean_ci95(increases)
        arms[policy] = {
            "n": len(mine),
            "increase": summarize(increases),
            "increase_ci95": None if ci is None else [ci[0] - ci[1], ci[0] + ci[1]],
            "num_failures": sum(r["num_failures"] for r in mine),
            "num_checkpoints": sum(r["num_checkpoints"] for r in mine),
        }
    stopped_by = _stop_reason(runs, p, bench, float("inf"))
    return {"kill_p": p, "separated": stopped_by == "separated", "stopped_by": stopped_by,
            "seeds": min(arm["n"] for arm in arms.values()), "max_repeats": env.max_repeats,
            "max_repeat_s": env.max_repeat_s, "arms": arms}  # fmt: skip


def _arm(batches: list[dict[str, Any]]) -> dict[str, Any]:
    checkpoints = [c for batch in batches for c in batch.get("checkpoints", [])]
    return {
        "rollout_s": summarize([batch["rollout_s"] for batch in batches]),
        "num_checkpoints": len(checkpoints),
        "checkpoint_s": sum(c["seconds"] for c in checkpoints),
        "critical_path_s": sum(c["waited_s"] for c in checkpoints),
    }


def checkpoint_costs(
    runs: list[dict[str, Any]], variants: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The distribution of checkpoint durations and the share the response bubbles hid; with
    ``variants``, the overlapped and blocking arms side by side."""
    records = [c for run in runs for c in run.get("checkpoints", [])]
    seconds = sorted(c["seconds"] for c in records)
    total = sum(seconds)
    hidden = sum(c["hidden_s"] for c in records)

    def quantile(q: float) -> float | None:
        return seconds[min(len(seconds) - 1, int(q * len(seconds)))] if seconds else None

    return {
        "num_checkpoints": len(records),
        "seconds": summarize(seconds),
        "p50_s": quantile(0.5),
        "p90_s": quantile(0.9),
        "p99_s": quantile(0.99),
        "total_s": total,
        "hidden_s": hidden,
        "exposed_s": total - hidden,
        "hidden_fraction": hidden / total if total else None,
        "fully_hidden": sum(1 for c in records if c["exposed_s"] <= 0.0),
        "response_s": summarize([c["response_s"] for c in records]),
        "bytes": summarize([float(c["bytes"]) for c in records]),
        "records": records,
        "critical_path_s": sum(c.get("waited_s", c["exposed_s"]) for c in records),
        "arms": {
            "overlapped": _arm([v for v in variants or [] if not v["blocking"]]),
            "blocking": _arm([v for v in variants or [] if v["blocking"]]),
        }
        if variants
        else None,
    }
