"""The agentic software-engineering workload: multi-turn rollouts with bash actions in sandboxes.

`run_agentic_rollouts` is the trainer's entry point; it survives sandbox failures by restoring
the latest ready full checkpoint and the router's matching ``L_k``.
"""

from __future__ import annotations

from belayer_grpo._agentic.actions import (
    Answer,
    BashAction,
    InvalidAction,
    ParsedAction,
    Submit,
    parse_action,
)
from belayer_grpo._agentic.context import AgentTask, TokenContext, render_observation, render_prompt
from belayer_grpo._agentic.environment import SandboxFailure, context_ref, parse_context_ref, repository_hash
from belayer_grpo._agentic.image import DEFAULT_BASE_IMAGE, build_task_image
from belayer_grpo._agentic.loop import AgentLoop
from belayer_grpo._agentic.pool import SandboxLease, SandboxPool
from belayer_grpo._agentic.records import (
    AgenticTrajectory,
    CheckpointRecord,
    RecoveryRecord,
    count_kinds,
    summarize,
)
from belayer_grpo._agentic.rollout import RolloutStats, default_estimators, run_agentic_rollouts
from belayer_grpo._agentic.samples import to_samples
from belayer_grpo._agentic.settings import AgenticConfig
from belayer_grpo._agentic.swegym import SweTask, builtin_tasks, load_swegym
from belayer_grpo._agentic.tooluse import ToolObservation, ToolUseTask, generate_tooluse_tasks
from belayer_grpo._errors import (
    SandboxImageError,
    TaskFormatError,
    TrajectoryFailedError,
    UnrecoverableTrajectoryError,
)

__all__ = [
    "DEFAULT_BASE_IMAGE",
    "AgentLoop",
    "AgentTask",
    "AgenticConfig",
    "AgenticTrajectory",
    "Answer",
    "BashAction",
    "CheckpointRecord",
    "InvalidAction",
    "ParsedAction",
    "RecoveryRecord",
    "RolloutStats",
    "SandboxFailure",
    "SandboxImageError",
    "SandboxLease",
    "SandboxPool",
    "Submit",
    "SweTask",
    "TaskFormatError",
    "TokenContext",
    "ToolObservation",
    "ToolUseTask",
    "TrajectoryFailedError",
    "UnrecoverableTrajectoryError",
    "build_task_image",
    "builtin_tasks",
    "context_ref",
    "count_kinds",
    "default_estimators",
    "generate_tooluse_tasks",
    "load_swegym",
    "parse_action",
    "parse_context_ref",
    "render_observation",
    "render_prompt",
    "repository_hash",
    "run_agentic_rollouts",
    "summarize",
    "to_samples",
]
