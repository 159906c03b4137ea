"""The agentic workloads inside training: tasks, the warm-ups, one rollout, the held-out evaluation.

``data.workload = "tooluse"`` (the default) or ``"swe"``: each step draws ``rollout.batch_size`` tasks, rolls out
``rollout.samples_per_prompt`` trajectories per task with `run_agentic_rollouts` (sandboxes,
checkpoint policy, sandbox chaos, recoveries) and turns them into the trainer's `Sample` groups
with `to_samples`.  A worker kill scheduled for the step hits while responses are in flight.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import torch

from belayer_envckpt import CheckpointStore, Engine, ExecResult
from belayer_grpo._agentic import (
    AgenticConfig,
    AgenticTrajectory,
    AgentTask,
    RolloutStats,
    SandboxPool,
    builtin_tasks,
    count_kinds,
    load_swegym,
    render_observation,
    render_prompt,
    run_agentic_rollouts,
    summarize,
    to_samples,
)
from belayer_grpo._agentic.journal import TrajectoryJournal
from belayer_grpo._agentic.tooluse import (
    ToolUseTask,
    ensure_build_image,
    generate_tooluse_tasks,
    tooluse_demonstration,
)
from belayer_grpo._chaos import WorkerChaos
from belayer_grpo._config import Config
from belayer_grpo._data import PolicyTokenizer
from belayer_grpo._errors import GrpoConfigError
from belayer_grpo._guardian import RUN_LABEL, run_marker
from belayer_grpo._model import completion_logprobs, pack
from belayer_grpo._rollout_math import Sample
from belayer_policy import SharedEstimators
from belayer_router import RouterClient, RouterCounters

__all__ = [
    "WARMUP_COMMANDS",
    "EnvTotals",
    "action_warmup",
    "agentic_config",
    "close_pool",
    "evaluate_held_out",
    "format_env",
    "held_out_tasks",
    "load_tasks",
    "open_pool",
    "prepare_images",
    "run_swe_rollout",
    "run_tag",
    "supervised_loop",
    "tooluse_warmup",
]

# Short, harmless commands: the warm-up teaches the action format, not how to fix a bug.
WARMUP_COMMANDS = ("ls", "pwd", "wc -l *.py", "grep -n return *.py", "echo step >> notes.txt")
_FAKE_OUTPUTS = ("", "notes.txt\n", "3 calc.py\n", "/workspace/calc_add\n", "1:def add(a, b):\n")


def load_tasks(config: Config) -> list[AgentTask]:
    """The training tasks.  tooluse: generated from ``data.seed`` (less the held-out ones); swe:
    ``data.source``, ``builtin`` (the shipped tasks) or a SWE-Gym style ``.jsonl`` file."""
    if config.data.workload == "tooluse":
        return list(generate_tooluse_tasks(config.data.seed, config.data.held_out, config.data.tool_task)[0])
    source = config.data.source
    if source == "builtin":
        return list(builtin_tasks())
    if not source.endswith(".jsonl"):
        raise GrpoConfigError("data.source", f"the swe workload reads a SWE-Gym .jsonl file, got {source!r}")
    return list(load_swegym(source))


def held_out_tasks(config: Config) -> list[AgentTask]:
    """The tasks evaluated greedily before and after training (tooluse; none for swe)."""
    if config.data.workload != "tooluse":
        return []
    return list(generate_tooluse_tasks(config.data.seed, config.data.held_out, config.data.tool_task)[1])


def run_tag(run_dir: Path) -> str:
    """A short tag of the run: its trajectory ids (and so its sandboxes' labels) start with it."""
    return run_marker(run_dir)


def agentic_config(config: Config, run_dir: Path, tokenizer: PolicyTokenizer, step: int) -> AgenticConfig:
    """The agent loop's settings for one step, from the training configuration."""
    rollout = config.rollout
    return AgenticConfig(
        checkpoint_root=run_dir / "env-checkpoints",
        max_rounds=rollout.max_rounds,
        max_response_tokens=rollout.max_tokens,
        max_context_tokens=rollout.max_context_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=config.chaos.seed * 100_003 + step,
        checkpoint_policy=rollout.env_checkpoint_policy,
        sandbox_kill_probability=config.chaos.sandbox_kill_p,
        sandbox_kill_at_actions=config.chaos.sandbox_kill_at_actions,
        sandbox_recovery=config.system.sandbox_recovery,
        max_concurrency=rollout.max_sandboxes,
        spare_sandboxes=rollout.spare_sandboxes,
        invalid_action=rollout.invalid_action,
        max_recoveries=rollout.max_recoveries,
        on_unrecoverable=rollout.on_unrecoverable,
        max_resamples=rollout.max_resamples,
        run_label=run_marker(run_dir),
        request_ids=config.system.resume_grace_s > 0,  # a resumed trainer re-attaches to held turns
    )


def connect_checkpoint_engine() -> Engine:
    """The local Docker engine, checked to checkpoint containers (CRIU); closed again if not."""
    engine = Engine.connect()
    try:
        engine.require_checkpoint_support()
    except BaseException:
        engine.close()
        raise
    return engine


def open_pool(config: Config, run_dir: Path) -> SandboxPool:
    """The run's sandbox pool, kept from step to step.  tooluse reuses its sandboxes (the state
    of a task lives in its working directory, which the pool empties between trajectories); its
    build tasks' image is committed first if it is not there (`ensure_build_image`)."""
    engine = connect_checkpoint_engine()
    try:
        prepare_images(config, engine)
    except BaseException:
        engine.close()
        raise
    return SandboxPool(
        engine, CheckpointStore(run_dir / "env-checkpoints"), capacity=config.rollout.max_sandboxes,
        labels={RUN_LABEL: run_marker(run_dir)}, reuse=config.data.workload == "tooluse",
        spares=config.rollout.spare_sandboxes,
    )  # fmt: skip


def prepare_images(config: Config, engine: Engine) -> None:
    """Commit the images the workload's tasks need and that are not there (the build tasks')."""
    if config.data.workload == "tooluse" and config.data.tool_task == "build":
        ensure_build_image(engine)


async def close_pool(pool: SandboxPool) -> None:
    """Remove every container of the pool and close its engine connection."""
    try:
        await pool.aclose()
    finally:
        pool.engine.close()


def _warmup_example(
    rng: random.Random, tokenizer: PolicyTokenizer, task: AgentTask, max_rounds: int
) -> tuple[list[int], list[int]]:
    context = tokenizer.encode_prompt(render_prompt(task))
    for _ in range(rng.randrange(max_rounds)):
        context += [*tokenizer.encode(f"ACTION: {rng.choice(WARMUP_COMMANDS)}\n"), tokenizer.eos_token_id]
        result = ExecResult(stdout=rng.choice(_FAKE_OUTPUTS), stderr="", exit_code=0, duration_s=0.0)
        context += tokenizer.encode(render_observation(result, 2000))
    target = [*tokenizer.encode(f"ACTION: {rng.choice(WARMUP_COMMANDS)}\n"), tokenizer.eos_token_id]
    return context, target


def supervised_loop(
    model: torch.nn.Module,
    make_example: Callable[[random.Random], tuple[list[int], list[int]]],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
) -> list[float]:
    """Supervised steps on ``(context, target)`` token examples: each step draws ``batch_size``
    examples with ``make_example(rng)`` (``rng`` seeded by ``seed``) and minimises the mean
    negative log-likelihood of the targets.  The model is left in eval mode.  Returns the losses."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    model.train()
    losses = []
    for _ in range(steps):
        examples = [make_example(rng) for _ in range(batch_size)]
        batch = pack([c for c, _ in examples], [t for _, t in examples])
        logprobs, mask = completion_logprobs(model, batch, [len(t) for _, t in examples])
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def action_warmup(
    model: torch.nn.Module,
    tokenizer: PolicyTokenizer,
    tasks: Sequence[AgentTask],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
    max_rounds: int,
) -> list[float]:
    """A brief supervised warm-up on the action format (``ACTION: <command>``), so that a fresh
    model takes environment steps: after the prompt, or after 1 to ``max_rounds - 1`` earlier
    rounds with their observations, it answers with one of `WARMUP_COMMANDS`.  Returns the losses.
    """
    return supervised_loop(
        model, lambda rng: _warmup_example(rng, tokenizer, rng.choice(tasks), max_rounds),
        steps=steps, learning_rate=learning_rate, batch_size=batch_size, seed=seed,
    )  # fmt: skip


def _tooluse_example(
    rng: random.Random, tokenizer: PolicyTokenizer, task: ToolUseTask
) -> tuple[list[int], list[int]]:
    turns = tooluse_demonstration(task, rng)
    target_turn = rng.randrange(len(turns))
    context = tokenizer.encode_prompt(render_prompt(task))
    for text, observation in turns[:target_turn]:
        assert observation is not None
        context += [*tokenizer.encode(text), tokenizer.eos_token_id]
        context += tokenizer.encode(task.render_observation(observation.exit_code, observation.output))
    return context, [*tokenizer.encode(turns[target_turn][0]), tokenizer.eos_token_id]


def tooluse_warmup(
    model: torch.nn.Module,
    tokenizer: PolicyTokenizer,
    tasks: Sequence[AgentTask],
    *,
    steps: int,
    learning_rate: float,
    batch_size: int,
    seed: int,
) -> list[float]:
    """A brief supervised warm-up on the training tasks' transcripts by an imperfect demonstrator
    (`tooluse_demonstration`: it often answers without reading the file back); one turn of one
    transcript per example, the earlier turns with their observations as context.  It teaches
    the format and the tool protocol; the policy starts mostly wrong (it skips the read), so
    GRPO has something to raise, and the values differ from the held-out ones."""
    tool_tasks = [t for t in tasks if isinstance(t, ToolUseTask)]
    return supervised_loop(
        model, lambda rng: _tooluse_example(rng, tokenizer, rng.choice(tool_tasks)),
        steps=steps, learning_rate=learning_rate, batch_size=batch_size, seed=seed,
    )  # fmt: skip


async def evaluate_held_out(
    tasks: Sequence[AgentTask], settings: AgenticConfig, router: RouterClient, tokenizer: PolicyTokenizer,
    *, run_id: str, pool: SandboxPool | None = None,
) -> float:  # fmt: skip
    """Greedy accuracy on ``tasks``: one trajectory each, in real sandboxes, without chaos."""
    if not tasks:
        return 0.0
    greedy = attrs.evolve(
        settings, temperature=0.0, sandbox_kill_probability=0.0, sandbox_kill_at_actions=(),
        checkpoint_policy="never",
    )  # fmt: skip
    trajectories = await run_agentic_rollouts(
        tasks, router, greedy, num_samples=1, tokenizer=tokenizer, run_id=run_id,
        engine=None if pool is None else pool.engine, pool=pool,
    )  # fmt: skip
    return sum(t.reward for t in trajectories) / len(trajectories)


@attrs.define
class EnvTotals:
    """Sandbox failures, recoveries and checkpoints over the whole run."""

    trajectories: int = 0
    failures: int = 0
    from_checkpoint: int = 0
    into_spare: int = 0  # restores that went into a started spare container
    restore_s: list[float] = attrs.field(factory=list)
    tokens_regenerated: int = 0
    checkpoints: int = 0
    checkpoint_failures: int = 0
    inconsistent: int = 0
    checkpoint_s: float = 0.0  # time spent taking checkpoints (mostly overlapped with responses)
    checkpoint_waited_s: float = 0.0  # what of it the next action waited for: the visible cost
    fallbacks: int = 0  # ready checkpoints given up at a restore for an earlier one
    # Per checkpoint kind (full, fresh-runtime, reference): count, time taking them, time waited.
    by_kind: dict[str, dict[str, float]] = attrs.field(factory=lambda: count_kinds([]))
    kind_query_s: float = 0.0  # asking which kind a checkpoint would take (overlapped with responses)
    decide_waited_s: float = 0.0  # what actions waited for decisions that took no checkpoint
    unrecoverable: RolloutStats = attrs.field(factory=RolloutStats)
    recoveries: list[dict[str, Any]] = attrs.field(factory=list)

    def add(self, trajectories: Sequence[AgenticTrajectory], step: int = 0) -> None:
        """Count one step's trajectories and list each sandbox failure with its recovery."""
        for kind, row in count_kinds(list(trajectories)).items():
            mine = self.by_kind.setdefault(kind, {"count": 0, "s": 0.0, "waited_s": 0.0})
            for key, value in row.items():
                mine[key] += value
        for trajectory in trajectories:
            self.kind_query_s += trajectory.kind_query_s
            self.decide_waited_s += trajectory.decide_waited_s
            self.checkpoint_s += sum(c.duration_s for c in trajectory.checkpoints)
            self.checkpoint_waited_s += sum(c.waited_s for c in trajectory.checkpoints)
            for r in trajectory.recoveries:
                self.recoveries.append({
                    "step": step, "trajectory": trajectory.trajectory_id, "reason": r.reason,
                    "failed_turn": r.failed_turn, "from_checkpoint": r.from_checkpoint,
                    "restored_kind": r.restored_kind,
                    "restored_prefix": r.restored_prefix, "restored_turn": r.restored_turn,
                    "turns_replayed": r.rounds_regenerated, "tokens_regenerated": r.tokens_regenerated,
                    "restore_s": r.restore_s, "into_spare": r.into_spare,
                    "prefix_consistent": r.prefix_consistent,
                    "reward": trajectory.reward,
                })  # fmt: skip
            self.trajectories += 1
            self.failures += trajectory.num_failures
            self.from_checkpoint += sum(r.from_checkpoint for r in trajectory.recoveries)
            self.into_spare += sum(r.into_spare for r in trajectory.recoveries)
            self.restore_s += [r.restore_s for r in trajectory.recoveries]
            self.tokens_regenerated += trajectory.tokens_regenerated
            self.checkpoints += len(trajectory.checkpoints)
            self.checkpoint_failures += trajectory.num_checkpoint_failures
            self.fallbacks += trajectory.num_checkpoint_fallbacks
            self.inconsistent += not trajectory.prefix_consistent

    def to_dict(self) -> dict[str, Any]:
        """The report's ``env`` section."""
        restore = self.restore_s
        return {
            "trajectories": self.trajectories,
            "sandbox_failures": self.failures,
            "recoveries_from_checkpoint": self.from_checkpoint,
            "recoveries_from_scratch": self.failures - self.from_checkpoint,
            "restores_into_spare": self.into_spare,
            "restore_s_mean": sum(restore) / len(restore) if restore else 0.0,
            "restore_s_max": max(restore, default=0.0),
            "tokens_regenerated": self.tokens_regenerated,
            "checkpoints": self.checkpoints,
            "checkpoint_failures": self.checkpoint_failures,
            "checkpoint_s_total": self.checkpoint_s,
            "checkpoint_waited_s_total": self.checkpoint_waited_s,
            "checkpoint_fallbacks": self.fallbacks,
            "checkpoints_by_kind": {k: int(v["count"]) for k, v in self.by_kind.items()},
            "checkpoint_s_by_kind": {k: v["s"] for k, v in self.by_kind.items()},
            "checkpoint_waited_s_by_kind": {k: v["waited_s"] for k, v in self.by_kind.items()},
            "kind_query_s_total": self.kind_query_s,
            "decide_waited_s_total": self.decide_waited_s,
            "recoveries_by_kind": self._recoveries_by_kind(),
            **self.unrecoverable.to_dict(),
            "unrecoverable_errors": self.unrecoverable.errors[-20:],
            "all_prefix_consistent": self.inconsistent == 0,
            "recoveries": self.recoveries,
        }

    def _recoveries_by_kind(self) -> dict[str, int]:
        """Recoveries per kind of checkpoint restored (``scratch``: from the image and the prompt)."""
        out: dict[str, int] = {}
        for r in self.recoveries:
            key = str(r["restored_kind"] or "scratch") if r["from_checkpoint"] else "scratch"
            out[key] = out.get(key, 0) + 1
        return out


def format_env(metrics: dict[str, Any]) -> str:
    """The summary line's part about sandboxes: failures, recoveries and checkpoints."""
    text = f"env: {metrics['env_failures']} sandbox failures"
    if metrics["env_failures"]:
        text += (
            f" -> {metrics['env_recoveries_from_checkpoint']} restored from checkpoint,"
            f" {metrics['env_failures'] - metrics['env_recoveries_from_checkpoint']} from scratch"
            f" (restore {metrics['env_restore_s_mean']:.2f}s avg"
            f", {metrics.get('env_restores_into_spare', 0)} into a spare), {metrics['env_tokens_regenerated']} tok"
            " regenerated"
        )
    text += f", {metrics['env_checkpoints']} checkpoints"
    kinds = [
        f"{metrics.get(f'env_checkpoints_{key}', 0)} {name}"
        for key, name in (("full", "full"), ("fresh_runtime", "fresh-runtime"), ("reference", "reference"))
        if metrics.get(f"env_checkpoints_{key}")
    ]
    if kinds:
        text += f" ({', '.join(kinds)})"
    if metrics.get("env_checkpoint_fallbacks"):
        text += f" ({metrics['env_checkpoint_fallbacks']} fallbacks to an earlier one)"
    if metrics.get("env_unrecoverable"):
        text += (
            f", {metrics['env_unrecoverable']} unrecoverable -> {metrics['env_group_resamples']} group"
            f" resamples, {metrics['env_dropped_groups']} groups dropped"
        )
    if not metrics["env_prefix_consistent"]:
        text += ", PREFIX INCONSISTENT"
    return text


async def _kill_while_generating(router: RouterClient, chaos: WorkerChaos) -> None:
    """Kill the main worker of a slot as soon as it has responses in flight (that slot's, not a
    random one: the point is to interrupt them), and note on the failure how many it had."""
    while True:
        busy = [slot for slot in await router.workers() if slot.get("num_outstanding")]
        if busy:
            break
        await anyio.sleep(0.005)
    victim = busy[0]
    record = await anyio.to_thread.run_sync(chaos.kill_now, "step", chaos.index_of(str(victim["slot"])))
    record.requests_in_flight = int(victim["num_outstanding"])


async def _resumes(router: RouterClient) -> int:
    """The router's count of interrupted streams resumed so far."""
    return int(RouterCounters.parse(await router.metrics()).resumes_total)


async def run_swe_rollout(
    tasks: Sequence[AgentTask],
    config: AgenticConfig,
    router: RouterClient,
    tokenizer: PolicyTokenizer,
    *,
    num_samples: int,
    run_id: str,
    chaos: WorkerChaos | None,
    trajectories_file: Path,
    step: int,
    on_trajectory: Any = None,
    estimators: SharedEstimators | None = None,
    pool: SandboxPool | None = None,
    stats: RolloutStats | None = None,
    done: Mapping[tuple[int, int, int], AgenticTrajectory] | None = None,
    on_finished: Callable[[AgenticTrajectory, int], None] | None = None,
    note: Callable[[dict[str, Any]], None] | None = None,
    resume: Mapping[str, TrajectoryJournal] | None = None,
) -> tuple[list[Sample], dict[str, Any], list[AgenticTrajectory]]:
    """One step's trajectories as `Sample`s, their step metrics, and the trajectories.

    ``chaos``, when given, kills a worker while responses are being generated.  Every
    trajectory's summary is appended to ``trajectories_file`` (JSON lines).  ``estimators``
    (kept by the caller from step to step) keep learning the checkpoint and restore costs and
    the hazard that the trajectories measure.  ``done``, ``on_finished``, ``note`` and ``resume``:
    the rollout log of ``--resume`` (`belayer_grpo._agentic.run_agentic_rollouts`).  ``stats`` (the run's totals) has this step's
    unrecoverable trajectories and what became of their groups added to it, also when the
    rollout fails; the metrics hold this step's counts only.
    """
    step_stats = RolloutStats()  # this step's: metrics.jsonl is per step, the report has totals
    resumes_before = 0
    try:
        async with anyio.create_task_group() as group:
            if chaos is not None:
                resumes_before = await _resumes(router)
                group.start_soon(_kill_while_generating, router, chaos)
            trajectories = await run_agentic_rollouts(
                tasks, router, config, num_samples=num_samples, tokenizer=tokenizer, run_id=run_id,
                on_trajectory=on_trajectory, estimators=estimators,
                engine=None if pool is None else pool.engine, pool=pool, stats=step_stats,
                done=done, on_finished=on_finished, note=note, resume=resume,
            )  # fmt: skip
            group.cancel_scope.cancel()
    finally:
        if stats is not None:
            stats.add(step_stats)
    stats = step_stats
    if chaos is not None:  # the streams the router resumed after this step's kill
        resumed = await _resumes(router) - resumes_before
        for record in chaos.failures:
            if record.step == step and record.requests_in_flight is not None:
                record.requests_resumed = resumed
    with trajectories_file.open("a") as out:
        for trajectory in trajectories:
            out.write(json.dumps({"step": step, **trajectory.summary()}) + "\n")
    totals = summarize(trajectories)
    metrics = {
        "num_trajectories": len(trajectories),
        "rounds_mean": totals["rounds_mean"],
        "env_failures": totals["num_failures"],
        "env_recoveries_from_checkpoint": totals["num_recoveries_from_checkpoint"],
        "env_restores_into_spare": totals["num_restores_into_spare"],
        "env_restore_s_mean": totals["restore_s_mean"],
        "env_restore_s_max": totals["restore_s_max"],
        "env_tokens_regenerated": totals["tokens_regenerated"],
        "env_checkpoints": totals["num_checkpoints"],
        **{f"env_checkpoints_{k.replace('-', '_')}": n for k, n in totals["checkpoints_by_kind"].items()},
        "env_checkpoint_waited_s": sum(c.waited_s for t in trajectories for c in t.checkpoints),
        "env_checkpoint_failures": totals["num_checkpoint_failures"],
        "env_prefix_consistent": int(totals["all_prefix_consistent"]),
        "env_checkpoint_fallbacks": totals["num_checkpoint_fallbacks"],
        "env_unrecoverable": stats.num_unrecoverable,
        "env_resampled_groups": stats.num_resampled_groups,
        "env_group_resamples": stats.num_resamples,
        "env_dropped_groups": stats.num_dropped_groups,
        "num_groups": len(trajectories) // max(num_samples, 1),
    }
    return to_samples(trajectories), metrics, trajectories
