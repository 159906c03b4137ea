"""`run_agentic_rollouts`: the trainer's entry point for the agentic (SWE) workload."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs

from belayer_envckpt import BelayerEnvckptError, CheckpointStore, Engine, FaultInjector
from belayer_grpo._agentic.context import AgentTask
from belayer_grpo._agentic.environment import SandboxChaos
from belayer_grpo._agentic.image import build_task_image
from belayer_grpo._agentic.journal import TrajectoryJournal
from belayer_grpo._agentic.loop import AgentLoop, derive_seed
from belayer_grpo._agentic.pool import SandboxPool
from belayer_grpo._agentic.records import AgenticTrajectory
from belayer_grpo._agentic.settings import AgenticConfig
from belayer_grpo._agentic.swegym import SweTask
from belayer_grpo._errors import (
    RolloutError,
    SandboxCommandError,
    TrajectoryFailedError,
    describe_error,
)
from belayer_grpo._guardian import RUN_LABEL
from belayer_policy import FixedStepProbability, OnlineHazard, PolicySpec, SharedEstimators
from belayer_router import ByteTokenizer, RouterClient, Tokenizer

__all__ = ["RolloutStats", "default_estimators", "run_agentic_rollouts"]

# What ends one trajectory without saying anything about the rest of the system: its sandbox or
# its checkpoints are beyond recovery.  Anything else (the router gone, a bug) ends the rollout.
_TRAJECTORY_ERRORS = (TrajectoryFailedError, BelayerEnvckptError, SandboxCommandError)


@attrs.define
class RolloutStats:
    """What a rollout did besides its trajectories: trajectories that could not be recovered and
    what became of their groups (``rollout.on_unrecoverable``)."""

    num_unrecoverable: int = 0  # trajectories that could not be recovered
    num_resampled_groups: int = 0  # groups sampled again at least once
    num_resamples: int = 0  # group samplings beyond the first
    num_dropped_groups: int = 0  # groups left out of the batch
    num_reused: int = 0  # trajectories taken from ``done`` (a resumed step's log), not generated
    # Trajectories continued from a killed trainer's journal (``resume``), and what that redid:
    num_reattached: int = 0  # continued at their last logged turn, not run again from the start
    num_actions_replayed: int = 0  # logged actions run again to rebuild their sandboxes
    num_restored_from_checkpoint: int = 0  # sandboxes rebuilt from a logged checkpoint
    num_reattach_regenerated: int = 0  # of them, trajectories with a turn generated anew
    # of them, a replayed action returned something else (rewound to a checkpoint, then went on)
    num_reattach_inconsistent: int = 0
    num_rebuild_failures: int = 0  # sandbox failures while rebuilding them (recovered, not regenerated)
    errors: list[str] = attrs.field(factory=list)  # `describe_error` of each unrecoverable trajectory

    def add(self, other: RolloutStats) -> None:
        """Add ``other``'s counts to these."""
        self.num_unrecoverable += other.num_unrecoverable
        self.num_resampled_groups += other.num_resampled_groups
        self.num_resamples += other.num_resamples
        self.num_dropped_groups += other.num_dropped_groups
        self.num_reused += other.num_reused
        self.num_reattached += other.num_reattached
        self.num_actions_replayed += other.num_actions_replayed
        self.num_restored_from_checkpoint += other.num_restored_from_checkpoint
        self.num_reattach_regenerated += other.num_reattach_regenerated
        self.num_reattach_inconsistent += other.num_reattach_inconsistent
        self.num_rebuild_failures += other.num_rebuild_failures
        self.errors += other.errors

    def to_dict(self) -> dict[str, int]:
        """The counts (the error texts aside)."""
        return {
            "unrecoverable_trajectories": self.num_unrecoverable,
            "resampled_groups": self.num_resampled_groups,
            "group_resamples": self.num_resamples,
            "dropped_groups": self.num_dropped_groups,
        }


