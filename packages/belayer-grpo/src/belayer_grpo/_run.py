"""The training run: prepare the policy, assemble the system, loop over GRPO steps, report.

Each step: rollout through the router (a worker may be killed meanwhile; the shadow takes over
and the router resumes the interrupted requests) -> rewards -> GRPO update (in a thread) ->
weights pushed to every weight server (the barrier before the next rollout) -> summary line.
The rollout is multi-turn agentic trajectories in sandboxes (``data.workload = "tooluse"``, the
default, or ``"swe"``: `belayer_grpo._rollout_agentic`), or one turn per math problem (``"math"``).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TextIO

import anyio
import attrs
import torch

from belayer_grpo._agentic import AgenticTrajectory, default_estimators, to_samples
from belayer_grpo._agentic.journal import TrajectoryJournal
from belayer_grpo._chaos import FailureRecord, WorkerChaos, match_recoveries
from belayer_grpo._checkpointing import find_latest, load_checkpoint, save_checkpoint
from belayer_grpo._cluster import (
    ClusterSystem,
    ClusterWeights,
    HostedCluster,
    HostedWeights,
    cluster_wanted,
    rollout_system,
)
from belayer_grpo._config import Config
from belayer_grpo._data import PolicyTokenizer, Problem, PromptSampler, generate_arithmetic, load_math_file
from belayer_grpo._errors import CheckpointError, GrpoConfigError
from belayer_grpo._guardian import Guardian, reap_run, run_processes_marked
from belayer_grpo._lease import take_lease
from belayer_grpo._model import build_policy, build_tokenizer, engine_model_config, supervised_warmup
from belayer_grpo._plot import write_training_plot
from belayer_grpo._reattach import held_requests, held_turns
from belayer_grpo._reporting import Reporter
from belayer_grpo._rollout_agentic import (
    EnvTotals,
    action_warmup,
    agentic_config,
    close_pool,
    evaluate_held_out,
    held_out_tasks,
    load_tasks,
    open_pool,
    run_swe_rollout,
    run_tag,
    tooluse_warmup,
)
from belayer_grpo._rollout_host import HostSystem, prespawn, stop_prespawned
from belayer_grpo._rollout_log import (
    LoggedStep,
    StepLog,
    kept_trajectories,
    prune_logs,
    read_step_log,
    replay_ended_steps,
    step_log_path,
)
from belayer_grpo._rollout_math import Sample, greedy_accuracy, run_math_rollouts
from belayer_grpo._system import RolloutSystem
from belayer_grpo._trainer import GRPOTrainer, UpdateResult
from belayer_grpo._weight_sync import WeightSync
from belayer_router import RouterClient

__all__ = ["RunState", "load_problems", "resolve_run_dir", "run_training"]


def resolve_run_dir(config: Config) -> Path:
    """``system.run_dir``, or ``runs/<timestamp>`` under the current directory."""
    path = (
        Path(config.system.run_dir)
        if config.system.run_dir
        else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    )
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


def load_problems(config: Config) -> list[Problem]:
    """The math problems of ``data.source`` (the swe workload's tasks: `belayer_grpo._rollout_agentic.load_tasks`)."""
    data = config.data
    if data.workload != "math":
        raise GrpoConfigError(
            "data.workload", "math problems are for workload = 'math'; agentic ones read tasks"
        )
    if data.source in ("builtin", "arithmetic"):
        return generate_arithmetic(data.operations, data.min_operand, data.max_operand, seed=data.seed)
    return load_math_file(data.source)


@attrs.define
class RunState:
    """Everything the loop carries from step to step."""

    config: Config
    run_dir: Path
    tokenizer: PolicyTokenizer
    problems: list[Problem]
    sampler: PromptSampler[Any]
    trainer: GRPOTrainer
    reporter: Reporter
    start_step: int = 0
    warmup_s: float = 0.0
    num_resumed: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    rollout_s: float = 0.0
    reported: set[int] = attrs.field(factory=set)
    env: EnvTotals = attrs.field(factory=EnvTotals)
    estimators: Any = None  # the agentic checkpoint policy's estimators, learning over the whole run
    pool: Any = None  # the agentic workloads' sandbox pool (a SandboxPool), kept over the whole run
    resume_step: int = 0  # the step a resumed run continues from its rollout log (0: none)
    num_replayed: int = 0  # ended steps after the checkpoint trained again from their logs
    num_reused: int = 0  # samples of the resumed step taken from its log
    num_regenerated: int = 0  # samples of the resumed step that the killed run had begun, generated anew
    host_adopted: bool = False  # the rollout host of the killed trainer serves this run
    num_reattached: int = 0  # samples of the resumed step the adopted router held (finished or begun)
    num_reattached_tokens: int = 0  # the tokens it held of them (not generated again)
    num_new: int = 0  # samples of the resumed step the killed run had not sent to the router
    # Agentic trajectories of the resumed step the killed run had begun, continued where they were
    # (`belayer_grpo._agentic.journal`), and what rebuilding their sandboxes redid.
    num_traj_reattached: int = 0
    num_actions_replayed: int = 0
    num_restored_from_checkpoint: int = 0
    num_reattach_inconsistent: int = 0
    num_rebuild_failures: int = 0  # sandbox failures while rebuilding them (recovered)
    checkpoint_step: int = 0
    step_log: StepLog | None = None  # the current step's rollout log, ended after its metrics

    async def sandbox_pool(self) -> Any:
        """The run's sandbox pool, opened at first use."""
        if self.pool is None:
            self.pool = await anyio.to_thread.run_sync(open_pool, self.config, self.run_dir)
        return self.pool


def _prepare(config: Config, run_dir: Path, stream: TextIO) -> tuple[RunState, Any]:
    # The workers and memory servers share the machine's cores with us: one intra-op thread each
    # avoids oversubscription, which on a 2-core machine costs far more than it gains.
    torch.set_num_threads(1)
    torch.manual_seed(config.model.seed)
    swe = config.data.workload != "math"  # an agentic workload (tooluse or swe)
    tokenizer = build_tokenizer(config.model, config.data.workload)
    positions = max(512, config.rollout.max_context_tokens) if swe else 512
    model_config = engine_model_config(config.model, tokenizer, positions)
    problems = [] if swe else load_problems(config)
    tasks = load_tasks(config) if swe else []
    model = build_policy(model_config, seed=config.model.seed, path=config.model.path)
    sampler: PromptSampler[Any] = PromptSampler(tasks if swe else problems, seed=config.data.seed)
    state = None
    if config.system.resume:
        path = (
            find_latest(run_dir / "checkpoints")
            if config.system.resume == "latest"
            else Path(config.system.resume)
        )
        if path is None:
            raise GrpoConfigError(
                "system.resume", f"no checkpoint in {run_dir / 'checkpoints'} to resume from"
            )
        state = load_checkpoint(path)
    warmup_s = 0.0
    if state is None and config.model.warmup_steps and not config.model.path:
        started = time.monotonic()
        section = config.model
        if config.data.workload == "tooluse":
            tooluse_warmup(
                model, tokenizer, tasks, steps=section.warmup_steps, learning_rate=section.warmup_learning_rate,
                batch_size=section.warmup_batch_size, seed=section.seed,
            )  # fmt: skip
        elif swe:
            action_warmup(
                model, tokenizer, tasks, steps=section.warmup_steps, learning_rate=section.warmup_learning_rate,
                batch_size=section.warmup_batch_size, seed=section.seed, max_rounds=config.rollout.max_rounds,
            )  # fmt: skip
        else:
            subset = problems[: max(1, int(len(problems) * section.warmup_fraction))]
            supervised_warmup(
                model, tokenizer, subset, steps=section.warmup_steps, learning_rate=section.warmup_learning_rate,
                batch_size=section.warmup_batch_size, seed=section.seed,
            )  # fmt: skip
        warmup_s = time.monotonic() - started
    trainer = GRPOTrainer(model, config.algorithm, config.rollout.samples_per_prompt, seed=config.model.seed)
    start_step = 0
    if state is not None:
        trainer.load_state_dict(state)
        sampler.load_state_dict(state["sampler"])
        start_step = int(state["step"])
        # Train again on the ended steps the rollout log holds (`belayer_grpo._rollout_log`).
        start_step = replay_ended_steps(
            run_dir, start_step, lambda step, logged: _train_on_log(config, run_dir, tokenizer, sampler, trainer, step, logged)
        )  # fmt: skip
    reporter = Reporter(run_dir, config.logging, config.algorithm.steps, stream=stream)
    run = RunState(config, run_dir, tokenizer, problems, sampler, trainer, reporter, start_step, warmup_s)
    if state is not None:
        run.checkpoint_step = int(state["step"])
        run.num_replayed = start_step - run.checkpoint_step
        run.resume_step = start_step + 1
    return run, model_config


def _train_on_log(
    config: Config, run_dir: Path, tokenizer: PolicyTokenizer, sampler: PromptSampler[Any], trainer: GRPOTrainer,
    step: int, logged: LoggedStep,
) -> None:  # fmt: skip
    """Step ``step`` of a resumed run again from its ended log: its prompts drawn, its update."""
    batch = sampler.next_batch(config.rollout.batch_size)
    n = config.rollout.samples_per_prompt
    if config.data.workload == "math":
        by_index = logged.samples(_prompt_ids(tokenizer, batch, n))
        if len(by_index) != len(batch) * n:
            raise CheckpointError(
                f"{logged.path} ended with {len(by_index)} of {len(batch) * n} samples; remove it and "
                "the later step logs to generate them again"
            )
        samples = [by_index[index] for index in sorted(by_index)]
    else:
        found = logged.trajectories([task.instance_id for task in batch], f"{run_tag(run_dir)}-step{step}")
        samples = to_samples(kept_trajectories(found, n))
    if samples:  # every group dropped: the step made no update
        trainer.update(samples)


def _prompt_ids(tokenizer: PolicyTokenizer, problems: Sequence[Problem], n: int) -> list[list[int]]:
    """The prompt of every sample index of a step (``group * n + sample``)."""
    return [tokenizer.encode_prompt(problem.prompt) for problem in problems for _ in range(n)]


def _save_weights(model: torch.nn.Module, model_config: Any, path: Path) -> None:
    from safetensors.torch import save_file

    from belayer_shadow import weight_layout

    names = [spec.name for spec in weight_layout(model_config).tensors]
    state = model.state_dict()
    save_file({name: state[name].detach().contiguous() for name in names}, str(path))


async def _evaluate(run: RunState, router: RouterClient) -> float:
    """Greedy accuracy over (up to 256 of) the problems: the policy the workers serve now."""
    return await greedy_accuracy(run.problems[:256], router, run.tokenizer, run.config.rollout)


async def _evaluate_agentic(run: RunState, router: RouterClient, when: str) -> float:
    """Greedy accuracy on the held-out tasks, in real sandboxes (no chaos)."""
    # Random request ids: an evaluation is never re-attached (a resumed run evaluates another policy).
    settings = attrs.evolve(agentic_config(run.config, run.run_dir, run.tokenizer, 0), request_ids=False)
    return await evaluate_held_out(
        held_out_tasks(run.config), settings, router, run.tokenizer,
        run_id=f"{run_tag(run.run_dir)}-eval-{when}", pool=await run.sandbox_pool(),
    )  # fmt: skip


async def _math_rollout(
    run: RunState, step: int, router: RouterClient, chaos: WorkerChaos
) -> tuple[list[Sample], dict[str, Any]]:
    config = run.config
    problems = run.sampler.next_batch(config.rollout.batch_size)
    total = len(problems) * config.rollout.samples_per_prompt
    path = step_log_path(run.run_dir, step)
    done: dict[int, Sample] = {}
    logged = LoggedStep(path, [], False, 0)
    if step == run.resume_step:  # what the killed run had finished is taken, not generated again
        logged = await anyio.to_thread.run_sync(read_step_log, path)
        done = logged.samples(_prompt_ids(run.tokenizer, problems, config.rollout.samples_per_prompt))
        run.num_reused, run.num_regenerated = len(done), total - len(done)
        run.reporter.advance(count=len(done))  # the bar counts them as finished
    request_ids = functools.partial(_request_id, run_tag(run.run_dir), step)
    if step == run.resume_step and run.host_adopted:
        missing = [request_ids(i) for i in range(total) if i not in done]
        run.num_reattached, run.num_reattached_tokens = await held_requests(router, missing)
        # What the router never saw was not sent before the kill: generated the first time, not again.
        run.num_new, run.num_regenerated = len(missing) - run.num_reattached, 0
    log = run.step_log = StepLog.open(path, logged.num_bytes)
    kill_pending = chaos.wants_kill_at_step(step)
    finished = 0
    async with anyio.create_task_group() as group:

        def on_sample(index: int, sample: Sample) -> None:
            nonlocal finished, kill_pending
            log.append_sample(index, sample)  # a few hundred bytes and an fsync: before anything else
            finished += 1
            run.reporter.advance()
            if kill_pending and finished >= max(1, total // 4):
                kill_pending = False  # mid-rollout: the rest of the batch is in flight on that worker
                group.start_soon(lambda: anyio.to_thread.run_sync(chaos.kill_now, "step"))

        samples = await run_math_rollouts(
            problems,
            router,
            run.tokenizer,
            config.rollout,
            seed=step,
            on_sample=on_sample,
            done=done,
            request_ids=request_ids,
        )
    return samples, _resume_metrics(run, step)


def _request_id(tag: str, step: int, index: int) -> str:
    """The router's id of sample ``index`` of ``step``: the same in a resumed run, to re-attach."""
    return f"{tag}-step{step}-{index}"


def _resume_metrics(run: RunState, step: int) -> dict[str, Any]:
    resumed = step == run.resume_step
    metrics = {
        "trajectories_reused": run.num_reused if resumed else 0,
        "trajectories_regenerated": run.num_regenerated if resumed else 0,
    }
    if run.host_adopted:
        metrics |= {
            "requests_reattached": run.num_reattached if resumed else 0,
            "tokens_reattached": run.num_reattached_tokens if resumed else 0,
            "trajectories_new": run.num_new if resumed else 0,
        }
        if run.config.data.workload != "math":
            metrics |= _reattach_counts(run, resumed)
    return metrics


def _reattach_counts(run: RunState, resumed: bool = True) -> dict[str, int]:
    """What continuing the begun agentic trajectories redid in their sandboxes (a resumed run
    whose trainer adopted the rollout host)."""
    counts = {
        "trajectories_reattached": run.num_traj_reattached,
        "actions_replayed": run.num_actions_replayed,
        "sandboxes_restored_from_checkpoint": run.num_restored_from_checkpoint,
        "reattached_inconsistent": run.num_reattach_inconsistent,
        "rebuild_failures_recovered": run.num_rebuild_failures,
    }
    return counts if resumed else dict.fromkeys(counts, 0)


async def _swe_rollout(
    run: RunState,
    step: int,
    router: RouterClient,
    chaos: WorkerChaos,
    finished: Callable[[], None] | None = None,
) -> tuple[list[Sample], dict[str, Any]]:
    config = run.config
    settings = agentic_config(config, run.run_dir, run.tokenizer, step)

    def on_trajectory(_trajectory: object) -> None:
        run.reporter.advance()
        if finished is not None:
            finished()

    if run.estimators is None:
        # A step waits for its slowest trajectory: the policy weighs failures by the batch's size.
        run.estimators = default_estimators(
            settings, config.rollout.batch_size * config.rollout.samples_per_prompt
        )
    tasks = run.sampler.next_batch(config.rollout.batch_size)
    n, run_id = config.rollout.samples_per_prompt, f"{run_tag(run.run_dir)}-step{step}"
    path = step_log_path(run.run_dir, step)
    logged = LoggedStep(path, [], False, 0)
    if step == run.resume_step:  # the trajectories the killed run had finished are taken as they are
        logged = await anyio.to_thread.run_sync(read_step_log, path)
    journals = logged.journals()
    log = run.step_log = StepLog.open(path, logged.num_bytes)
    generated = 0

    def on_finished(trajectory: AgenticTrajectory, attempt: int) -> None:
        nonlocal generated
        generated += 1
        log.append_trajectory(trajectory.group_index * n + trajectory.sample_index, attempt, trajectory)

    done = logged.trajectories([task.instance_id for task in tasks], run_id)
    begun: list[str] = []
    if step == run.resume_step and run.host_adopted:  # the turns the adopted router holds
        missing = [
            f"{run_id}-g{g}-s{s}" for g in range(len(tasks)) for s in range(n) if (g, s, 0) not in done
        ]
        begun, run.num_reattached, run.num_reattached_tokens = await held_turns(
            router, missing, config.rollout.max_rounds + 1
        )
    # Each begun trajectory continues at its last logged turn (with the checkpoint recovery: the
    # other modes' sandboxes do not follow the journal's checkpoints; those run again).
    resume = (
        {trajectory_id: journals.get(trajectory_id) or TrajectoryJournal() for trajectory_id in begun}
        if settings.sandbox_recovery == "checkpoint"
        else {}
    )
    before = attrs.evolve(run.env.unrecoverable)
    samples, metrics, trajectories = await run_swe_rollout(
        tasks,
        settings,
        router,
        run.tokenizer,
        num_samples=n,
        run_id=run_id,
        chaos=chaos if chaos.wants_kill_at_step(step) else None,
        trajectories_file=run.run_dir / "trajectories.jsonl",
        step=step,
        on_trajectory=on_trajectory,
        estimators=run.estimators,
        pool=await run.sandbox_pool(),
        stats=run.env.unrecoverable,
        done=done,
        on_finished=on_finished,
        note=log.append_event if settings.request_ids else None,  # a resumed trainer re-attaches
        resume=resume,
    )
    if step == run.resume_step:
        now = run.env.unrecoverable
        run.num_reused, run.num_regenerated = now.num_reused - before.num_reused, generated
        if run.host_adopted:
            # Begun before the kill: continued where they were (their turns answered by the router,
            # their sandboxes rebuilt), unless a turn had to be generated anew; the others never began.
            run.num_traj_reattached = now.num_reattached - before.num_reattached
            run.num_actions_replayed = now.num_actions_replayed - before.num_actions_replayed
            run.num_restored_from_checkpoint = (
                now.num_restored_from_checkpoint - before.num_restored_from_checkpoint
            )
            run.num_reattach_inconsistent = now.num_reattach_inconsistent - before.num_reattach_inconsistent
            run.num_rebuild_failures = now.num_rebuild_failures - before.num_rebuild_failures
            # Regenerated: a begun trajectory not continued to its end (another recovery mode, or
            # it failed and its group was sampled again), or one with a turn generated anew.
            regenerated = now.num_reattach_regenerated - before.num_reattach_regenerated
            run.num_regenerated = len(begun) - run.num_traj_reattached + regenerated
            run.num_new = generated - len(begun)
    metrics |= _resume_metrics(run, step)
    run.env.add(trajectories, step)
    # The agentic trace in belayer-policy's format: what the simulator replays (issue 16).
    with (run.run_dir / "trace.jsonl").open("a") as trace:
        for trajectory in trajectories:
            if trajectory.step_response_s:  # a trajectory without an action has no step to replay
                line = trajectory.trace_line(node=platform.node(), meta={"step": step})
                trace.write(json.dumps(line) + "\n")
    return samples, metrics


async def _step(
    run: RunState,
    step: int,
    system: RolloutSystem | HostSystem | ClusterSystem,
    router: RouterClient,
    chaos: WorkerChaos,
    sync: WeightSync | ClusterWeights | HostedWeights,
) -> dict[str, Any]:
    config = run.config
    total = config.rollout.batch_size * config.rollout.samples_per_prompt
    run.reporter.begin_step(step, total)
    chaos.current_step = step
    if isinstance(system, (ClusterSystem, HostedCluster)):  # chaos.kill_node_at_step
        system.before_rollout(step, num_trajectories=total)
    started = time.monotonic()
    try:
        if config.data.workload == "math":
            samples, extra = await _math_rollout(run, step, router, chaos)
        else:
            finished = system.trajectory_finished if isinstance(system, ClusterSystem) else None
            samples, extra = await _swe_rollout(run, step, router, chaos, finished)
    finally:
        if isinstance(system, (ClusterSystem, HostedCluster)):  # a node loss armed for it waits no longer
            system.after_rollout(step)
    rollout_s = time.monotonic() - started
    run.reporter.advance("reward")
    rewards = [s.reward for s in samples]
    num_tokens = sum(sum(s.loss_mask) for s in samples)  # generated tokens (not observations)
    run.reporter.advance("train")
    train_started = time.monotonic()
    if samples:
        update = await anyio.to_thread.run_sync(run.trainer.update, samples)
    else:  # every group was dropped: no update, and nothing the policy did not earn enters one
        update = UpdateResult(0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0, 0)
    run.reporter.advance("sync")
    sync_started = time.monotonic()
    versions = await anyio.to_thread.run_sync(sync.push, run.trainer.model)
    sync_s = time.monotonic() - sync_started
    resumed = sum(1 for s in samples if s.num_resumes)
    run.num_resumed += resumed
    run.num_samples += len(samples)
    run.num_tokens += num_tokens
    run.rollout_s += rollout_s
    if config.system.checkpoint_every and step % config.system.checkpoint_every == 0:
        await anyio.to_thread.run_sync(_checkpoint, run, step)
    return {
        # Over the completed groups only (a dropped group has no reward to count).
        "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        "accuracy": sum(1 for r in rewards if r >= 1.0) / len(rewards) if rewards else 0.0,
        "tokens_per_s": num_tokens / max(rollout_s, 1e-9),
        "rollout_s": rollout_s,
        "train_s": sync_started - train_started,
        "sync_s": sync_s,  # the weight push: waits for every reader to leave the slot it overwrites
        "step_s": time.monotonic() - started,
        "num_resumed": resumed,
        "weight_version": min(versions),
        **{key: value for key, value in attrs.asdict(update).items()},
        "healthy_slots": len(system.healthy_slots()),
        **(
            sync.metrics() if isinstance(sync, (ClusterWeights, HostedWeights)) else {}
        ),  # versions, checksums by node
        **extra,
    }


def _checkpoint(run: RunState, step: int) -> Path:
    path = save_checkpoint(
        run.run_dir / "checkpoints", step, {**run.trainer.state_dict(), "sampler": run.sampler.state_dict()}
    )
    run.checkpoint_step = step
    return path


def _end_step_log(run: RunState) -> None:
    """Mark the step's rollout log ended (its metrics are recorded); drop the logs a checkpoint covers."""
    if run.step_log is not None:
        run.step_log.end()
        run.step_log = None
    prune_logs(run.run_dir, run.checkpoint_step)


def _new_failures(run: RunState, failures: Sequence[FailureRecord]) -> list[FailureRecord]:
    shown = []
    for index, failure in enumerate(failures):
        if index not in run.reported:
            shown.append(failure)
            if failure.recovery_s is not None:
                run.reported.add(index)
    return shown


async def run_training(config: Config, *, stream: TextIO, run_dir: Path | None = None) -> dict[str, Any]:
    """Train as configured; returns the final report's data (also in ``run_dir/report.json``).

    First reaps whatever an earlier, killed run left in the run folder; then every process of
    this run carries the folder's marker and a guardian process reaps them should this one die.
    """
    run_dir = (run_dir or resolve_run_dir(config)).resolve()
    # Take the folder from any guardian still waiting for a resume: a resumed run re-attaches to
    # the rollout host a killed trainer left (`belayer_grpo._rollout_host`), any other run reaps it.
    host_alive = await anyio.to_thread.run_sync(take_lease, run_dir, os.getpid())
    adopt = host_alive and bool(config.system.resume) and config.system.resume_grace_s > 0
    # On Ray the sandboxes are the host's sandbox hosts' (on the nodes): the host removes those the
    # killed trainer held when the resumed one opens its pool (`HostedCluster.open_pool`).
    keep_sandboxes = adopt and cluster_wanted(config)
    leftovers = await anyio.to_thread.run_sync(
        functools.partial(
            reap_run, run_dir, owner_gone=host_alive, keep_rollout_host=adopt, keep_sandboxes=keep_sandboxes
        )
    )
    if not leftovers.empty:
        print(f"belayer-grpo: reaped what an earlier run left in {run_dir}: {leftovers.describe()}",
              file=stream, flush=True)  # fmt: skip
    with run_processes_marked(run_dir), Guardian(run_dir):
        # A new rollout host starts now: its imports overlap the preparation (`prespawn`).
        fresh_host = config.system.resume_grace_s > 0 and not adopt and not cluster_wanted(config)
        host = await anyio.to_thread.run_sync(prespawn, run_dir) if fresh_host else None
        try:
            return await _train(config, stream, run_dir, adopt, host)
        finally:
            if host is not None:  # (stopped already once it served)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(stop_prespawned, host)


def _rollout_side(
    config: Config, run_dir: Path, model_config: Any, weights_file: Path, host: subprocess.Popen[bytes] | None
) -> AbstractAsyncContextManager[RolloutSystem | HostSystem | ClusterSystem]:
    """`rollout_system`, in the `prespawn`ed rollout host when there is one."""
    if host is not None:
        return HostSystem.start(config, run_dir, model_config, weights_file, process=host)
    return rollout_system(config, run_dir, model_config, weights_file)


async def _train(
    config: Config, stream: TextIO, run_dir: Path, adopt: bool, host: subprocess.Popen[bytes] | None = None
) -> dict[str, Any]:
    wall_start = time.monotonic()
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    run, model_config = await anyio.to_thread.run_sync(_prepare, config, run_dir, stream)
    run.reporter.message(f"belayer-grpo: run folder {run_dir}")
    if not config.system.resume:
        # A new run: no rollout log of an earlier one is ever taken, and a checkpoint of the
        # starting policy makes a kill before the first periodic checkpoint resumable too.
        shutil.rmtree(run_dir / "rollouts", ignore_errors=True)
        await anyio.to_thread.run_sync(_checkpoint, run, 0)
    elif run.num_replayed:
        run.reporter.message(
            f"belayer-grpo: resumed from the step {run.checkpoint_step} checkpoint; steps "
            f"{run.checkpoint_step + 1}-{run.start_step} trained again from their rollout logs"
        )
    if run.warmup_s:
        run.reporter.message(f"belayer-grpo: supervised warm-up done in {run.warmup_s:.1f}s")
    weights_file = run_dir / "policy_init.safetensors"
    await anyio.to_thread.run_sync(_save_weights, run.trainer.model, model_config, weights_file)
    summary: dict[str, Any] = {"status": "interrupted", "run_dir": str(run_dir), "warmup_s": run.warmup_s}
    try:
        run.reporter.message(
            f"belayer-grpo: starting the router and {config.system.num_slots} engine slot(s)"
        )
        if adopt:
            run.reporter.message("belayer-grpo: re-attached to the rollout host of the killed trainer")
        async with (
            (HostedCluster if cluster_wanted(config) else HostSystem).adopt(run_dir)
            if adopt
            else _rollout_side(config, run_dir, model_config, weights_file, host) as system,
            system.client() as router,
        ):
            run.host_adopted = adopt
            chaos = WorkerChaos(
                config.chaos,
                kill=lambda i: (system.slots[i].config.slot, system.slots[i].kill_main()),
                num_slots=len(system.slots),
                names=[slot.config.slot for slot in system.slots],
            )
            sync = (
                system.weights
                if isinstance(system, (ClusterSystem, HostedCluster))
                else WeightSync(
                    system.weight_sockets,
                    keepers=[slot.keep_weights for slot in system.slots],
                    keep_file=run_dir / "pushed-weights.safetensors",
                )
            )
            if isinstance(system, ClusterSystem) and system.sandboxes is not None and run.pool is None:
                # agentic on Ray: every sandbox on a node's sandbox host, checkpoints shared
                run.pool = await anyio.to_thread.run_sync(system.open_pool, config, run_dir)
            elif isinstance(system, HostedCluster) and config.data.workload != "math" and run.pool is None:
                # the same through the rollout host, which drives the cluster and owns its sandboxes
                run.pool = await anyio.to_thread.run_sync(system.open_pool, config, run_dir)
                if system.num_released:
                    run.reporter.message(
                        f"belayer-grpo: removed {system.num_released} sandbox(es) the killed trainer's "
                        "trajectories held on the nodes"
                    )
            if config.data.workload == "math":
                summary["eval_accuracy_before"] = await _evaluate(run, router)
            elif config.data.workload == "tooluse":
                summary["eval_accuracy_before"] = await _evaluate_agentic(run, router, "before")
            if "eval_accuracy_before" in summary:
                run.reporter.message(
                    f"belayer-grpo: greedy accuracy before GRPO {summary['eval_accuracy_before']:.1%}"
                )
            async with anyio.create_task_group() as background:
                background.start_soon(chaos.run_timed, time.time())
                for step in range(run.start_step + 1, config.algorithm.steps + 1):
                    metrics = await _step(run, step, system, router, chaos, sync)
                    recent = [m["reward_mean"] for m in run.reporter.history[-9:]] + [metrics["reward_mean"]]
                    metrics["reward_avg10"] = sum(recent) / len(recent)
                    match_recoveries(chaos.failures, system.events())
                    run.reporter.end_step(step, metrics, _new_failures(run, chaos.failures))
                    await anyio.to_thread.run_sync(_end_step_log, run)
                    summary["steps"] = step
                background.cancel_scope.cancel()
            if config.data.workload == "math":
                summary["eval_accuracy_after"] = await _evaluate(run, router)
            elif config.data.workload == "tooluse":
                summary["eval_accuracy_after"] = await _evaluate_agentic(run, router, "after")
            match_recoveries(chaos.failures, system.events())
            summary["failures"] = [f.to_dict() for f in chaos.failures]
            if isinstance(system, (ClusterSystem, HostedCluster)):
                summary["node_losses"] = await anyio.to_thread.run_sync(system.node_losses)
                summary["weights"] = system.weights.status()
            summary["status"] = "completed"
        if config.system.checkpoint_every == 0 or summary.get("steps", 0) % config.system.checkpoint_every:
            await anyio.to_thread.run_sync(_checkpoint, run, summary.get("steps", run.start_step))
    finally:
        if run.step_log is not None:
            run.step_log.close()
        if run.pool is not None:
            with anyio.CancelScope(shield=True):
                await close_pool(run.pool)
        history = run.reporter.history
        if history:
            summary |= {
                "reward_first": history[0]["reward_mean"], "reward_last": history[-1]["reward_mean"],
                "accuracy_first": history[0]["accuracy"], "accuracy_last": history[-1]["accuracy"],
                "weight_version": history[-1]["weight_version"],
            }  # fmt: skip
        summary |= {
            "wall_s": time.monotonic() - wall_start, "num_samples": run.num_samples, "num_resumed": run.num_resumed,
            "tokens_per_s": run.num_tokens / max(run.rollout_s, 1e-9), "workload": config.data.workload,
        }  # fmt: skip
        if run.resume_step:
            summary |= {
                "resumed_at_step": run.resume_step, "steps_replayed": run.num_replayed,
                "trajectories_reused": run.num_reused, "trajectories_regenerated": run.num_regenerated,
            }  # fmt: skip
            if run.host_adopted:
                summary |= {
                    "requests_reattached": run.num_reattached, "tokens_reattached": run.num_reattached_tokens,
                    "trajectories_new": run.num_new,
                }  # fmt: skip
                if config.data.workload != "math":
                    summary |= _reattach_counts(run)
        if config.data.workload != "math":
            summary["env"] = run.env.to_dict()
        if history:
            summary["plot"] = str(run_dir / "training.png")
        run.reporter.message(run.reporter.final_report(summary))
        if history:
            await anyio.to_thread.run_sync(write_training_plot, run_dir / "training.png", history, summary)
        run.reporter.close()
    return summary
