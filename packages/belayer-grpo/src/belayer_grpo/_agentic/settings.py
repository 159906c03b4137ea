"""`AgenticConfig`: every knob of the agentic rollout, validated when it is built."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from belayer_policy import PolicySpec

__all__ = ["AgenticConfig"]

_ge0 = attrs.validators.ge(0)
_ge1 = attrs.validators.ge(1)
_float_ge0 = attrs.validators.ge(0.0)
_float_gt0 = attrs.validators.gt(0.0)


def _policy(_instance: object, _attribute: Any, value: str) -> None:
    PolicySpec.parse(value)  # raises PolicyArgumentError (a ValueError) naming the bad value


def _token_ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(token) for token in value)


def _probability(_instance: object, attribute: Any, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


@attrs.frozen
class AgenticConfig:
    """How agentic trajectories are rolled out.

    ``checkpoint_policy`` is a belayer-policy name (``adaptive``, ``always``, ``never``,
    ``every:K``).  ``sandbox_kill_probability`` is the chaos knob: each environment step kills the
    trajectory's sandbox with that probability.  ``policy_failure_probability``, when set, tells
    the adaptive policy the per-step failure probability instead of learning a hazard online
    (the fault-injection setting); it defaults to the kill probability when that is positive.
    ``invalid_action``: ``end`` finishes the episode at a response without an action,
    ``feedback`` answers it with a hint and goes on (it counts as a round).
    ``sandbox_kill_at_actions``: deterministic chaos, each trajectory's sandbox is killed right
    after its action number k (once per k), e.g. to compare recoveries on the same failures.
    ``sandbox_recovery``: ``checkpoint`` (restore the latest ready checkpoint and its ``L_turn``,
    or start over from the image and the prompt: always prefix-consistent) or ``image``, the
    control without recovery: a fresh container from the image while the agent keeps its context
    (only the failed turn is taken again), so the sandbox's state is silently lost; or ``replay``,
    what a harness without Belayer does: a fresh container from the image in which every committed
    action is run again verbatim, the agent keeping its context (only the failed turn is taken
    again); an action whose effect differs on re-execution leaves the sandbox unlike what the
    agent saw (the recovery records whether the replayed outputs equal the observations).
    ``on_unrecoverable``: what becomes of a trajectory that cannot be recovered (over
    ``max_recoveries`` sandbox failures, a restart that fails twice, a checkpoint that fails
    verification with no earlier one): ``resample`` samples its whole group again with fresh
    sandboxes, up to ``max_resamples`` times, then drops the group from the batch; ``drop`` drops
    the group at once; ``fail`` ends the rollout with `RolloutError`.  A group never enters the
    batch with a trajectory that did not finish.
    """

    checkpoint_root: Path = attrs.field(converter=Path)
    image: str | None = None
    base_image: str = "belayer/debian-python:latest"
    max_rounds: int = attrs.field(default=20, validator=_ge1)
    max_response_tokens: int = attrs.field(default=256, validator=_ge1)
    max_context_tokens: int = attrs.field(default=8192, validator=_ge1)
    temperature: float = attrs.field(default=1.0, validator=_float_ge0)
    top_p: float = attrs.field(default=1.0, validator=[_float_gt0, attrs.validators.le(1.0)])
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    seed: int = attrs.field(default=0, validator=_ge0)
    checkpoint_policy: str = attrs.field(default="adaptive", validator=_policy)
    policy_extra_cost_s: float = attrs.field(default=0.0, validator=_float_ge0)
    policy_cooldown_s: float = attrs.field(default=20.0, validator=_float_ge0)
    policy_failure_probability: float | None = attrs.field(default=None)
    sandbox_kill_probability: float = attrs.field(default=0.0, validator=_probability)
    sandbox_kill_at_actions: tuple[int, ...] = attrs.field(default=(), converter=_token_ids)
    sandbox_recovery: str = attrs.field(
        default="checkpoint", validator=attrs.validators.in_(("checkpoint", "image", "replay"))
    )
    max_recoveries: int = attrs.field(default=100, validator=_ge0)
    on_unrecoverable: str = attrs.field(
        default="resample", validator=attrs.validators.in_(("resample", "drop", "fail"))
    )
    max_resamples: int = attrs.field(default=2, validator=_ge0)
    max_concurrency: int = attrs.field(default=8, validator=_ge1)
    # Started spare containers per sandbox configuration that restores go into (`SandboxPool.spares`).
    spare_sandboxes: int = attrs.field(default=1, validator=_ge0)
    action_timeout_s: float = attrs.field(default=30.0, validator=_float_gt0)
    test_timeout_s: float = attrs.field(default=120.0, validator=_float_gt0)
    max_observation_chars: int = attrs.field(default=2000, validator=_ge1)
    invalid_action: str = attrs.field(default="end", validator=attrs.validators.in_(("end", "feedback")))
    keep_checkpoints: bool = False
    # True: the next response waits for every decided checkpoint (the `blocking` baseline);
    # False: the checkpoint overlaps the next response and only what is left of it is waited for.
    checkpoint_blocking: bool = False
    run_label: str = ""  # labels every sandbox `belayer.grpo.run=<run_label>`, so a dead run's are found
    # True: turn T's router request id is `<trajectory_id>-t<T>`, so a trajectory run again after a
    # trainer's kill gets the turns the router still holds instead of generating them again
    # (`system.resume_grace_s > 0`); a turn whose context differs then goes under a fresh id.
    request_ids: bool = False

    @policy_failure_probability.validator
    def _check_failure_probability(self, attribute: Any, value: float | None) -> None:
        if value is not None:
            _probability(self, attribute, value)

    @property
    def failure_probability(self) -> float | None:
        """The fixed per-step failure probability the policy is told, or None to learn it."""
        if self.policy_failure_probability is not None:
            return self.policy_failure_probability
        return self.sandbox_kill_probability or None
