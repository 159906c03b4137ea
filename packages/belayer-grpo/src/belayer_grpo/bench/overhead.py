"""Failure-free overhead: the same work with Belayer on and off, repeated, arms interleaved.

math: `belayer-grpo train` for ``math_steps`` steps (the summed step times of ``metrics.jsonl``:
rollout, update, weight sync, checkpoints), on = a shadow worker standing by in every slot
(``system.recovery = "shadow"``), off = no shadow (``"conventional"``).  The router's journal is
part of belayer-router and cannot be switched off, so it runs in both arms.
swe: agentic rollout batches (the trainer does not run the SWE workload yet), on = adaptive
checkpoints, off = ``never``; ``always`` is measured too, as the cost of checkpointing every step.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import anyio

from belayer_grpo.bench.settings import BenchConfig
from belayer_grpo.bench.stats import relative_change, summarize
from belayer_grpo.bench.swe import SweHarness
from belayer_grpo.config import load_config

__all__ = ["run_math_overhead", "run_swe_overhead"]


async def _math_once(bench: BenchConfig, run_dir: Path, recovery: str) -> float:
    from belayer_grpo.run import run_training

    oh = bench.overhead
    overrides = [*oh.math_overrides, f"algorithm.steps={oh.math_steps}", "chaos.kill_worker_at_steps=[]",
                 f"system.recovery={recovery}", f"system.run_dir={run_dir}", "logging.progress=false",
                 "logging.tensorboard=false", "system.checkpoint_every=2"]  # fmt: skip
    config = load_config(bench.math_config or None, overrides)
    await anyio.Path(run_dir).mkdir(parents=True, exist_ok=True)
    await run_training(config, stream=io.StringIO(), run_dir=run_dir)
    lines = await anyio.Path(run_dir / "metrics.jsonl").read_text()
    steps = [json.loads(line) for line in lines.splitlines()]
    return sum(float(step["step_s"]) for step in steps)


def _paired(on: list[float], off: list[float]) -> dict[str, Any]:
    pairs = [relative_change(a, b) for a, b in zip(on, off, strict=True)]
    off_stats = summarize(off)
    noise = (off_stats["std"] or 0.0) / off_stats["mean"] if off_stats["mean"] else 0.0
    return {"on_s": summarize(on), "off_s": off_stats, "overhead": summarize(pairs), "noise_floor": noise}


async def run_math_overhead(bench: BenchConfig, work_dir: Path) -> dict[str, Any]:
    """``repeats`` pairs of training runs, the order of the arms alternating."""
    on: list[float] = []
    off: list[float] = []
    for repeat in range(bench.overhead.repeats):
        arms = ("shadow", "conventional") if repeat % 2 == 0 else ("conventional", "shadow")
        for arm in arms:
            seconds = await _math_once(bench, work_dir / f"math-{repeat}-{arm}", arm)
            (on if arm == "shadow" else off).append(seconds)
    return {"workload": "math", "steps": bench.overhead.math_steps, "on": "shadow workers + journal",
            "off": "no shadow (journal on)", **_paired(on, off)}  # fmt: skip


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
