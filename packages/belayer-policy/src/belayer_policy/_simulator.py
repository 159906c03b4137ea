"""Trace-driven simulation of one rollout batch under a checkpoint policy.

Model (one trajectory): step ``i`` is LLM response ``r_i`` then action ``a_i``.  After step ``k``
(except the last) the policy decides (told the steps still to come, as the agent loop knows its
``max_rounds``); a checkpoint of cost ``c`` starts at once and overlaps the next
response, but the next action waits for it (actions and checkpoints exclude each other), so
``max(0, c - r)`` is visible.  It becomes ready ``c`` seconds after it started; with a timeout ``T`` and
``c > T`` it is abandoned at ``T``.  A fail-stop failure hits an attempt of a step with probability
``p`` (and wherever the trajectory schedules one), at a uniform point of the attempt's wall time.
Recovery costs ``restore_s`` and rewinds to the latest ready checkpoint (to step 0 when there
is none), and the steps since then run again.  So for every trajectory, exactly::

    rollout_s = failure_free_s + lost_s + visible_checkpoint_s

The batch ends when its last trajectory does; trajectories advance in time order so that estimators
shared across the batch learn in the order a real batch would.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Sequence

import attrs

from belayer_policy._decision import StepObservation
from belayer_policy._errors import BelayerPolicyError, PolicyArgumentError
from belayer_policy._policy import CheckpointPolicy
from belayer_policy._validate import non_negative, positive_int, probability
from belayer_policy._workload import Trajectory

__all__ = [
    "PER_ATTEMPT",
    "PER_STEP",
    "BatchOutcome",
    "SimulationConfig",
    "TrajectoryOutcome",
    "simulate_batch",
    "simulate_trajectory",
]


def _optional_positive(instance: object, attribute: object, value: float | None) -> None:
    if value is not None and not value > 0:
        raise PolicyArgumentError(f"checkpoint_timeout_s must be > 0 or None, got {value!r}")


PER_ATTEMPT = "per-attempt"
PER_STEP = "per-step"


def _streams(_instance: object, _attribute: object, value: str) -> None:
    if value not in (PER_ATTEMPT, PER_STEP):
        raise PolicyArgumentError(f"failure_streams must be {PER_ATTEMPT!r} or {PER_STEP!r}, got {value!r}")


@attrs.frozen
class SimulationConfig:
    """Failure and recovery parameters of a simulation.

    ``failure_streams`` says which random numbers decide the failures (the failure process is the
    same either way: each attempt of a step fails with ``fail_prob`` at a uniform point).
    ``per-attempt`` (the default): the trajectory's stream in attempt order, so two policies see the
    same failures only until their attempts differ (after the first failure).  ``per-step``: one
    stream per step of the trajectory, drawn from its stream at the start, so the ``n``-th attempt
    of step ``i`` fails alike under every policy (common random numbers that survive a restore:
    a far smaller variance of the difference between two policies).
    """

    fail_prob: float = attrs.field(default=0.0, validator=probability)
    restore_s: float = attrs.field(default=2.0, validator=non_negative)
    checkpoint_timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    max_step_attempts: int = attrs.field(default=1_000_000, validator=positive_int)
    failure_streams: str = attrs.field(default=PER_ATTEMPT, validator=_streams)


@attrs.frozen
class TrajectoryOutcome:
    """What one trajectory cost under one policy."""

    rollout_s: float
    failure_free_s: float
    lost_s: float
    visible_checkpoint_s: float
    num_checkpoints: int
    num_failures: int


@attrs.frozen
class _Pending:
    prefix: int
    started_at: float
    cost: float
    timed_out: bool
    duration: float  # how long it occupies the container: its cost, or the timeout


@attrs.define
class _TrajectoryRun:
    trajectory: Trajectory
    policy: CheckpointPolicy
    config: SimulationConfig
    rng: random.Random
    now: float = 0.0
    prefix: int = 0
    ready_prefix: int = 0
    pending: _Pending | None = None
    lost: float = 0.0
    visible: float = 0.0
    num_checkpoints: int = 0
    num_failures: int = 0
    attempts: int = 0
    _scheduled: dict[int, deque[float]] = attrs.field(factory=dict)
    _work_before: list[float] = attrs.field(factory=list)
    _step_rngs: list[random.Random] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        if self.config.failure_streams == PER_STEP:
            self._step_rngs = [
                random.Random(self.rng.getrandbits(64)) for _ in range(self.trajectory.num_steps)
            ]
        for failure in self.trajectory.failures:
            self._scheduled.setdefault(failure.step, deque()).append(failure.at)
        steps = zip(self.trajectory.response_s, self.trajectory.action_s, strict=True)
        self._work_before = [0.0, *itertools.accumulate(r + a for r, a in steps)]

    @property
    def done(self) -> bool:
        return self.prefix >= self.trajectory.num_steps

    def outcome(self) -> TrajectoryOutcome:
        return TrajectoryOutcome(
            rollout_s=self.now,
            failure_free_s=self.trajectory.failure_free_s,
            lost_s=self.lost,
            visible_checkpoint_s=self.visible,
            num_checkpoints=self.num_checkpoints,
            num_failures=self.num_failures,
        )

    def advance(self) -> None:
        """Run one attempt of the next step."""
        self.attempts += 1
        if self.attempts > self.config.max_step_attempts:
            raise BelayerPolicyError(
                f"a trajectory needed more than {self.config.max_step_attempts} step attempts: lower "
                "fail_prob or raise max_step_attempts"
            )
        i = self.prefix
        response, action = self.trajectory.response_s[i], self.trajectory.action_s[i]
        wait = max(0.0, self.pending.duration - response) if self.pending else 0.0
        wall = response + wait + action
        failure_at = self._draw_failure(i, wall)
        if failure_at is None:
            self._resolve_pending(wall)
            self.now += wall
            self.visible += wait
            self.prefix += 1
            if not self.done:
                self._decide(response, action)
            else:
                last = StepObservation(
                    self.prefix, response, action, self.now, remaining_steps=0, checkpoint_kind=self._kind()
                )
                self.policy.on_trajectory_end(self.trajectory.num_steps, last)
            return
        self._resolve_pending(failure_at)
        self.pending = None
        self.policy.on_failure(self.now + failure_at, exposure_s=failure_at)
        visible_part = min(max(failure_at - response, 0.0), wait)
        self.visible += visible_part
        redone = self._work_before[i] - self._work_before[self.ready_prefix]
        self.lost += redone + (failure_at - visible_part) + self.config.restore_s
        self.now += failure_at + self.config.restore_s
        self.num_failures += 1
        self.prefix = self.ready_prefix
        self.policy.on_restore(self.config.restore_s)

    def _draw_failure(self, step: int, wall: float) -> float | None:
        # Draw both numbers every attempt so that policies see the same random stream for longer.
        rng = self._step_rngs[step] if self._step_rngs else self.rng
        hit, where = rng.random(), rng.random()
        scheduled = self._scheduled.get(step)
        if scheduled:
            return scheduled.popleft() * wall
        if hit < self.config.fail_prob:
            return where * wall
        return None

    def _resolve_pending(self, within: float) -> None:
        """Report the checkpoint in flight if it finished within ``within`` seconds of this attempt."""
        pending = self.pending
        if pending is None or pending.duration > within:
            return
        if pending.timed_out:
            self.policy.on_checkpoint_timeout(
                pending.started_at + pending.duration, elapsed_s=pending.duration
            )
        else:
            self.ready_prefix = pending.prefix
            self.policy.on_checkpoint_ready(pending.cost)
        self.pending = None

    def _kind(self) -> str | None:
        """The trace's kind of a checkpoint after the step just done (None: unknown, full)."""
        kinds = self.trajectory.checkpoint_kind
        return kinds[self.prefix - 1] if kinds else None

    def _decide(self, response: float, action: float) -> None:
        obs = StepObservation(
            step_index=self.prefix,
            response_s=response,
            action_s=action,
            now=self.now,
            remaining_steps=self.trajectory.num_steps - self.prefix,
            checkpoint_kind=self._kind(),
        )
        if not self.policy.decide(obs).checkpoint:
            return
        cost = self.trajectory.checkpoint_s[self.prefix - 1]
        timeout = self.config.checkpoint_timeout_s
        timed_out = timeout is not None and cost > timeout
        duration = timeout if timed_out and timeout is not None else cost
        self.pending = _Pending(self.prefix, self.now, cost, timed_out, duration)
        self.num_checkpoints += 1


