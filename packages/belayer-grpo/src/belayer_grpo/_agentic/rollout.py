"""`run_agentic_rollouts`: the trainer's entry point for the agentic (SWE) workload."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

import anyio
import attrs

from belayer_envckpt import CheckpointStore, Engine, FaultInjector
from belayer_grpo._agentic.context import AgentTask
from belayer_grpo._agentic.environment import SandboxChaos
from belayer_grpo._agentic.image import build_task_image
from belayer_grpo._agentic.loop import AgentLoop, derive_seed
from belayer_grpo._agentic.pool import SandboxPool
from belayer_grpo._agentic.records import AgenticTrajectory
from belayer_grpo._agentic.settings import AgenticConfig
from belayer_grpo._agentic.swegym import SweTask
from belayer_grpo._errors import RolloutError
from belayer_grpo._guardian import RUN_LABEL
from belayer_policy import FixedStepProbability, OnlineHazard, PolicySpec, SharedEstimators
from belayer_router import ByteTokenizer, RouterClient, Tokenizer

__all__ = ["default_estimators", "run_agentic_rollouts"]


def default_estimators(config: AgenticConfig) -> SharedEstimators:
    """Estimators for one batch: a fixed per-step failure probability if known, else learned."""
    p = config.failure_probability
    return SharedEstimators(failure_model=OnlineHazard() if p is None else FixedStepProbability(p))


async def run_agentic_rollouts(
    tasks: Sequence[AgentTask],
    router: RouterClient,
    config: AgenticConfig,
    *,
    num_samples: int = 1,
    tokenizer: Tokenizer | None = None,
    engine: Engine | None = None,
    pool: SandboxPool | None = None,
    estimators: SharedEstimators | None = None,
    run_id: str | None = None,
    on_trajectory: Callable[[AgenticTrajectory], None] | None = None,
) -> list[AgenticTrajectory]:
    """Roll out ``num_samples`` trajectories per task (a GRPO group each), concurrently.

    Returns them in order: task 0's samples, then task 1's, ...  (``group_index`` is the task's
    position, ``sample_index`` the sample's).  Sandbox failures are recovered inside each
    trajectory; a trajectory that cannot finish raises `RolloutError` after the others finished.
    ``engine`` and ``pool`` are created (and cleaned up) here when not given; ``tokenizer``
    defaults to bytes.  ``on_trajectory`` is called as each trajectory finishes (progress bars).
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not tasks:
        return []
    own_engine = engine is None
    if engine is None:
        engine = await anyio.to_thread.run_sync(Engine.connect)
    try:
        await anyio.to_thread.run_sync(engine.require_checkpoint_support)
        own_pool = pool is None
        if pool is None:
            store = CheckpointStore(config.checkpoint_root)
            labels = {RUN_LABEL: config.run_label} if config.run_label else {}
            pool = SandboxPool(
                engine, store, capacity=config.max_concurrency, labels=labels,
                keep_checkpoints=config.keep_checkpoints,
            )  # fmt: skip
        try:
            return await _roll_out(
                tasks, router, config, num_samples, tokenizer or ByteTokenizer(), pool,
                estimators or default_estimators(config), run_id or uuid.uuid4().hex[:8], on_trajectory,
            )  # fmt: skip
        finally:
            if own_pool:
                await pool.aclose()
    finally:
        if own_engine:
            engine.close()


@attrs.frozen
class _Job:
    task: AgentTask
    image: str
    group_index: int
    sample_index: int
    trajectory_id: str


async def _roll_out(
    tasks: Sequence[AgentTask],
    router: RouterClient,
    config: AgenticConfig,
    num_samples: int,
    tokenizer: Tokenizer,
    pool: SandboxPool,
    estimators: SharedEstimators,
    run_id: str,
    on_trajectory: Callable[[AgenticTrajectory], None] | None,
) -> list[AgenticTrajectory]:
    built = config.image
    if built is None and any(t.image is None for t in tasks):
        built = await anyio.to_thread.run_sync(
            lambda: build_task_image(
                pool.engine, [t for t in tasks if isinstance(t, SweTask)], base_image=config.base_image
            )
        )
    jobs = [
        _Job(task, task.image or built or "", g, s, f"{run_id}-g{g}-s{s}")
        for g, task in enumerate(tasks)
        for s in range(num_samples)
    ]
    spec = PolicySpec.parse(
        config.checkpoint_policy,
        extra_cost_s=config.policy_extra_cost_s,
        cooldown_s=config.policy_cooldown_s,
    )
    results: list[AgenticTrajectory | None] = [None] * len(jobs)
    errors: list[BaseException] = []

    async def one(index: int, job: _Job) -> None:
        injector = None
        if config.sandbox_kill_probability > 0:
            # Keyed by the sample's place, not its id, so a batch sees the same faults in every run.
            seed = derive_seed(config.seed, f"chaos-g{job.group_index}-s{job.sample_index}", -1)
            injector = FaultInjector(config.sandbox_kill_probability, seed=seed)
        chaos = SandboxChaos(config.sandbox_kill_at_actions, injector)
        try:
            async with pool.lease(job.trajectory_id, job.image, job.task.workdir) as lease:
                loop = AgentLoop(
                    job.task, job.trajectory_id, config, router, tokenizer, lease,
                    spec.build(estimators), chaos, job.group_index, job.sample_index,
                )  # fmt: skip
                results[index] = await loop.run()
        except Exception as error:  # every other trajectory still finishes
            while isinstance(error, ExceptionGroup) and len(error.exceptions) == 1:
                error = error.exceptions[0]  # the loop's task groups wrap what they raise
            errors.append(error)
            return
        if on_trajectory is not None:
            on_trajectory(results[index])  # type: ignore[arg-type]

    async with anyio.create_task_group() as group:
        for index, job in enumerate(jobs):
            group.start_soon(one, index, job)
    if errors:
        raise RolloutError(
            f"{len(errors)} of {len(jobs)} agentic trajectories failed; first: {errors[0]}"
        ) from errors[0]
    return [r for r in results if r is not None]
