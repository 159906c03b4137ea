"""Agentic trajectories as the trainer's `Sample`s: one completion = everything after the prompt.

Observations and feedback are part of the completion (the policy conditions on them) but carry
loss mask 0 and logprob 0, so only the tokens the policy generated are trained on.
"""

from __future__ import annotations

from collections.abc import Sequence

from belayer_grpo._agentic.records import AgenticTrajectory
from belayer_grpo._rollout_math import Sample

__all__ = ["to_samples"]


def to_samples(trajectories: Sequence[AgenticTrajectory]) -> list[Sample]:
    """One `Sample` per trajectory, grouped by task (``group`` = the trajectory's group index)."""
    samples = []
    for trajectory in trajectories:
        start = trajectory.num_prompt_tokens
        samples.append(
            Sample(
                group=trajectory.group_index,
                prompt_ids=trajectory.token_ids[:start],
                completion_ids=trajectory.token_ids[start:],
                logprobs=trajectory.logprobs[start:],
                loss_mask=trajectory.loss_mask[start:],
                reward=trajectory.reward,
                finish_reason=trajectory.finish,
                num_resumes=trajectory.num_resumed_responses,
            )
        )
    return samples
