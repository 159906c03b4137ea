"""What a finished agentic trajectory reports: tokens for training, and its failure history."""

from __future__ import annotations

from typing import Any

import attrs

from belayer_envckpt import Checkpoint

__all__ = [
    "CHECKPOINT_KINDS",
    "AgenticTrajectory",
    "CheckpointRecord",
    "RecoveryRecord",
    "count_kinds",
    "summarize",
]


@attrs.frozen
class CheckpointRecord:
    """A ready checkpoint at prefix ``prefix`` (actions), tied to the router's ``L_turn``.

    ``kind`` is the kind belayer-envckpt took (``full``, ``fresh-runtime`` or ``reference``; the
    base record's is "").

    ``repo_hash`` is the repository's content hash taken at the checkpoint's frozen moment,
    ``context_hash`` that of ``L_turn``; both are compared after a restore.  The base record
    (prefix 0, no checkpoint) stands for the task image and the prompt.
    """

    prefix: int
    turn: int
    context_ref: str
    context_hash: str
    repo_hash: str
    duration_s: float = 0.0
    # What the checkpoint added to the trajectory's critical path: how long the next action
    # waited for it after the overlapping response was done (the whole checkpoint if blocking).
    waited_s: float = 0.0
    checkpoint: Checkpoint | None = attrs.field(default=None, eq=False, repr=False)
    kind: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out = attrs.asdict(self, filter=lambda a, _v: a.name != "checkpoint")
        out["checkpoint_id"] = None if self.checkpoint is None else self.checkpoint.checkpoint_id
        out["checkpoint_bytes"] = 0 if self.checkpoint is None else self.checkpoint.total_bytes
        return out


@attrs.frozen
class RecoveryRecord:
    """One sandbox failure and the recovery from it.

    ``from_checkpoint`` is False when the trajectory restarted from the base image and the
    prompt.  The recovery is prefix-consistent when the restored repository hash equals the one
    recorded with the checkpoint, the context reloaded from the router equals (by hash) the
    ``L_turn`` the checkpoint names, and the sandbox's prefix equals the checkpoint's.
    """

    failed_prefix: int
    failed_turn: int
    reason: str
    restored_prefix: int
    restored_turn: int
    from_checkpoint: bool
    restore_s: float
    tokens_regenerated: int
    rounds_regenerated: int
    expected_repo_hash: str
    actual_repo_hash: str
    context_matches: bool
    prefix_matches: bool
    restore_timings_ms: dict[str, float] = attrs.field(factory=dict)
    restored_kind: str = ""  # the kind of the checkpoint restored ("" for a start from scratch)
    # A verbatim replay of the committed actions in a fresh sandbox (sandbox_recovery = "replay"):
    # ``context_matches`` then says whether every replayed action returned what the agent saw.
    replayed: bool = False

    @property
    def prefix_consistent(self) -> bool:
        """Environment, LLM context and prefix after the recovery all belong to the same prefix."""
        return (
            self.expected_repo_hash == self.actual_repo_hash and self.context_matches and self.prefix_matches
        )

    @property
    def into_spare(self) -> bool:
        """The checkpoint went into a started spare container (`SandboxPool.spares`)."""
        return "spare_ms" in self.restore_timings_ms

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return attrs.asdict(self) | {
            "prefix_consistent": self.prefix_consistent,
            "into_spare": self.into_spare,
        }


