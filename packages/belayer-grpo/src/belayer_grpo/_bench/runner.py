"""`run_bench`: run the chosen experiments in order and write the report."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import attrs

from belayer_grpo._bench.build_recovery import run_build_recovery
from belayer_grpo._bench.env_failures import checkpoint_costs, run_env_failures
from belayer_grpo._bench.overhead import run_math_overhead, run_swe_overhead
from belayer_grpo._bench.report import write_report
from belayer_grpo._bench.settings import EXPERIMENTS, BenchConfig
from belayer_grpo._bench.worker_failure import run_worker_failure
from belayer_grpo._errors import GrpoConfigError

__all__ = ["quick_config", "run_bench"]

_DESCRIPTIONS = {
    "overhead": ["The same work with Belayer on and off, arms interleaved (order alternating); overhead is "
                 "the mean of the paired relative differences. math: steady-state seconds per training step "
                 "(the first steps of each run dropped, training checkpoints off); swe: seconds per rollout "
                 "batch. The noise floor is the larger of the baseline's run-to-run coefficient of variation "
                 "and (math) the standard error of its mean step time: an overhead below it is not resolved."],
    "worker-failure": ["One SIGKILLed main worker per rollout, the same seeded batch rolled out without and "
                       "with the failure; Belayer's shadow handover against belayer-shadow's two restart "
                       "baselines: `restart` (the same supervisor's instant waitpid detection, engine restart "
                       "from scratch, token-level resume through the router: the strongest restart) and "
                       "`conventional` (remote health checks, engine restart, regeneration from scratch)."],
    "env-failures": ["Sandboxes killed with probability p per environment step (seeded); rollout time of "
                     "the batch against the failure-free batch of the same seed under `never`. At `separate_p` more seeds run "
                     "`never` and `adaptive` until the 95% confidence intervals of their increase separate or a cap "
                     "(seeds or seconds) is reached; the rows above hold the configured seeds only."],
    "checkpoint-cost": ["Every full checkpoint of the environment-failure runs (CRIU + filesystem), and what "
                        "it added to its trajectory's critical path: how long the next action waited for it "
                        "after the overlapping LLM response was done, from the agent loop's timestamps; the "
                        "rest was hidden by the response. Then, in the same run and per seed, a failure-free "
                        "batch under `always` with checkpoints overlapped (Belayer) and with every checkpoint "
                        "blocking the next response (baseline)."],
    "build-recovery": ["The default workload's build tasks (`mk V`: 1.5 s, a build id that differs on every run; "
                       "then `cat a`; the answer) with a scripted perfect agent, sandboxes killed with probability "
                       "p per action, the same seeded batch three ways: `adaptive` (Belayer: the adaptive policy "
                       "checkpoints on its own, a failure restores the latest checkpoint with its LLM context), "
                       "`never` (restart from scratch: image and prompt) and `replay` (a harness without Belayer: "
                       "a fresh sandbox, every committed action run again verbatim, the context kept). A recovery "
                       "is inconsistent when the sandbox after it is not what the agent's context says (for a "
                       "replay: a replayed action returned something else than the agent saw)."],
}  # fmt: skip


QUICK_KILL_P = (0.2, 0.3)


def quick_config(bench: BenchConfig) -> BenchConfig:
    """A few minutes' version: fewer repeats, steps, samples and rounds.

    Its environment-failure batches are small (3 tasks x 2 samples, 3 actions each: about 18
    environment steps), so at p = 0.01 or 0.05 a batch would mostly see no kill at all; quick mode
    kills with `QUICK_KILL_P` instead, and the report says so.
    """
    return attrs.evolve(
        bench,
        quick=True,
        swe=attrs.evolve(bench.swe, samples_per_task=2, rounds=4),
        overhead=attrs.evolve(bench.overhead, repeats=2, math_steps=8, math_discard_steps=2, swe_steps=1),
        worker_failure=attrs.evolve(bench.worker_failure, repeats=1, batch_size=4),
        env_failures=attrs.evolve(
            bench.env_failures,
            seeds=bench.env_failures.seeds[:1],
            probabilities=QUICK_KILL_P,
            max_repeats=min(bench.env_failures.max_repeats, 4),
            max_repeat_s=min(bench.env_failures.max_repeat_s, 180.0),
        ),
        build_recovery=attrs.evolve(bench.build_recovery, seeds=bench.build_recovery.seeds[:1]),
    )


def _say(stream: TextIO, text: str) -> None:
    print(f"belayer-grpo bench: {text}", file=stream, flush=True)


async def run_bench(
    bench: BenchConfig, experiments: Sequence[str], out_dir: Path, *, command: str, stream: TextIO
) -> Path:
    """Run ``experiments`` (names of `EXPERIMENTS`) and write the report under ``out_dir``."""
    unknown = [name for name in experiments if name not in EXPERIMENTS]
    if unknown:
        raise GrpoConfigError(
            "--experiment", f"unknown experiment {unknown[0]!r} (choose from {', '.join(EXPERIMENTS)})"
        )
    started = time.monotonic()
    results: dict[str, Any] = {"experiments": {}, "descriptions": _DESCRIPTIONS, "config": bench.to_dict()}
    notes: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="belayer-bench-"))
    try:
        if "overhead" in experiments:
            overhead = []
            if "math" in bench.overhead.workloads:
                _say(stream, "failure-free overhead, math workload (GRPO training runs)")
                overhead += await run_math_overhead(bench, work)
            if "swe" in bench.overhead.workloads:
                _say(stream, "failure-free overhead, agentic workload (rollout batches)")
                overhead.append(await run_swe_overhead(bench, work))
            results["experiments"]["overhead"] = overhead
        if "worker-failure" in experiments:
            _say(stream, "rollout-worker failure: shadow handover vs the restart and conventional baselines")
            results["experiments"]["worker-failure"] = await run_worker_failure(bench, work)
        if "env-failures" in experiments or "checkpoint-cost" in experiments:
            _say(stream, "environment failures under never / always / every-k / adaptive")
            env = await run_env_failures(bench, work, blocking_variant="checkpoint-cost" in experiments)
            if "env-failures" in experiments:
                results["experiments"]["env-failures"] = env
            if "checkpoint-cost" in experiments:
                results["experiments"]["checkpoint-cost"] = checkpoint_costs(env["runs"], env["variants"])
            for run in [*env["runs"], *env["variants"]]:
                run.pop("checkpoints", None)  # kept once, in checkpoint-cost
        if "build-recovery" in experiments:
            _say(stream, "build tasks under sandbox kills: adaptive vs never vs verbatim replay")
            results["experiments"]["build-recovery"] = await run_build_recovery(bench, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    uses_swe = "overhead" in experiments and "swe" in bench.overhead.workloads
    if uses_swe or {"env-failures", "checkpoint-cost"} & set(experiments):
        notes.append("Agentic runs: real router, agent loop, Docker+CRIU sandboxes and belayer-policy; the LLM "
                     "is a scripted agent (the CPU policy cannot write shell commands) streaming one byte "
                     f"token every {bench.swe.token_delay_s} s.")  # fmt: skip
    if bench.quick:
        notes.append(f"Quick mode (`--quick`): {bench.overhead.repeats} repeats per arm of the overhead experiment (one run per arm elsewhere), {bench.overhead.math_steps} "
                     f"math steps per run ({bench.overhead.math_discard_steps} dropped), agentic batches of "
                     f"{bench.swe.samples_per_task} samples x {bench.swe.rounds} rounds per task, one seed; sandbox "
                     f"kill probabilities {', '.join(str(p) for p in bench.env_failures.probabilities)} per step "
                     "instead of 0.01 and 0.05, which such small batches would mostly not see fail.")  # fmt: skip
    results["meta"] = {
        "command": command, "scale": bench.scale, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        "wall_s": time.monotonic() - started, "notes": notes,
    }  # fmt: skip
    return write_report(results, out_dir)
