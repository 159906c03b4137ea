"""Rollout-worker failure: one SIGKILLed main worker per rollout, shadow handover vs two baselines.

The baselines are belayer-shadow's: ``restart`` (the supervisor's instant ``waitpid`` detection,
engine restart from scratch, token-level resume through the router: the strongest restart
baseline) and ``conventional`` (remote health checks, restart, regeneration from scratch).
For each recovery mode a router and one engine slot serve the (untrained, seeded) policy.  Each
repeat rolls the same batch out twice with the same seeds: failure-free, then with the main worker
killed ``kill_at_fraction`` of the
failure-free rollout time after the start.  Requests are seeded per sample, so
the two runs generate the same tokens and the differences are the failure's cost:

- step: rollout wall time with the failure minus without (the GRPO update and the weight sync
  that follow are the same in both);
- affected trajectory: the mean extra latency of the samples the router resumed;
- breakdown from the slot's event log: detection (kill -> ``handover.detect``,
  ``restart.detect`` or ``conventional.detect``), handover / engine reconstruction
  (-> ``handover.complete`` or the ``<mode>.restart`` step), and the rest of the affected
  trajectory's extra time (resume by KV refill, resume on the restarted engine, or regeneration).
"""

from __future__ import annotations

import math
import secrets
import time
from pathlib import Path
from typing import Any

import anyio

from belayer_grpo._bench.settings import BenchConfig
from belayer_grpo._bench.stats import summarize
from belayer_grpo._config import RolloutConfig, load_config
from belayer_grpo._data import generate_arithmetic
from belayer_grpo._model import build_policy, build_tokenizer, engine_model_config
from belayer_grpo._rollout_math import Sample, run_math_rollouts
from belayer_router import RouterClient, RouterConfig, running_router

__all__ = ["run_worker_failure"]

MODES = ("shadow", "restart", "conventional")


def _save_weights(model: Any, model_config: Any, path: Path) -> None:
    from safetensors.torch import save_file

    from belayer_shadow import weight_layout

    state = model.state_dict()
    names = [spec.name for spec in weight_layout(model_config).tensors]
    save_file({name: state[name].detach().contiguous() for name in names}, str(path))


async def run_worker_failure(bench: BenchConfig, work_dir: Path) -> dict[str, Any]:
    """Both recovery modes, ``repeats`` failure-free/failure pairs each; returns the raw results."""
    import json

    import torch

    torch.set_num_threads(1)
    train = load_config(bench.math_config or None, ["data.workload=math"])
    tokenizer = build_tokenizer(train.model)
    model_config = engine_model_config(train.model, tokenizer)
    model = build_policy(model_config, seed=train.model.seed, path=train.model.path)
    weights = work_dir / "policy.safetensors"
    _save_weights(model, model_config, weights)
    (work_dir / "model.json").write_text(json.dumps(model_config.to_dict()))
    problems = generate_arithmetic(("+",), 0, 9, seed=0)
    out: dict[str, Any] = {"modes": {}}
    for mode in MODES:
        out["modes"][mode] = await _run_mode(bench, work_dir / mode, mode, tokenizer, problems, weights)
    return out


async def _run_mode(
    bench: BenchConfig, run_dir: Path, mode: str, tokenizer: Any, problems: list[Any], weights: Path
) -> dict[str, Any]:
    from belayer_shadow import SlotConfig, SlotSupervisor

    wf = bench.worker_failure
    total = wf.batch_size * wf.samples_per_prompt
    rollout = RolloutConfig(batch_size=wf.batch_size, samples_per_prompt=wf.samples_per_prompt,
                            max_tokens=wf.max_tokens, concurrency=total)  # fmt: skip
    token = secrets.token_hex(8)
    repeats: list[dict[str, Any]] = []
    async with running_router(RouterConfig(admin_token=token, resume_wait_s=120.0)) as (url, _app):
        blocks = max(256, total * math.ceil((32 + wf.max_tokens) / 16) + 16)
        slot = SlotSupervisor(
            SlotConfig(slot="bench0", router_url=url, run_dir=run_dir, admin_token=token,
                       model=run_dir.parent / "model.json", weights=weights, backend=wf.backend,
                       recovery=mode,  # type: ignore[arg-type]
                       num_kv_blocks=blocks, max_num_seqs=min(total, 256),
                       failure_window_s=0.0, health_interval_s=wf.health_interval_s,
                       health_misses=wf.health_misses)
        )  # fmt: skip
        try:
            await anyio.to_thread.run_sync(slot.start)
            async with RouterClient(url, token, timeout_s=600.0) as router:
                # One unmeasured batch first: the first requests of a fresh worker pay one-off costs.
                await _rollout(router, tokenizer, rollout, problems[-wf.batch_size :], 999, None)
                for repeat in range(wf.repeats):
                    await anyio.to_thread.run_sync(slot.wait_protected, 120.0)
                    batch = problems[repeat * wf.batch_size : (repeat + 1) * wf.batch_size]
                    free = await _rollout(router, tokenizer, rollout, batch, repeat, None)
                    await anyio.to_thread.run_sync(slot.wait_protected, 120.0)
                    delay = free["rollout_s"] * wf.kill_at_fraction
                    before = slot.num_handovers
                    failed = await _rollout(router, tokenizer, rollout, batch, repeat, slot.kill_main, delay)
                    with anyio.fail_after(300):  # the recovery is logged (conventional: after detection)
                        while slot.num_handovers == before:  # noqa: ASYNC110  (a thread counts it)
                            await anyio.sleep(0.05)
                    repeats.append(_compare(free, failed, slot.events(), mode))
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(slot.stop)
    return {"repeats": repeats, **_aggregate(repeats)}


