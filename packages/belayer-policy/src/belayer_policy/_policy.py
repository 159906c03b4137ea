"""The checkpoint policy the agent loop calls after every step, and its decision rules.

One :class:`CheckpointPolicy` per trajectory holds that trajectory's state (``C_t``, a checkpoint in
flight, the cooldown).  The estimators (failure model, response times, checkpoint costs) may be
shared by all trajectories of a batch so that they learn from every trajectory at once.
"""

from __future__ import annotations

import math

import attrs

from belayer_policy._calibration import ClockProbe, CostCalibration
from belayer_policy._decision import Decision, Reason, StepObservation
from belayer_policy._estimators import (
    CheckpointCostModel,
    RegenerationCost,
    ResponseTimeModel,
    RestoreCostModel,
    TrajectoryLengthModel,
)
from belayer_policy._hazard import FailureModel, OnlineHazard
from belayer_policy._kinds import FRESH_RUNTIME, FULL, REFERENCE, KindCosts, check_kind
from belayer_policy._pooled import CostModel
from belayer_policy._recorder import TraceRecorder
from belayer_policy._rules import AdaptiveRule, DecisionRule, PaperRule, StepContext, Verdict, paper_sides
from belayer_policy._validate import (
    non_negative,
    positive_int,
    renamed_keywords,
    require_non_negative,
    unit_fraction,
)
from belayer_policy._workload import Trajectory

__all__ = ["CheckpointPolicy"]

# Standard deviations of its remaining steps by which a trajectory's projected end is lowered
# before it is compared with the finished ones: one projected to outlast them all early, on a few
# slow responses, still competes with them until the projection is sure.
_PROJECTION_DOUBT = 2.0


