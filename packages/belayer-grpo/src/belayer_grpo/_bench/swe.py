"""Agentic rollout batches for the benchmark: real router, agent loop, Docker+CRIU sandboxes.

`SweHarness` holds what the batches share (the Docker engine, the task image, the router with the
`ScriptedAgentWorker` registered); `SweHarness.batch` rolls out one GRPO batch under a checkpoint
policy and a sandbox kill probability and returns its timings, failures and checkpoints.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import attrs

from belayer_envckpt import Engine
from belayer_grpo._agentic import (
    AgenticConfig,
    AgenticTrajectory,
    SweTask,
    build_task_image,
    builtin_tasks,
    run_agentic_rollouts,
)
from belayer_grpo._agentic import summarize as summarize_trajectories
from belayer_grpo._bench.agent_worker import STOP_TOKEN, ScriptedAgentWorker, running_agent_worker
from belayer_grpo._bench.settings import BenchConfig
from belayer_router import RouterClient, RouterConfig, running_router

__all__ = ["SweHarness", "policy_name"]

_ADMIN = "belayer-bench"


def policy_name(policy: str, every_k: int) -> str:
    """The belayer-policy name of a benchmark policy (``every`` -> ``every:K``)."""
    return f"every:{every_k}" if policy == "every" else policy


@attrs.define
class SweHarness:
    """The shared parts of the agentic batches of one experiment."""

    bench: BenchConfig
    work_dir: Path
    engine: Engine
    image: str
    tasks: list[SweTask]
    router: RouterClient
    worker: ScriptedAgentWorker
    num_batches: int = 0

    @classmethod
    @asynccontextmanager
    async def start(cls, bench: BenchConfig, work_dir: Path) -> AsyncIterator[SweHarness]:
        """Connect to Docker (CRIU required), build the task image, start router and agent."""
        swe = bench.swe
        engine = await anyio.to_thread.run_sync(Engine.connect)
        try:
            await anyio.to_thread.run_sync(engine.require_checkpoint_support)
            tasks = builtin_tasks(list(swe.tasks) or None)
            image = await anyio.to_thread.run_sync(lambda: build_task_image(engine, tasks))
            async with (
                running_router(RouterConfig(admin_token=_ADMIN, resume_wait_s=30.0)) as (url, _app),
                running_agent_worker(swe.rounds, swe.action_s, swe.token_delay_s, swe.response_padding) as (
                    worker_url,
                    worker,
                ),
                RouterClient(url, admin_token=_ADMIN, timeout_s=600.0) as router,
            ):
                await router.register("s0", worker_url, 1)
                yield cls(bench, work_dir, engine, image, tasks, router, worker)
        finally:
            engine.close()

    async def batch(self, policy: str, kill_p: float, seed: int, *, blocking: bool = False) -> dict[str, Any]:
        """One rollout batch; ``rollout_s`` is its wall time, the rest its failures and checkpoints.

        ``blocking``: every checkpoint finishes before the next response starts (the baseline of
        the checkpoint-cost experiment) instead of overlapping it.
        """
        swe = self.bench.swe
        self.num_batches += 1
        config = AgenticConfig(
            checkpoint_root=self.work_dir / f"checkpoints-{self.num_batches}",
            image=self.image,
            max_rounds=swe.rounds + 2,
            max_response_tokens=4096,
            max_context_tokens=65536,
            stop_token_ids=(STOP_TOKEN,),
            seed=seed,
            checkpoint_policy=policy_name(policy, swe.every_k),
            sandbox_kill_probability=kill_p,
            max_concurrency=swe.max_concurrency,
            checkpoint_blocking=blocking,
        )
        started = time.monotonic()
        trajectories = await run_agentic_rollouts(
            self.tasks, self.router, config, num_samples=swe.samples_per_task, engine=self.engine,
            run_id=f"bench{self.num_batches}-{seed}",
        )  # fmt: skip
        rollout_s = time.monotonic() - started
        totals = summarize_trajectories(trajectories)
        return {
            "policy": policy,
            "blocking": blocking,
            "kill_p": kill_p,
            "seed": seed,
            "rollout_s": rollout_s,
            "reward_mean": totals["reward_mean"],
            "num_failures": totals["num_failures"],
            "num_recoveries_from_checkpoint": totals["num_recoveries_from_checkpoint"],
            "num_checkpoints": totals["num_checkpoints"],
            "tokens_regenerated": totals["tokens_regenerated"],
            "all_prefix_consistent": totals["all_prefix_consistent"],
            "restore_s": [r.restore_s for t in trajectories for r in t.recoveries],
            "checkpoints": self._checkpoints(trajectories),
            "trace": [_trace_line(t) for t in trajectories if t.step_response_s],
        }

    def _checkpoints(self, trajectories: list[AgenticTrajectory]) -> list[dict[str, Any]]:
        """Each checkpoint's cost, what it added to the critical path (``waited_s``: how long the next
        action waited for it, from the agent loop's timestamps) and so what the response hid."""
        markers = {t.instance_id: _marker(t) for t in self.tasks}
        out = []
        for trajectory in trajectories:
            for record in trajectory.checkpoints:
                durations = self.worker.response_s.get(f"{markers[trajectory.task_id]}/{record.turn}", [])
                response_s = statistics.median(durations) if durations else 0.0
                exposed = min(record.waited_s, record.duration_s)
                out.append({"seconds": record.duration_s, "turn": record.turn, "response_s": response_s,
                            "waited_s": record.waited_s, "hidden_s": record.duration_s - exposed,
                            "exposed_s": exposed,
                            "bytes": record.checkpoint.total_bytes if record.checkpoint else 0})  # fmt: skip
        return out


def _trace_line(trajectory: AgenticTrajectory) -> dict[str, Any]:
    """The trajectory in belayer-policy's trace format, with what the simulator models kept apart in
    ``meta``: the measured wall time, each checkpoint's time on the critical path (how long the next
    action waited for it, by prefix) and each recovery (failed and restored step, restore time)."""
    return trajectory.trace_line(meta={
        "wall_s": trajectory.wall_s,
        "checkpoint_waited_s": {str(c.prefix): c.waited_s for c in trajectory.checkpoints if c.prefix > 0},
        "recoveries": [{"failed_step": r.failed_prefix, "restored_step": r.restored_prefix,
                        "restore_s": r.restore_s, "rounds_regenerated": r.rounds_regenerated}
                       for r in trajectory.recoveries],
    })  # fmt: skip


def _marker(task: SweTask) -> str:
    for marker in ("calc.py", "words.py", "countdown.py"):
        if marker in task.problem_statement:
            return marker
    return "unknown"