def default_estimators(config: AgenticConfig, batch_size: int = 1) -> SharedEstimators:
    """Estimators for one batch: a fixed per-step failure probability if known, else learned.
    ``batch_size`` is how many trajectories roll out together, the slowest ending the batch (a
    training step waits for every one): the adaptive policy weighs a failure by it."""
    p = config.failure_probability
    return SharedEstimators(
        failure_model=OnlineHazard() if p is None else FixedStepProbability(p), batch_size=max(1, batch_size)
    )


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
    stats: RolloutStats | None = None,
    done: Mapping[tuple[int, int, int], AgenticTrajectory] | None = None,
    on_finished: Callable[[AgenticTrajectory, int], None] | None = None,
    note: Callable[[dict[str, Any]], None] | None = None,
    resume: Mapping[str, TrajectoryJournal] | None = None,
) -> list[AgenticTrajectory]:
    """Roll out ``num_samples`` trajectories per task (a GRPO group each), concurrently.

    Returns them in order: task 0's samples, then task 1's, ...  (``group_index`` is the task's
    position, ``sample_index`` the sample's).  Sandbox failures are recovered inside each
    trajectory.  A trajectory that cannot be recovered takes its whole group with it, as
    ``config.on_unrecoverable`` says: sampled again (``resample``, up to ``max_resamples`` times)
    or left out (``drop``, and ``resample`` past its limit), so only complete groups are returned;
    ``fail``, or any other error (the router gone), raises `RolloutError` naming the error's type
    and origin after the other trajectories finished.  ``stats``, when given, counts what happened.
    ``engine`` and ``pool`` are created (and cleaned up) here when not given; ``tokenizer``
    defaults to bytes.  ``on_trajectory`` is called for each trajectory that enters the result,
    once its group is complete and kept (progress bars); never for a group that is sampled again
    or dropped, nor for trajectories of a rollout that raises.  ``on_finished(trajectory,
    attempt)`` is called as each generated trajectory finishes, before its group is decided (the
    rollout log); ``done`` maps ``(group_index, sample_index, attempt)`` to a trajectory a killed
    run had finished, taken instead of generating it (counted in ``stats.num_reused``).  ``note``
    takes every trajectory's journal events as they happen, and ``resume`` maps the id of a
    trajectory a killed run had begun to its journal, to continue it where it was
    (`belayer_grpo._agentic.journal`; counted in ``stats.num_reattached`` and after).
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
                keep_checkpoints=config.keep_checkpoints, spares=config.spare_sandboxes,
            )  # fmt: skip
        try:
            return await _roll_out(
                tasks, router, config, num_samples, tokenizer or ByteTokenizer(), pool,
                estimators or default_estimators(config), run_id or uuid.uuid4().hex[:8], on_trajectory,
                RolloutStats() if stats is None else stats, done or {}, on_finished, note, resume or {},
            )  # fmt: skip
        finally:
            if own_pool:
                await pool.aclose()
    finally:
        if own_engine:
            engine.close()


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
    stats: RolloutStats,
    done: Mapping[tuple[int, int, int], AgenticTrajectory],
    on_finished: Callable[[AgenticTrajectory, int], None] | None,
    note: Callable[[dict[str, Any]], None] | None,
    resume: Mapping[str, TrajectoryJournal],
) -> list[AgenticTrajectory]:
    built = config.image
    if built is None and any(t.image is None for t in tasks):
        built = await anyio.to_thread.run_sync(
            lambda: build_task_image(
                pool.engine, [t for t in tasks if isinstance(t, SweTask)], base_image=config.base_image
            )
        )
    spec = PolicySpec.parse(
        config.checkpoint_policy,
        extra_cost_s=config.policy_extra_cost_s,
        cooldown_s=config.policy_cooldown_s,
    )
    fatal: list[tuple[str, BaseException]] = []

    async def sample(task: AgentTask, group_index: int, sample_index: int, attempt: int) -> AgenticTrajectory:
        # Keyed by the sample's place, not its id, so a batch sees the same faults in every run
        # (a group sampled again sees other faults).
        again = f"-r{attempt}" if attempt else ""
        trajectory_id = f"{run_id}-g{group_index}{again}-s{sample_index}"
        if (reused := done.get((group_index, sample_index, attempt))) is not None:
            stats.num_reused += 1
            if not pool.keep_checkpoints:  # what a kill between its log line and its lease's end left
                folder = pool.store.trajectory_dir(trajectory_id)
                await anyio.to_thread.run_sync(lambda: shutil.rmtree(folder, ignore_errors=True))
            return reused
        injector = None
        if config.sandbox_kill_probability > 0:
            seed = derive_seed(config.seed, f"chaos-g{group_index}-s{sample_index}{again}", -1)
            injector = FaultInjector(config.sandbox_kill_probability, seed=seed)
        chaos = SandboxChaos(config.sandbox_kill_at_actions, injector)
        try:
            async with pool.lease(trajectory_id, task.image or built or "", task.workdir) as lease:
                journal = resume.get(trajectory_id)
                loop = AgentLoop(
                    task, trajectory_id, config, router, tokenizer, lease,
                    spec.build(estimators), chaos, group_index, sample_index,
                    note=note, resume=journal,
                )  # fmt: skip
                trajectory = await loop.run()
                if journal is not None:
                    stats.num_reattached += 1
                    stats.num_actions_replayed += loop.num_actions_replayed
                    stats.num_restored_from_checkpoint += loop.restored_from_checkpoint
                    stats.num_reattach_regenerated += loop.num_turns_regenerated > 0
                    stats.num_reattach_inconsistent += not loop.replay_consistent
                    stats.num_rebuild_failures += loop.num_rebuild_failures
                # Logged before the lease ends: leaving it removes the trajectory's checkpoints, and a
                # kill in between left a begun trajectory whose logged checkpoints were gone.
                if on_finished is not None:
                    on_finished(trajectory, attempt)
            return trajectory
        except BaseException:
            # Best effort: what the router still holds of it (its own error is the one to raise).
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await router.drop_trajectory(trajectory_id)
            raise

    async def group(group_index: int, task: AgentTask) -> list[AgenticTrajectory]:
        attempts = 1 + (config.max_resamples if config.on_unrecoverable == "resample" else 0)
        for attempt in range(attempts):
            finished: list[AgenticTrajectory | None] = [None] * num_samples
            lost: list[str] = []

            async def one(sample_index: int) -> None:
                try:
                    trajectory = await sample(task, group_index, sample_index, attempt)  # noqa: B023
                except Exception as error:  # every other trajectory still finishes
                    while isinstance(error, ExceptionGroup) and len(error.exceptions) == 1:
                        error = error.exceptions[0]  # the loop's task groups wrap what they raise
                    where = f"group {group_index} sample {sample_index}"
                    if isinstance(error, _TRAJECTORY_ERRORS) and config.on_unrecoverable != "fail":
                        lost.append(f"{where}: {describe_error(error)}")  # noqa: B023
                    else:
                        fatal.append((where, error))
                    return
                finished[sample_index] = trajectory  # noqa: B023

            async with anyio.create_task_group() as samples:
                for sample_index in range(num_samples):
                    samples.start_soon(one, sample_index)
            if not lost:
                kept = [t for t in finished if t is not None]
                if on_trajectory is not None:  # only trajectories of a group that is kept
                    for trajectory in kept:
                        on_trajectory(trajectory)
                return kept
            stats.num_unrecoverable += len(lost)
            stats.errors += lost
            if fatal:
                break  # the rollout ends anyway: no point sampling again
            if attempt + 1 < attempts:
                stats.num_resamples += 1
                stats.num_resampled_groups += attempt == 0
        stats.num_dropped_groups += 1
        return []

    groups: list[list[AgenticTrajectory]] = [[] for _ in tasks]

    async def keep(group_index: int, task: AgentTask) -> None:
        groups[group_index] = await group(group_index, task)

    async with anyio.create_task_group() as all_groups:
        for group_index, task in enumerate(tasks):
            all_groups.start_soon(keep, group_index, task)
    if fatal:
        where, first = fatal[0]
        raise RolloutError(
            f"{len(fatal)} of {len(tasks) * num_samples} agentic trajectories failed; first ({where}): "
            f"{describe_error(first)}"
        ) from first
    return [trajectory for trajectories in groups for trajectory in trajectories]
