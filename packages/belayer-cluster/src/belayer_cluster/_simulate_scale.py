"""Repetitions of the scale simulation: every strategy on the same failure traces, with intervals.

`simulate_scale` draws one failure trace per (scale, repetition) from a seed and runs every
strategy on it (common random numbers: the strategies differ only in how they recover), then
reports the mean effective training time ratio with a 95% confidence interval (Student's t over
the repetitions). `markdown_table` and `inputs_table` write what the README and the CLI print.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

import attrs

from belayer_cluster._errors import ClusterConfigError
from belayer_cluster._simulate import DAY_S, RunResult, Strategy, draw_failures, run_job
from belayer_cluster._simulate_inputs import INPUT_SOURCES, SimInputs

__all__ = ["DEFAULT_GPUS", "ScaleResult", "inputs_table", "markdown_table", "simulate_scale"]

DEFAULT_GPUS = (1024, 2048, 4096, 8192, 16384)
# Two-sided 95% Student t quantiles by degrees of freedom (beyond 30 the normal 1.96 is close).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 25: 2.060, 30: 2.042}  # fmt: skip


def _t95(dof: int) -> float:
    if dof > 30:
        return 1.96
    return _T95.get(dof) or _T95[max(d for d in _T95 if d <= dof)]


@attrs.frozen
class ScaleResult:
    """One strategy at one scale over every repetition."""

    gpus: int
    strategy: Strategy
    ratios: tuple[float, ...]
    num_failures: tuple[int, ...]
    num_rollbacks: tuple[int, ...]
    checkpoint_every_steps: int

    @property
    def mean(self) -> float:
        """Mean effective training time ratio over the repetitions."""
        return statistics.fmean(self.ratios)

    @property
    def ci95(self) -> float:
        """Half-width of the 95% confidence interval of the mean (0 with one repetition)."""
        if len(self.ratios) < 2:
            return 0.0
        return _t95(len(self.ratios) - 1) * statistics.stdev(self.ratios) / math.sqrt(len(self.ratios))

    def to_json(self) -> dict[str, Any]:
        """The JSON form (`--json`, the benchmark's results file)."""
        return {
            "gpus": self.gpus,
            "strategy": self.strategy.value,
            "ratio_mean": self.mean,
            "ratio_ci95": self.ci95,
            "ratios": list(self.ratios),
            "failures_mean": statistics.fmean(self.num_failures),
            "rollbacks_mean": statistics.fmean(self.num_rollbacks),
            "checkpoint_every_steps": self.checkpoint_every_steps,
        }


def simulate_scale(
    inputs: SimInputs,
    *,
    gpus: Sequence[int] = DEFAULT_GPUS,
    days: float = 30.0,
    repetitions: int = 10,
    seed: int = 0,
    strategies: Sequence[Strategy] = tuple(Strategy),
) -> list[ScaleResult]:
    """Every strategy at every scale, `repetitions` failure traces each, reproducible from `seed`."""
    if not (isinstance(days, int | float) and math.isfinite(days) and days > 0):
        raise ClusterConfigError(f"days must be > 0 (got {days!r})")
    if isinstance(repetitions, bool) or not isinstance(repetitions, int) or repetitions < 1:
        raise ClusterConfigError(f"repetitions must be a whole number >= 1 (got {repetitions!r})")
    if not gpus or not strategies:
        raise ClusterConfigError("give at least one GPU count and one strategy")
    horizon_s = days * DAY_S
    runs: dict[tuple[int, Strategy], list[RunResult]] = {}
    for scale in gpus:
        for repetition in range(repetitions):
            rng = random.Random(f"{seed}/{scale}/{repetition}")
            failures = draw_failures(inputs, scale, horizon_s, rng)
            for strategy in strategies:
                runs.setdefault((scale, strategy), []).append(
                    run_job(inputs, strategy, scale, horizon_s, failures)
                )
    return [
        ScaleResult(
            gpus=scale,
            strategy=strategy,
            ratios=tuple(r.ratio for r in results),
            num_failures=tuple(r.num_failures for r in results),
            num_rollbacks=tuple(r.num_rollbacks for r in results),
            checkpoint_every_steps=results[0].checkpoint_every_steps,
        )
        for (scale, strategy), results in runs.items()
    ]


_TITLES = {
    Strategy.JOB_RESTART: "(a) job restart from checkpoint",
    Strategy.ROLE_RESTART: "(b) restart the failed role",
    Strategy.BELAYER: "(c) Belayer",
}


def markdown_table(results: Sequence[ScaleResult]) -> str:
    """Effective training time ratio, mean +- 95% CI, one row per scale, one column per strategy."""
    strategies = list(dict.fromkeys(r.strategy for r in results))
    by_key = {(r.gpus, r.strategy): r for r in results}
    header = "| GPUs | failures (mean) | " + " | ".join(_TITLES[s] for s in strategies) + " |"
    lines = [header, "|---:|---:|" + "---:|" * len(strategies)]
    for scale in dict.fromkeys(r.gpus for r in results):
        first = by_key[(scale, strategies[0])]
        cells = [f"{by_key[(scale, s)].mean:.4f} ± {by_key[(scale, s)].ci95:.4f}" for s in strategies]
        lines.append(
            f"| {scale:,} | {statistics.fmean(first.num_failures):.1f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def inputs_table(inputs: SimInputs, sources: dict[str, str] | None = None) -> str:
    """Every input: name, value, unit, source (overridden sources in `sources`), note."""
    lines = ["| input | value | unit | source | note |", "|---|---:|---|---|---|"]
    for name, info in INPUT_SOURCES.items():
        value = getattr(inputs, name)
        source = (sources or {}).get(name, info.source)
        lines.append(f"| `{name}` | {value:.6g} | {info.unit} | {source} | {info.note} |")
    return "\n".join(lines)