@attrs.define
class CheckpointPolicy:
    """Decides after each committed step of one trajectory whether to take a full checkpoint now.

    Protocol for the agent loop: ``decide(obs)`` after every step; after a ``checkpoint=True``
    decision exactly one of ``on_checkpoint_ready(cost_s)``, ``on_checkpoint_timeout(now)`` or
    ``on_failure(now)``; after a failure and restore, ``on_restore()``; at the end
    ``on_trajectory_end(num_steps)``.  Two guards apply to every rule: no new checkpoint while one
    is in flight, none during the cooldown after a timeout.  ``batch_size`` is the number of
    trajectories whose slowest ends the batch (the adaptive rule weighs failures by it).
    """

    rule: DecisionRule = attrs.field(factory=AdaptiveRule)
    failure_model: FailureModel = attrs.field(factory=OnlineHazard)
    response_times: ResponseTimeModel = attrs.field(factory=ResponseTimeModel)
    checkpoint_costs: CostModel = attrs.field(factory=CheckpointCostModel)
    extra_cost_s: float = attrs.field(default=0.0, validator=non_negative)
    cooldown_s: float = attrs.field(default=20.0, validator=non_negative)
    step_smoothing: float = attrs.field(default=0.3, validator=unit_fraction)
    restore_costs: RestoreCostModel = attrs.field(factory=RestoreCostModel)
    trajectory_lengths: TrajectoryLengthModel = attrs.field(factory=TrajectoryLengthModel)
    batch_size: int = attrs.field(default=1, validator=positive_int)
    kind_costs: KindCosts = attrs.field(factory=KindCosts)
    cost_calibration: CostCalibration = attrs.field(factory=CostCalibration)
    _clock: ClockProbe = attrs.field(
        init=False, default=attrs.Factory(lambda self: ClockProbe(self.cost_calibration), takes_self=True)
    )
    _regeneration: RegenerationCost = attrs.field(init=False, factory=RegenerationCost)
    _cooldown_until: float = attrs.field(init=False, default=float("-inf"))
    _action_estimate: float | None = attrs.field(init=False, default=None)
    _recorder: TraceRecorder = attrs.field(init=False, factory=TraceRecorder)
    _prefix: int = attrs.field(init=False, default=0)
    _captured_prefix: int = attrs.field(init=False, default=0)
    _ready_prefix: int = attrs.field(init=False, default=0)
    _probing: bool = attrs.field(init=False, default=False)
    _pending_kind: str | None = attrs.field(init=False, default=None)
    _start_s: float | None = attrs.field(init=False, default=None)
    _last_now: float = attrs.field(init=False, default=0.0)

    @property
    def name(self) -> str:
        """The rule's name."""
        return self.rule.name

    @property
    def regeneration_s(self) -> float:
        """Current ``C_t`` in seconds."""
        return self._regeneration.cost_s

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether a decided checkpoint has not been reported ready, timed out or lost yet."""
        return self._regeneration.in_flight

    def decide(self, obs: StepObservation) -> Decision:
        """Record the step, then decide whether to checkpoint the prefix ``obs.step_index`` now."""
        context = self._observe(obs)
        verdict: Verdict
        if self._regeneration.in_flight:
            verdict = self._guard(Reason.CHECKPOINT_IN_FLIGHT, context)
        elif obs.now < self._cooldown_until:
            verdict = self._guard(Reason.COOLDOWN, context)
        else:
            verdict = self.rule.choose(context)
            if verdict.checkpoint and self._cost_unknown_and_probed(obs.checkpoint_kind):
                verdict = self._guard(Reason.COST_PROBE_IN_FLIGHT, context)
            elif isinstance(self.rule, AdaptiveRule) and self._probe_may_help(verdict, obs.checkpoint_kind):
                verdict = self.rule.probe(context)
        if verdict.checkpoint:
            raw = self._cost_model(obs.checkpoint_kind)
            self._clock.started(obs, obs.checkpoint_kind, raw.estimate if raw.num_observations else 0.0)
            self._regeneration.capture()
            self._captured_prefix = obs.step_index
            self._pending_kind = obs.checkpoint_kind
            costs = self.checkpoint_costs
            if costs.num_observations == 0 and self.kind_costs.model(obs.checkpoint_kind) is None:
                self._probing = True
                if costs.probes_in_flight == 0:
                    costs.probe_started_at = obs.now
                costs.probes_in_flight += 1
        return Decision(
            checkpoint=verdict.checkpoint,
            reason=verdict.reason,
            policy=self.rule.name,
            step_index=obs.step_index,
            now=obs.now,
            benefit_s=verdict.benefit_s,
            visible_cost_s=verdict.visible_cost_s,
            failure_probability=context.failure_probability,
            regeneration_s=context.regeneration_s,
            checkpoint_cost_s=context.checkpoint_cost_s,
            hidden_probability=context.hidden_probability,
            hazard=verdict.hazard,
            remaining_steps=context.remaining_steps,
            step_s=context.step_s,
            restore_cost_s=self.restore_costs.estimate,
            contenders=context.batch_size,
            checkpoint_kind=obs.checkpoint_kind or FULL,
        )

    def _observe(self, obs: StepObservation) -> StepContext:
        """Learn from the step and gather every estimate the rule may weigh."""
        step_s = obs.response_s + obs.action_s
        if self._start_s is None:
            self._start_s = obs.now - obs.response_elapsed_s - step_s
        self._last_now = obs.now
        if self._regeneration.in_flight:
            self._clock.forget()  # the checkpoint outlived the step: its wait is not on this clock
        self._clock.step(obs)
        self._recorder.step(obs.step_index, obs.response_s, obs.action_s, obs.checkpoint_kind)
        self._prefix = obs.step_index
        self._regeneration.add(step_s)
        self.failure_model.observe_exposure(step_s)
        self.response_times.observe(obs.response_s)
        if self._action_estimate is None:
            self._action_estimate = obs.action_s
        else:
            self._action_estimate += self.step_smoothing * (obs.action_s - self._action_estimate)
        # A future step: the batch's mean response (the shared window, not this trajectory's last
        # few: a heavy tail would swing them) plus this trajectory's own actions.
        expected_step = self.response_times.mean + self._action_estimate
        duration = expected_step if obs.next_step_s is None else obs.next_step_s
        cost = self._cost_estimate(obs.now, obs.checkpoint_kind)
        # A later checkpoint follows changes: fresh-runtime where the sandbox's runtime holds no
        # state (this one would be fresh-runtime or a reference), else full.
        stateless = obs.checkpoint_kind in (FRESH_RUNTIME, REFERENCE)
        future_cost = self._cost_estimate(obs.now, FRESH_RUNTIME if stateless else FULL)
        remaining = (
            self.trajectory_lengths.remaining(obs.step_index)
            if obs.remaining_steps is None
            else obs.remaining_steps
        )
        return StepContext(
            step_index=obs.step_index,
            regeneration_s=self._regeneration.cost_s,
            step_s=duration,
            failure_probability=self.failure_model.failure_probability(duration),
            checkpoint_cost_s=cost,
            hidden_probability=self.response_times.hidden_probability(obs.response_elapsed_s, cost),
            visible_now_s=self.response_times.expected_visible(obs.response_elapsed_s, cost),
            visible_future_s=self.response_times.expected_visible(0.0, future_cost),
            extra_cost_s=self.extra_cost_s,
            remaining_steps=remaining,
            batch_size=self._contenders(
                obs.step_index + remaining,
                # the projection's doubt: the spread of the remaining steps' responses
                self._elapsed_s(obs.now)
                + remaining * duration
                - _PROJECTION_DOUBT * self.response_times.std * math.sqrt(remaining),
            ),
            step_sd_s=self.response_times.std,
            restore_s=self.restore_costs.estimate,
        )

    def _cost_unknown_and_probed(self, kind: str | None) -> bool:
        """Whether a rule that weighs the cost must wait: the cost of a checkpoint of ``kind`` was
        never measured and another trajectory's checkpoint is measuring it right now.

        Until then the cost is the prior, or only as long as that probe has run so far; every
        trajectory of a batch that decides on it would take a checkpoint of unknown cost, and one
        probe already buys the measurement.  So the batch takes one probe at a time (a fixed
        baseline is not held back).
        """
        if not isinstance(self.rule, AdaptiveRule | PaperRule):
            return False
        costs = self.checkpoint_costs
        return (
            costs.num_observations == 0 and costs.probes_in_flight > 0 and self.kind_costs.model(kind) is None
        )

    def _probe_may_help(self, verdict: Verdict, kind: str | None) -> bool:
        """Whether the rule declined a full checkpoint on a cost never measured, with no probe of it
        in flight: then one cost probe may pay (`AdaptiveRule.probe`).

        The cheap kinds' priors come from envckpt's measurements; the full prior is a guess.
        """
        costs = self.checkpoint_costs
        return (
            verdict.reason is Reason.COST_EXCEEDS_BENEFIT
            and self.kind_costs.model(kind) is None
            and costs.num_observations == 0
            and costs.probes_in_flight == 0
        )

    def _contenders(self, total_steps: float, projected_s: float) -> int:
        """Trajectories of the batch that compete with this one for the critical path.

        The batch waits for its slowest trajectory, and one with fewer steps than this one rarely
        is it: so of ``batch_size`` only the share at least as long as this one (from the lengths
        of finished trajectories; all of them before any finished) counts, and at least itself.
        Long is in steps and, once trajectories finished, in seconds on the clock: ``projected_s``
        is this one's time so far plus its expected remaining steps, against the finished ones'
        whole time (their failures, restores and waits included: where failures are frequent the
        others' losses can overtake this one, and their times show it).  A trajectory projected
        to outlast the others is the batch's critical path on its own: their slack absorbs their
        losses, so it weighs failures at about its own rate, while its checkpoints' visible time
        lengthens the batch in full (slack-aware, 0.8.0).
        """
        shares = [
            share
            for share in (
                self.trajectory_lengths.share_at_least(total_steps),
                self.trajectory_lengths.share_lasting_at_least(projected_s),
            )
            if share is not None
        ]
        if not shares:
            return self.batch_size
        share = min(shares)
        return max(1, min(self.batch_size, math.ceil(self.batch_size * share - 1e-9)))

    def _elapsed_s(self, now: float) -> float:
        """Seconds since the trajectory started on the clock (its losses, waits and restores
        included), at least its failure-free work (where ``now`` is no wall clock)."""
        wall = 0.0 if self._start_s is None else now - self._start_s
        return max(wall, self._recorder.work_s)

    def _cost_estimate(self, now: float, kind: str | None = None) -> float:
        """``c_t`` of a checkpoint of ``kind`` (None: full), calibrated against the clock; before the
        first measurement of a full checkpoint at least as long as the oldest probe has run."""
        estimate = self._cost_model(kind).estimate * self.cost_calibration.factor(kind)
        costs = self.checkpoint_costs
        started = costs.probe_started_at
        if self.kind_costs.model(kind) is None and costs.num_observations == 0 and started is not None:
            return max(estimate, now - started)
        return estimate

    def _end_probe(self) -> None:
        if self._probing:
            self._probing = False
            self.checkpoint_costs.probes_in_flight -= 1
            if self.checkpoint_costs.probes_in_flight == 0:
                self.checkpoint_costs.probe_started_at = None

    @staticmethod
    def _guard(reason: Reason, context: StepContext) -> Verdict:
        benefit, visible = paper_sides(context)
        return Verdict(False, reason, benefit, visible, context.failure_probability)

    def observe_response(self, response_s: float) -> None:
        """Add a response time that did not come through :meth:`decide` (for example a resumed one)."""
        self.response_times.observe(response_s)

    def on_checkpoint_ready(self, cost_s: float, kind: str | None = None) -> None:
        """The decided checkpoint is ready after ``cost_s`` seconds: ``C_t`` drops to the work since it.

        ``kind`` is the kind envckpt took (its manifest's ``kind``); by default the one the decision
        was told.  The cost is learned by that kind's estimate.
        """
        cost_s = require_non_negative("cost_s", cost_s)
        kind = self._pending_kind if kind is None else check_kind(kind)
        self._regeneration.mark_ready()
        self._end_probe()
        self._ready_prefix = self._captured_prefix
        self._recorder.checkpoint(self._ready_prefix, cost_s, kind)
        self._cost_model(kind).observe(cost_s)
        self._pending_kind = None

    def _cost_model(self, kind: str | None) -> CostModel:
        cheap = self.kind_costs.model(kind)
        return self.checkpoint_costs if cheap is None else cheap

    def on_checkpoint_timeout(self, now: float, elapsed_s: float | None = None) -> None:
        """The decided checkpoint exceeded its timeout at ``now``: start the cooldown.

        ``elapsed_s`` (seconds it ran before being abandoned), when given, is recorded as a lower
        bound of the checkpoint cost so that the cost estimate reflects the load that caused the
        timeout.
        """
        now = require_non_negative("now", now)
        self._regeneration.abandon()
        self._end_probe()
        self._clock.forget()
        self._cooldown_until = now + self.cooldown_s
        if elapsed_s is not None:
            self._cost_model(self._pending_kind).observe(elapsed_s)
        self._pending_kind = None

    def on_failure(self, now: float, exposure_s: float = 0.0, **deprecated: float) -> None:
        """The container failed at ``now``, ``exposure_s`` into a step not yet reported.

        A checkpoint in flight is lost; the previous ready one stays the restore point.
        (``exposure_seconds=`` still works, with a ``DeprecationWarning``.)
        """
        exposure_s = renamed_keywords("on_failure", deprecated, {"exposure_seconds": "exposure_s"}).get(
            "exposure_s", exposure_s
        )
        require_non_negative("now", now)
        self._recorder.failure(self._prefix, exposure_s)
        self.failure_model.observe_exposure(exposure_s)
        self.failure_model.observe_failure()
        self._clock.forget()
        self._regeneration.abandon()
        self._end_probe()
        self._pending_kind = None

    def on_restore(self, restore_s: float | None = None) -> None:
        """The environment and LLM context went back to the latest ready checkpoint (or the start).

        ``restore_s``, when given, is the measured restore time (learned, and logged with decisions).
        """
        self._regeneration.restore()
        self._prefix = self._ready_prefix
        if restore_s is not None:
            self.restore_costs.observe(restore_s)
            self._recorder.restore(restore_s)

    def on_trajectory_end(self, num_steps: int, last_step: StepObservation | None = None) -> None:
        """The trajectory finished after ``num_steps`` steps (learned for the expected remaining steps).

        ``last_step`` is a final step that got no decision (it is recorded and its response learned).
        """
        if last_step is not None:
            self._clock.step(last_step)
            self._recorder.step(
                last_step.step_index, last_step.response_s, last_step.action_s, last_step.checkpoint_kind
            )
            self.response_times.observe(last_step.response_s)
        end = self._last_now if last_step is None else last_step.now
        self.trajectory_lengths.observe(num_steps, duration_s=self._elapsed_s(end))

    def recorded_trajectory(self, *, task: str | None = None, node: str | None = None) -> Trajectory | None:
        """What this trajectory did so far in the simulator's trace format (``None`` before a step).

        Save it with :func:`append_trace`; ``task`` and ``node`` label the record.
        """
        return self._recorder.trajectory(
            task=task, node=node, default_checkpoint_s=self.checkpoint_costs.estimate
        )