async def _rollout(
    router: RouterClient, tokenizer: Any, rollout: RolloutConfig, batch: list[Any], seed: int,
    kill: Any, kill_after_s: float = 0.0,
) -> dict[str, Any]:  # fmt: skip
    done_at: dict[int, float] = {}  # id(sample) -> seconds after the start
    killed_at: list[float] = []
    started = time.monotonic()
    async with anyio.create_task_group() as group:
        if kill is not None:
            group.start_soon(_kill, kill, kill_after_s, killed_at)

        def on_sample(_index: int, sample: Sample) -> None:
            done_at[id(sample)] = time.monotonic() - started

        samples = await run_math_rollouts(batch, router, tokenizer, rollout, seed=seed, on_sample=on_sample)
    return {
        "rollout_s": time.monotonic() - started,
        "latency": [done_at[id(sample)] for sample in samples],  # index order
        "resumed": [sample.num_resumes > 0 for sample in samples],
        "tokens": [sample.completion_ids for sample in samples],
        "killed_at": killed_at[0] if killed_at else None,
    }


async def _kill(kill: Any, delay_s: float, killed_at: list[float]) -> None:
    await anyio.sleep(delay_s)
    killed_at.append(await anyio.to_thread.run_sync(kill))


def _event_time(events: list[dict[str, Any]], name: str, after: float) -> dict[str, Any] | None:
    return next((e for e in events if e.get("event") == name and float(e["time"]) >= after), None)


def _compare(
    free: dict[str, Any], failed: dict[str, Any], events: list[dict[str, Any]], mode: str
) -> dict[str, Any]:
    """The failure's cost in one repeat, with its breakdown from the slot's events."""
    killed_at = failed["killed_at"]
    affected = [i for i, resumed in enumerate(failed["resumed"]) if resumed]
    added = [failed["latency"][i] - free["latency"][i] for i in affected]
    trajectory_added = sum(added) / len(added) if added else 0.0
    detection = recovery = None
    if killed_at is not None:
        cause = "handover" if mode == "shadow" else mode
        detect = _event_time(events, f"{cause}.detect", killed_at)
        complete = _event_time(events, "handover.complete", killed_at) if mode == "shadow" else None
        restart = None if mode == "shadow" else _event_time(events, f"{mode}.restart", killed_at)
        if detect is not None:
            detection = float(detect["time"]) - killed_at
            if complete is not None:
                recovery = float(complete["time"]) - float(detect["time"])
            elif restart is not None:
                recovery = float(restart.get("duration_s", float(restart["time"]) - float(detect["time"])))
    rest = (
        None if detection is None or recovery is None else max(0.0, trajectory_added - detection - recovery)
    )
    return {
        "rollout_free_s": free["rollout_s"],
        "rollout_failed_s": failed["rollout_s"],
        "step_added_s": failed["rollout_s"] - free["rollout_s"],
        "trajectory_added_s": trajectory_added,
        "trajectory_free_s": sum(free["latency"][i] for i in affected) / len(affected) if affected else 0.0,
        "num_affected": len(affected),
        "num_samples": len(failed["resumed"]),
        "detection_s": detection,
        "recovery_s": recovery,
        "resume_or_regeneration_s": rest,
        "outputs_equal": free["tokens"] == failed["tokens"],
        "recovered": recovery is not None,
    }


def _aggregate(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("step_added_s", "trajectory_added_s", "detection_s", "recovery_s", "resume_or_regeneration_s",
            "rollout_free_s", "num_affected")  # fmt: skip
    return {key: summarize([float(r[key]) for r in repeats if r[key] is not None]) for key in keys}