@attrs.frozen
class AgenticTrajectory:
    """One finished agentic sample.

    ``token_ids`` is the final context (prompt, responses, observations); ``loss_mask`` is 1 on the
    tokens the model generated, whose rollout logprobs are in ``logprobs`` (0 elsewhere).
    ``finish``: ``submit``, ``no_action``, ``max_rounds`` or ``context_full``.  ``rounds`` counts
    the responses of the final context; ``num_responses`` every response generated, regenerated
    ones included.
    """

    trajectory_id: str
    task_id: str
    group_index: int
    sample_index: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    num_prompt_tokens: int
    reward: float
    finish: str
    rounds: int
    num_actions: int
    num_responses: int
    test_exit_code: int
    test_output: str
    policy: str
    wall_s: float
    checkpoints: list[CheckpointRecord]
    recoveries: list[RecoveryRecord]
    num_checkpoint_failures: int = 0
    num_resumed_responses: int = 0
    num_checkpoint_fallbacks: int = 0  # ready checkpoints given up at a restore for an earlier one
    kind_query_s: float = 0.0  # asking which kind a checkpoint would take, before each decision
    decide_waited_s: float = 0.0  # what the next action waited for a decision that took no checkpoint
    # Per committed step (action) of the final prefix, for the policy simulator's trace format.
    step_response_s: list[float] = attrs.field(factory=list)
    step_action_s: list[float] = attrs.field(factory=list)
    step_checkpoint_s: list[float | None] = attrs.field(factory=list)
    # The kind of each step's checkpoint: the one taken, else the one a checkpoint would have taken
    # (asked before the decision); None where not known (a policy that does not weigh kinds).
    step_checkpoint_kind: list[str | None] = attrs.field(factory=list)
    failed_steps: list[int] = attrs.field(factory=list)  # the step each sandbox failure hit

    def trace_line(self, *, node: str | None = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """The trajectory in belayer-policy's trace format (`belayer_policy.load_trace` reads it).

        A sandbox kill comes after the action it ended, so its ``at`` is the end of the attempt.
        Failures outside the committed steps (in the final test run) are left out.  ``meta`` keeps
        what a replay through the simulator is checked against: the measured ``wall_s``, each
        checkpoint's critical-path wait by prefix (``checkpoint_waited_s``) and each recovery
        (failed and restored step, ``restore_s``, ``rounds_regenerated``); the caller's ``meta``
        is added to it.
        """
        n = len(self.step_response_s)
        recorded: dict[str, Any] = {
            "policy": self.policy,
            "wall_s": self.wall_s,
            "checkpoint_waited_s": {str(c.prefix): c.waited_s for c in self.checkpoints if c.prefix > 0},
            "recoveries": [
                {
                    "failed_step": r.failed_prefix,
                    "restored_step": r.restored_prefix,
                    "restore_s": r.restore_s,
                    "rounds_regenerated": r.rounds_regenerated,
                }
                for r in self.recoveries
            ],
        }
        line: dict[str, Any] = {
            "response_s": self.step_response_s,
            "action_s": self.step_action_s,
            "checkpoint_s": self.step_checkpoint_s,
            "failures": [{"step": step, "at": 0.99} for step in self.failed_steps if step < n],
            "restore_s": [r.restore_s for r in self.recoveries],
            "task": self.task_id,
            "trajectory_id": self.trajectory_id,
            "meta": recorded | (meta or {}),
        }
        kinds = self.step_checkpoint_kind
        if len(kinds) == n and any(kind is not None for kind in kinds):
            line["checkpoint_kind"] = list(kinds)  # belayer-policy charges each step its kind's cost
        if node is not None:
            line["node"] = node
        return line

    @property
    def num_failures(self) -> int:
        """Sandbox failures seen (each was followed by a recovery)."""
        return len(self.recoveries)

    @property
    def prefix_consistent(self) -> bool:
        """Every recovery of the trajectory was prefix-consistent (True without failures)."""
        return all(r.prefix_consistent for r in self.recoveries)

    @property
    def tokens_regenerated(self) -> int:
        """Response tokens that failures made the model generate again."""
        return sum(r.tokens_regenerated for r in self.recoveries)

    def to_record(self) -> dict[str, Any]:
        """Every field, JSON-ready (a rollout log's line; `from_record` reads it back).  The live
        `Checkpoint` handles are left out: a finished trajectory's checkpoints are collected."""
        out = attrs.asdict(self, recurse=False)
        out["checkpoints"] = [
            attrs.asdict(c, filter=lambda a, _v: a.name != "checkpoint") for c in self.checkpoints
        ]
        out["recoveries"] = [attrs.asdict(r) for r in self.recoveries]
        return out

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> AgenticTrajectory:
        """The trajectory `to_record` wrote (``checkpoint`` handles None)."""
        return cls(**{
            **record,
            "checkpoints": [CheckpointRecord(**c) for c in record["checkpoints"]],
            "recoveries": [RecoveryRecord(**r) for r in record["recoveries"]],
        })  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """Counters and the failure history, JSON-ready (no token lists)."""
        return {
            "trajectory_id": self.trajectory_id,
            "task_id": self.task_id,
            "reward": self.reward,
            "finish": self.finish,
            "outcome": self.test_output[-300:],
            "rounds": self.rounds,
            "num_actions": self.num_actions,
            "num_responses": self.num_responses,
            "num_failures": self.num_failures,
            "num_checkpoints": len(self.checkpoints),
            "num_checkpoint_failures": self.num_checkpoint_failures,
            "num_resumed_responses": self.num_resumed_responses,
            "num_checkpoint_fallbacks": self.num_checkpoint_fallbacks,
            "checkpoints_by_kind": {k: int(v["count"]) for k, v in count_kinds([self]).items()},
            "kind_query_s": self.kind_query_s,
            "decide_waited_s": self.decide_waited_s,
            "tokens_regenerated": self.tokens_regenerated,
            "prefix_consistent": self.prefix_consistent,
            "policy": self.policy,
            "wall_s": self.wall_s,
            "checkpoints": [c.to_dict() for c in self.checkpoints],
            "recoveries": [r.to_dict() for r in self.recoveries],
        }


CHECKPOINT_KINDS = ("full", "fresh-runtime", "reference")  # belayer-envckpt's CheckpointKind values


def count_kinds(trajectories: list[AgenticTrajectory]) -> dict[str, dict[str, float]]:
    """Per checkpoint kind: how many were taken, their time and what of it the critical path waited
    (``{"full": {"count": n, "s": ..., "waited_s": ...}, ...}``, every kind present)."""
    out: dict[str, dict[str, float]] = {k: {"count": 0, "s": 0.0, "waited_s": 0.0} for k in CHECKPOINT_KINDS}
    for trajectory in trajectories:
        for c in trajectory.checkpoints:
            row = out.setdefault(c.kind or "full", {"count": 0, "s": 0.0, "waited_s": 0.0})
            row["count"] += 1
            row["s"] += c.duration_s
            row["waited_s"] += c.waited_s
    return out


def summarize(trajectories: list[AgenticTrajectory]) -> dict[str, Any]:
    """Batch totals for the trainer's summary line and metrics."""
    recoveries = [r for t in trajectories for r in t.recoveries]
    restore = [r.restore_s for r in recoveries]
    n = len(trajectories)
    return {
        "num_trajectories": n,
        "reward_mean": sum(t.reward for t in trajectories) / n if n else 0.0,
        "rounds_mean": sum(t.rounds for t in trajectories) / n if n else 0.0,
        "num_failures": len(recoveries),
        "num_recoveries_from_checkpoint": sum(r.from_checkpoint for r in recoveries),
        "num_restores_into_spare": sum(r.into_spare for r in recoveries),
        "num_checkpoints": sum(len(t.checkpoints) for t in trajectories),
        "checkpoints_by_kind": {k: int(v["count"]) for k, v in count_kinds(trajectories).items()},
        "num_checkpoint_failures": sum(t.num_checkpoint_failures for t in trajectories),
        "restore_s_mean": sum(restore) / len(restore) if restore else 0.0,
        "restore_s_max": max(restore, default=0.0),
        "tokens_regenerated": sum(r.tokens_regenerated for r in recoveries),
        "num_resumed_responses": sum(t.num_resumed_responses for t in trajectories),
        "num_checkpoint_fallbacks": sum(t.num_checkpoint_fallbacks for t in trajectories),
        "all_prefix_consistent": all(t.prefix_consistent for t in trajectories),
    }
