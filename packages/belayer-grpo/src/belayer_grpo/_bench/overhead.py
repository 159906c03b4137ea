"""Failure-free overhead: the same work with Belayer on and off, repeated, arms interleaved.

math: `belayer-grpo train` for ``math_steps`` steps, on = a shadow worker standing by in every
slot (``system.recovery = "shadow"``), off = no shadow (``"conventional"``).  The measure is the
steady-state step time (rollout, update, weight sync, from ``metrics.jsonl``): the first
``math_discard_steps`` steps of every run are dropped (they pay start-up costs and, before the
double-buffered weight server has cycled once, cannot show a reader holding a slot back), and
training checkpoints are off.  The weight push (``sync_s``) is reported apart: a shadow pins the
weight version it last read until its next periodic refresh, and the push waits for it.  With
``math_long_overrides`` a second configuration with longer steps is measured too.  The router's
journal is part of belayer-router and cannot be switched off, so it runs in both arms.
swe: agentic rollout batches, on = adaptive checkpoints, off = ``never``; ``always`` is measured
too, as the cost of checkpointing every step.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from belayer_grpo._bench.settings import BenchConfig
from belayer_grpo._bench.stats import relative_change, summarize
from belayer_grpo._bench.swe import SweHarness
from belayer_grpo._config import load_config

__all__ = ["run_math_overhead", "run_swe_overhead"]


async def _math_once(
    bench: BenchConfig, run_dir: Path, recovery: str, extra: Sequence[str]
) -> dict[str, list[float]]:
    """One training run; the steady-state steps' step, rollout and sync seconds."""
    from belayer_grpo._run import run_training

    oh = bench.overhead
    overrides = ["data.workload=math", *extra, f"algorithm.steps={oh.math_steps}", "chaos.kill_worker_at_steps=[]",
                 f"system.recovery={recovery}", f"system.run_dir={run_dir}", "logging.progress=false",
                 "logging.tensorboard=false", "system.checkpoint_every=0"]  # fmt: skip
    config = load_config(bench.math_config or None, overrides)
    await anyio.Path(run_dir).mkdir(parents=True, exist_ok=True)
    await run_training(config, stream=io.StringIO(), run_dir=run_dir)
    lines = await anyio.Path(run_dir / "metrics.jsonl").read_text()
    steps = [json.loads(line) for line in lines.splitlines()][oh.math_discard_steps :]
    return {key: [float(step[key]) for step in steps] for key in ("step_s", "rollout_s", "sync_s")}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _paired(on: list[float], off: list[float]) -> dict[str, Any]:
    pairs = [relative_change(a, b) for a, b in zip(on, off, strict=True)]
    off_stats = summarize(off)
    noise = (off_stats["std"] or 0.0) / off_stats["mean"] if off_stats["mean"] else 0.0
    return {"on_s": summarize(on), "off_s": off_stats, "overhead": summarize(pairs), "noise_floor": noise}


async def _math_variant(
    bench: BenchConfig, work_dir: Path, name: str, extra: Sequence[str]
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, list[float]]]] = {"shadow": [], "conventional": []}
    for repeat in range(bench.overhead.repeats):
        arms = ("shadow", "conventional") if repeat % 2 == 0 else ("conventional", "shadow")
        for arm in arms:
            runs[arm].append(await _math_once(bench, work_dir / f"math-{name}-{repeat}-{arm}", arm, extra))
    on = [_mean(run["step_s"]) for run in runs["shadow"]]
    off = [_mean(run["step_s"]) for run in runs["conventional"]]
    result = _paired(on, off)
    # Step-level noise: the standard error of the baseline's mean steady-state step time.
    off_steps = [s for run in runs["conventional"] for s in run["step_s"]]
    off_step_stats = summarize(off_steps)
    step_se = (off_step_stats["std"] or 0.0) / math.sqrt(len(off_steps)) / (off_step_stats["mean"] or 1.0)
    result["noise_floor"] = max(result["noise_floor"], step_se)
    steps = bench.overhead.math_steps - bench.overhead.math_discard_steps
    return {"workload": f"math ({name})", "steps": steps, "on": "shadow workers + journal",
            "off": "no shadow (journal on)", "overrides": list(extra), **result,
            "breakdown": {arm: {key: summarize([v for run in arm_runs for v in run[key]])
                                for key in ("step_s", "rollout_s", "sync_s")}
                          for arm, arm_runs in runs.items()}}  # fmt: skip


async def run_math_overhead(bench: BenchConfig, work_dir: Path) -> list[dict[str, Any]]:
    """``repeats`` pairs of training runs per configuration, the order of the arms alternating;
    the steady-state seconds per step are compared."""
    oh = bench.overhead
    results = [await _math_variant(bench, work_dir, "short steps", oh.math_overrides)]
    if oh.math_long_overrides:
        results.append(await _math_variant(bench, work_dir, "long steps", oh.math_long_overrides))
    return results


async def run_swe_overhead(bench: BenchConfig, work_dir: Path) -> dict[str, Any]:
    """``repeats`` rounds of never / adaptive / always, each ``swe_steps`` batches, order rotating."""
    arms = ["never", "adaptive", "always"]
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    checkpoints: dict[str, int] = dict.fromkeys(arms, 0)
    async with SweHarness.start(bench, work_dir / "swe-overhead") as harness:
        for repeat in range(bench.overhead.repeats):
            for arm in arms[repeat % 3 :] + arms[: repeat % 3]:
                total = 0.0
                for step in range(bench.overhead.swe_steps):
                    batch = await harness.batch(arm, 0.0, seed=100 + step)
                    total += batch["rollout_s"]
                    checkpoints[arm] += batch["num_checkpoints"]
                times[arm].append(total)
    result = {"workload": "swe", "steps": bench.overhead.swe_steps, "on": "adaptive checkpoints + journal",
              "off": "never (journal on)", **_paired(times["adaptive"], times["never"])}  # fmt: skip
    result["always"] = _paired(times["always"], times["never"])
    result["num_checkpoints"] = checkpoints
    return result
