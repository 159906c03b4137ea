"""`build-recovery`: the default workload's build tasks under sandbox kills, three recoveries.

The same seeded batch (``tasks`` build tasks x ``samples_per_task``, a scripted perfect agent,
every sandbox killed with ``kill_p`` per action) rolled out three ways:

- ``adaptive``: Belayer, the adaptive policy checkpoints on its own (the cheapest kind) and a
  failure restores the latest ready checkpoint with its LLM context, else starts from scratch;
- ``never``: restart from scratch (the image and the prompt; every response and action again);
- ``replay``: what a harness without Belayer does: a fresh sandbox in which every committed action
  is run again verbatim, the agent keeping its context.  A build id differs on re-execution, so a
  replay after the agent saw one leaves the sandbox unlike what the agent saw: an inconsistent
  recovery, and a right agent's reward 0.

Per batch: rollout wall time, failures, how each was recovered, how many recoveries were left
inconsistent (the restored state, or the replayed outputs, not what the agent's context holds) and
the mean reward of the perfect agent (1.0 unless a recovery broke it).  Arms are interleaved, their
order rotating with the seed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio

from belayer_envckpt import Engine
from belayer_grpo._agentic import AgenticConfig, RolloutStats, generate_tooluse_tasks, run_agentic_rollouts
from belayer_grpo._agentic.records import count_kinds
from belayer_grpo._agentic.tooluse import BUILD_IMAGE, ensure_build_image
from belayer_grpo._bench.agent_worker import STOP_TOKEN, running_agent_worker
from belayer_grpo._bench.settings import BenchConfig
from belayer_router import RouterClient, RouterConfig, running_router

__all__ = ["ARMS", "run_build_recovery"]

_ADMIN = "belayer-bench"
# arm -> (checkpoint policy, sandbox recovery)
ARMS: dict[str, tuple[str, str]] = {
    "adaptive": ("adaptive", "checkpoint"),
    "never": ("never", "checkpoint"),
    "replay": ("never", "replay"),
}


async def run_build_recovery(bench: BenchConfig, work_dir: Path) -> dict[str, Any]:
    """Every arm on every seed; the runs and a summary per arm."""
    cfg = bench.build_recovery
    engine = await anyio.to_thread.run_sync(Engine.connect)
    try:
        await anyio.to_thread.run_sync(engine.require_checkpoint_support)
        await anyio.to_thread.run_sync(ensure_build_image, engine)
        tasks = generate_tooluse_tasks(0, held_out=cfg.tasks, kind="build")[1]
        runs: list[dict[str, Any]] = []
        async with (
            running_router(RouterConfig(admin_token=_ADMIN, resume_wait_s=30.0)) as (url, _app),
            running_agent_worker(3, 0.0, cfg.token_delay_s, 0) as (worker_url, _worker),
            RouterClient(url, admin_token=_ADMIN, timeout_s=600.0) as router,
        ):
            await router.register("s0", worker_url, 1)
            names = list(ARMS)
            for index, seed in enumerate(cfg.seeds):
                order = names[index % len(names) :] + names[: index % len(names)]
                for arm in order:
                    runs.append(await _batch(bench, work_dir, engine, router, tasks, arm, seed, len(runs)))
    finally:
        engine.close()
    return {"runs": runs, "arms": {arm: _summary([r for r in runs if r["arm"] == arm]) for arm in ARMS}}


async def _batch(
    bench: BenchConfig, work_dir: Path, engine: Engine, router: RouterClient, tasks: list[Any], arm: str,
    seed: int, number: int,
) -> dict[str, Any]:  # fmt: skip
    cfg = bench.build_recovery
    policy, recovery = ARMS[arm]
    config = AgenticConfig(
        checkpoint_root=work_dir / f"build-checkpoints-{number}", image=BUILD_IMAGE, max_rounds=4,
        max_response_tokens=64, max_context_tokens=2048, stop_token_ids=(STOP_TOKEN,), seed=seed,
        checkpoint_policy=policy, sandbox_kill_probability=cfg.kill_p, sandbox_recovery=recovery,
        max_concurrency=cfg.max_concurrency, on_unrecoverable="drop",
    )  # fmt: skip
    stats = RolloutStats()
    started = time.monotonic()
    trajectories = await run_agentic_rollouts(
        tasks, router, config, num_samples=cfg.samples_per_task, engine=engine,
        run_id=f"build-{arm}-{seed}-{number}", stats=stats,
    )  # fmt: skip
    rollout_s = time.monotonic() - started
    recoveries = [r for t in trajectories for r in t.recoveries]
    kinds = count_kinds(trajectories)
    return {
        "arm": arm, "policy": policy, "recovery": recovery, "seed": seed, "rollout_s": rollout_s,
        "trajectories": len(trajectories), "dropped_groups": stats.num_dropped_groups,
        "failures": len(recoveries),
        "from_checkpoint": sum(r.from_checkpoint for r in recoveries),
        "from_scratch": sum(not r.from_checkpoint and not r.replayed for r in recoveries),
        "replayed": sum(r.replayed for r in recoveries),
        "inconsistent": sum(not r.prefix_consistent for r in recoveries),
        "reward_mean": sum(t.reward for t in trajectories) / len(trajectories) if trajectories else 0.0,
        "tokens_regenerated": sum(r.tokens_regenerated for r in recoveries),
        "checkpoints": {k: int(v["count"]) for k, v in kinds.items()},
        "checkpoint_s": sum(v["s"] for v in kinds.values()),
        "checkpoint_waited_s": sum(v["waited_s"] for v in kinds.values()),
    }  # fmt: skip


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(runs)
    total = {key: sum(r[key] for r in runs) for key in
             ("failures", "from_checkpoint", "from_scratch", "replayed", "inconsistent", "tokens_regenerated",
              "trajectories", "dropped_groups", "checkpoint_s", "checkpoint_waited_s")}  # fmt: skip
    checkpoints: dict[str, int] = {}
    for r in runs:
        for kind, count in r["checkpoints"].items():
            checkpoints[kind] = checkpoints.get(kind, 0) + count
    return {
        "batches": n,
        "rollout_s_mean": sum(r["rollout_s"] for r in runs) / n if n else 0.0,
        "rollout_s": [r["rollout_s"] for r in runs],
        "reward_mean": sum(r["reward_mean"] for r in runs) / n if n else 0.0,
        "checkpoints": checkpoints,
        **total,
    }
