"""Environment failures: sandboxes killed with probability p per step, under each checkpoint policy.

For every seed the failure-free batch (p = 0, ``never``: no checkpoint at all) is the baseline;
each (p, policy) batch with the same seed runs the same trajectories with seeded kills, and its
rollout-time increase is relative to that baseline.  The checkpoints of every batch also feed the
checkpoint-cost distribution (`checkpoint_costs`): what each checkpoint added to its trajectory's
critical path is measured from timestamps (how long the next action waited for it).  With
``blocking_variant`` the same harness also rolls out, per seed and without failures, one batch
under ``always`` with checkpoints overlapping the next response and one with every checkpoint
blocking it: the baseline that the overlap is measured against, in the same run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from belayer_grpo._bench.settings import BenchConfig
from belayer_grpo._bench.stats import relative_change, summarize
from belayer_grpo._bench.swe import SweHarness

__all__ = ["checkpoint_costs", "run_env_failures"]


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
    rows = []
    for p in env.probabilities:
        for policy in env.policies:
            mine = [r for r in runs if not r["baseline"] and r["kill_p"] == p and r["policy"] == policy]
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
        "runs": runs,
        "variants": variants,
        "baselines_s": summarize(list(baselines.values())),
    }


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
