"""Recording what a trajectory did, as the policy saw it, in the simulator's trace format.

The policy already hears every step (``decide``), every ready checkpoint, failure and restore, so
it can write the trace itself: the agent loop only saves :meth:`CheckpointPolicy.recorded_trajectory`
with :func:`append_trace`.  A step that was redone after a restore keeps its last attempt.
"""

from __future__ import annotations

import attrs

from belayer_policy._trace import fill_checkpoint_costs
from belayer_policy._workload import ScheduledFailure, Trajectory

__all__ = ["TraceRecorder"]

_LAST_FRACTION = 0.999  # a failure "at" must lie in [0, 1)


@attrs.define
class TraceRecorder:
    """Steps, checkpoint costs, failures and restore times of one trajectory."""

    _steps: list[tuple[float, float]] = attrs.field(init=False, factory=list)
    _checkpoints: dict[int, float] = attrs.field(init=False, factory=dict)
    _kinds: dict[int, str | None] = attrs.field(init=False, factory=dict)
    _failures: list[tuple[int, float]] = attrs.field(init=False, factory=list)
    _restores: list[float] = attrs.field(init=False, factory=list)

    def step(self, step_index: int, response_s: float, action_s: float, kind: str | None = None) -> None:
        """Step ``step_index`` (1-based prefix length after it) committed; a checkpoint after it
        would be of ``kind`` (None: unknown)."""
        self._kinds[step_index] = kind
        del self._steps[step_index - 1 :]
        self._steps.extend([(0.0, 0.0)] * (step_index - 1 - len(self._steps)))
        self._steps.append((response_s, action_s))

    @property
    def work_s(self) -> float:
        """Failure-free seconds of the recorded prefix: its responses and actions."""
        return sum(response + action for response, action in self._steps)

    def checkpoint(self, step_index: int, cost_s: float, kind: str | None = None) -> None:
        """A checkpoint of ``kind`` of prefix ``step_index`` became ready after ``cost_s`` seconds."""
        self._checkpoints[step_index] = cost_s
        if kind is not None:
            self._kinds[step_index] = kind

    def failure(self, step_index: int, exposure_s: float) -> None:
        """The attempt of the step after prefix ``step_index`` failed ``exposure_s`` seconds in."""
        self._failures.append((step_index, exposure_s))

    def restore(self, restore_s: float) -> None:
        """A restore took ``restore_s`` seconds."""
        self._restores.append(restore_s)

    def trajectory(
        self, *, task: str | None = None, node: str | None = None, default_checkpoint_s: float = 0.5
    ) -> Trajectory | None:
        """The recorded trajectory (``None`` before the first step).

        Steps without a measured checkpoint get the mean measured cost of a full one
        (``default_checkpoint_s`` when none was measured); the kinds of the checkpoints taken are
        kept (``checkpoint_kind``: the kind taken, else the kind the step was told, when any was told); a failure's ``at`` is its exposure over the duration of the
        step's committed attempt.
        """
        if not self._steps:
            return None
        n = len(self._steps)
        kinds = [self._kinds.get(k) for k in range(1, n + 1)]
        costs = fill_checkpoint_costs(
            [self._checkpoints.get(k) for k in range(1, n + 1)], n, default_checkpoint_s, kinds
        )
        failures = []
        for step, exposure in self._failures:
            if step >= n:
                continue  # the failed step never committed: nothing to replay it against
            response, action = self._steps[step]
            wall = response + action
            at = min(exposure / wall, _LAST_FRACTION) if wall > 0 else 0.0
            failures.append(ScheduledFailure(step, at))
        return Trajectory(
            [r for r, _ in self._steps],
            [a for _, a in self._steps],
            costs,
            failures,
            restore_s=self._restores,
            task=task,
            node=node,
            checkpoint_kind=kinds if any(kind is not None for kind in kinds) else (),
        )
