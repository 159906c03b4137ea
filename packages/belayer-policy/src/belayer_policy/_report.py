"""Many seeded batches per policy, summarised as mean / p50 / p95, and the comparison table."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from belayer_policy._errors import PolicyArgumentError
from belayer_policy._simulator import BatchOutcome, SimulationConfig, simulate_batch
from belayer_policy._spec import PolicySpec, SharedEstimators
from belayer_policy._workload import Trajectory, Workload

__all__ = ["METRICS", "PolicySummary", "Stats", "compare_policies", "format_table", "percentile"]

METRICS: dict[str, Callable[[BatchOutcome], float]] = {
    "rollout_s": lambda b: b.rollout_s,
    "failure_free_s": lambda b: b.failure_free_s,
    "increase_s": lambda b: b.rollout_s - b.failure_free_s,
    "increase_pct": lambda b: 100.0 * (b.rollout_s - b.failure_free_s) / b.failure_free_s,
    "lost_s": lambda b: b.lost_s,
    "visible_checkpoint_s": lambda b: b.visible_checkpoint_s,
    "visible_checkpoint_pct": lambda b: 100.0 * b.visible_checkpoint_s / b.failure_free_s,
    "lost_total_s": lambda b: b.lost_total_s,
    "visible_checkpoint_total_s": lambda b: b.visible_checkpoint_total_s,
    "checkpoints": lambda b: float(b.num_checkpoints),
    "failures": lambda b: float(b.num_failures),
}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    if not values:
        raise PolicyArgumentError("values must not be empty")
    if not 0 <= q <= 100:
        raise PolicyArgumentError(f"q must be in [0, 100], got {q!r}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@attrs.frozen
class Stats:
    """Mean, median and 95th percentile of one metric over the runs."""

    mean: float
    p50: float
    p95: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        """Summarise ``values``."""
        return cls(sum(values) / len(values), percentile(values, 50), percentile(values, 95))


@attrs.frozen
class PolicySummary:
    """One policy over all runs."""

    policy: str
    runs: int
    metrics: dict[str, Stats]
    rollouts_s: tuple[float, ...] = ()  # batch rollout time of every run, in run order (paired tests)

    def to_dict(self) -> dict[str, Any]:
        """Flat JSON: ``policy``, ``runs`` and ``<metric>_{mean,p50,p95}`` for every metric."""
        record: dict[str, Any] = {"policy": self.policy, "runs": self.runs}
        for name, stats in self.metrics.items():
            record[f"{name}_mean"] = stats.mean
            record[f"{name}_p50"] = stats.p50
            record[f"{name}_p95"] = stats.p95
        return record


def _rng(kind: str, seed: int, run: int, index: int) -> random.Random:
    # String seeds hash with SHA-512: stable across processes and Python versions.
    return random.Random(f"{kind}:{seed}:{run}:{index}")


def compare_policies(
    specs: Sequence[PolicySpec],
    *,
    config: SimulationConfig,
    runs: int,
    seed: int = 0,
    workload: Workload | None = None,
    num_trajectories: int = 64,
    trace: Sequence[Trajectory] | None = None,
    estimators: Callable[[], SharedEstimators] = SharedEstimators,
    carry_estimators: bool = False,
) -> list[PolicySummary]:
    """Run every policy on the same ``runs`` seeded batches and summarise each.

    Batches come from ``trace`` (the same trajectories every run, failures drawn per run) or are
    drawn from ``workload``.  Each run gives every policy identical trajectories and failure random
    streams (common random numbers), and fresh ``estimators`` shared by the batch's trajectories
    (their ``batch_size`` set to the batch's; trajectories' ``task`` / ``node`` labels used).
    With ``carry_estimators`` each policy keeps one set of estimators over all runs, as
    ``belayer-grpo train`` keeps them over a training run (only the first batch starts cold).
    """
    if not specs:
        raise PolicyArgumentError("specs must name at least one policy")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise PolicyArgumentError(f"runs must be an integer >= 1, got {runs!r}")
    if trace is None and (
        isinstance(num_trajectories, bool) or not isinstance(num_trajectories, int) or num_trajectories < 1
    ):
        raise PolicyArgumentError(f"num_trajectories must be an integer >= 1, got {num_trajectories!r}")
    if trace is not None and not trace:
        raise PolicyArgumentError("trace must hold at least one trajectory")
    source = workload if workload is not None else Workload()
    outcomes: dict[str, list[BatchOutcome]] = {spec.name: [] for spec in specs}
    carried = {spec.name: estimators() for spec in specs} if carry_estimators else {}
    for run in range(runs):
        batch = (
            list(trace)
            if trace is not None
            else [source.draw(_rng("work", seed, run, j)) for j in range(num_trajectories)]
        )
        for spec in specs:
            shared = attrs.evolve(carried.get(spec.name) or estimators(), batch_size=len(batch))
            policies = [spec.build(shared, task=t.task, node=t.node) for t in batch]
            rngs = [_rng("fail", seed, run, j) for j in range(len(batch))]
            outcomes[spec.name].append(simulate_batch(batch, policies, config, rngs))
    return [
        PolicySummary(
            policy=name,
            runs=runs,
            metrics={metric: Stats.of([get(b) for b in batches]) for metric, get in METRICS.items()},
            rollouts_s=tuple(b.rollout_s for b in batches),
        )
        for name, batches in outcomes.items()
    ]


def format_table(summaries: Sequence[PolicySummary]) -> str:
    """A markdown table: one row per policy, times in seconds (mean, with p95 where it matters)."""
    header = (
        "| policy | rollout s (mean / p95) | failure-free s | increase % (mean / p95) | lost s | "
        "visible ckpt s | visible ckpt % | checkpoints | failures |"
    )
    lines = [header, "|" + "---|" * 9]
    for s in summaries:
        m = s.metrics
        lines.append(
            f"| {s.policy} | {m['rollout_s'].mean:.1f} / {m['rollout_s'].p95:.1f} "
            f"| {m['failure_free_s'].mean:.1f} "
            f"| {m['increase_pct'].mean:.2f} / {m['increase_pct'].p95:.2f} "
            f"| {m['lost_s'].mean:.1f} | {m['visible_checkpoint_s'].mean:.3f} "
            f"| {m['visible_checkpoint_pct'].mean:.3f} | {m['checkpoints'].mean:.1f} "
            f"| {m['failures'].mean:.2f} |"
        )
    return "\n".join(lines)