def simulate_trajectory(
    trajectory: Trajectory, policy: CheckpointPolicy, config: SimulationConfig, rng: random.Random
) -> TrajectoryOutcome:
    """Simulate one trajectory alone."""
    run = _TrajectoryRun(trajectory, policy, config, rng)
    while not run.done:
        run.advance()
    return run.outcome()


@attrs.frozen
class BatchOutcome:
    """One batch under one policy.

    ``lost_s`` and ``visible_checkpoint_s`` are those of the critical path: the trajectory
    that finished last.  The ``*_total_s`` fields sum over all trajectories (trajectory-seconds).
    """

    rollout_s: float
    failure_free_s: float
    lost_s: float
    visible_checkpoint_s: float
    lost_total_s: float
    visible_checkpoint_total_s: float
    num_checkpoints: int
    num_failures: int
    trajectories: tuple[TrajectoryOutcome, ...]


def simulate_batch(
    trajectories: Sequence[Trajectory],
    policies: Sequence[CheckpointPolicy],
    config: SimulationConfig,
    rngs: Sequence[random.Random],
) -> BatchOutcome:
    """Simulate a batch: trajectory ``j`` runs under ``policies[j]`` with failures from ``rngs[j]``."""
    if not trajectories:
        raise PolicyArgumentError("trajectories must not be empty")
    if not len(trajectories) == len(policies) == len(rngs):
        raise PolicyArgumentError("trajectories, policies and rngs must have the same length")
    runs = [_TrajectoryRun(t, p, config, r) for t, p, r in zip(trajectories, policies, rngs, strict=True)]
    queue = [(0.0, j) for j in range(len(runs))]
    while queue:
        _, j = heapq.heappop(queue)
        run = runs[j]
        run.advance()
        if not run.done:
            heapq.heappush(queue, (run.now, j))
    outcomes = tuple(run.outcome() for run in runs)
    critical = max(outcomes, key=lambda o: o.rollout_s)
    return BatchOutcome(
        rollout_s=critical.rollout_s,
        failure_free_s=max(o.failure_free_s for o in outcomes),
        lost_s=critical.lost_s,
        visible_checkpoint_s=critical.visible_checkpoint_s,
        lost_total_s=sum(o.lost_s for o in outcomes),
        visible_checkpoint_total_s=sum(o.visible_checkpoint_s for o in outcomes),
        num_checkpoints=sum(o.num_checkpoints for o in outcomes),
        num_failures=sum(o.num_failures for o in outcomes),
        trajectories=outcomes,
    )
