"""The adaptive rule: the renewal comparison, the batch weight, pooled estimates, the cost probe."""

from __future__ import annotations

import math
from statistics import NormalDist

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from belayer_policy import (
    AdaptiveRule,
    CheckpointCostModel,
    CheckpointPolicy,
    FixedStepProbability,
    PolicySpec,
    Reason,
    RenewalLoss,
    ResponseTimeModel,
    SharedEstimators,
    SimulationConfig,
    StepContext,
    StepObservation,
    Trajectory,
    TrajectoryLengthModel,
    UniformRange,
    Workload,
    batch_step_hazard,
    compare_now_and_later,
    compare_policies,
    protected_cost,
)


def test_protected_cost_by_hand() -> None:
    # 4 steps, a = 1, v = 1: k whole-step stretches cost (k - 1) + sum(L^2) / 2:
    # [4] 8, [2, 2] 1 + 4 = 5, [2, 1, 1] 2 + 3 = 5, [1, 1, 1, 1] 3 + 2 = 5
    assert protected_cost(4, 1.0, 1.0) == 5.0
    # 6 steps, a = 1, v = 2: [6] 18, [3, 3] 2 + 9 = 11, [2, 2, 2] 4 + 6 = 10, [2, 2, 1, 1] 6 + 5 = 11
    assert protected_cost(6, 1.0, 2.0) == 10.0
    # free checkpoints: one per step, each step half a step of expected loss
    assert protected_cost(4, 1.0, 0.0) == pytest.approx(2.0)
    assert protected_cost(0, 1.0, 1.0) == 0.0


def test_now_or_later_by_hand() -> None:
    # u = 2 unprotected steps, m = 2 to go, a = 1, v = 1.
    # now: best of one stretch (2 * 2 / 2 = 2) or two (1 + 2 * 1 / 2 = 2) = 2
    # wait 1: 1 * (1 * 2 + 1/2) + 1 + protected(1) = 2.5 + 1 + 0.5 = 4; wait 2: 2 * 2 + 2 = 6
    verdict = compare_now_and_later(2.0, 2.0, 1.0, 1.0)
    assert (verdict.now_s, verdict.later_s, verdict.delay_steps) == (2.0, 4.0, 1)
    assert verdict.saving_s == 2.0


def test_batch_weight_by_hand() -> None:
    p, steps = 0.01, 20
    rate = -math.log1p(-p)
    assert batch_step_hazard(p, steps, 1) == pytest.approx(rate)
    mu = rate * steps
    rare = 1 - (1 - math.exp(-64 * mu)) / (64 * mu)  # the largest of Poisson(64 mu) uniforms
    frequent = mu / 2 + NormalDist().inv_cdf((64 - 0.375) / 64.25) * math.sqrt(mu / 3)
    assert rare > frequent
    assert batch_step_hazard(p, steps, 64) == pytest.approx(2 * rare / steps)
    assert batch_step_hazard(0.0, steps, 64) == 0.0


def test_adaptive_decision_by_hand() -> None:
    responses = ResponseTimeModel()
    for t in (2.0, 4.0):
        responses.observe(t)
    policy = CheckpointPolicy(
        rule=AdaptiveRule(),
        failure_model=FixedStepProbability(0.1),
        response_times=responses,
        checkpoint_costs=CheckpointCostModel(initial_s=3.0),
    )
    decision = policy.decide(StepObservation(1, 3.0, 1.0, now=4.0, remaining_steps=3))
    # window {2, 3, 4}: a 3 s checkpoint leaves 1, 0, 0 s visible of responses 2, 3, 4 -> 1/3 s
    assert decision.visible_cost_s == pytest.approx(1 / 3)
    h = -math.log1p(-0.1)
    # u = 4 s / 4 s, m = 3, steps of 4 s; stretches priced under restarts with the 2 s restore prior
    expected = compare_now_and_later(1.0, 3.0, h * 4.0, 1 / 3, RenewalLoss(h, 4.0, 2.0))
    # under restarts it saves more than the first-order comparison said (0.42 s)
    assert expected.saving_s > compare_now_and_later(1.0, 3.0, h * 4.0, 1 / 3).saving_s
    assert decision.hazard == pytest.approx(h)
    assert decision.benefit_s == pytest.approx(expected.saving_s)
    assert decision.checkpoint == (expected.saving_s > 1 / 3)
    assert decision.remaining_steps == 3


def test_one_step_rule_misses_what_the_horizon_sees() -> None:
    # checkpoints longer than responses: the paper's rule compares p * C with the visible cost of
    # one step; over 19 more steps a checkpoint now protects far more.
    context = StepContext(
        step_index=3,
        regeneration_s=12.0,
        step_s=4.0,
        failure_probability=0.05,
        checkpoint_cost_s=5.0,
        hidden_probability=0.0,
        visible_now_s=2.0,
        visible_future_s=2.0,
        extra_cost_s=0.0,
        remaining_steps=17,
        batch_size=64,
    )
    assert not PolicySpec.parse("paper").rule.choose(context).checkpoint
    assert PolicySpec.parse("adaptive").rule.choose(context).checkpoint


contexts = st.builds(
    StepContext,
    step_index=st.integers(1, 50),
    regeneration_s=st.one_of(st.just(0.0), st.floats(1e-3, 500.0)),
    step_s=st.floats(0.01, 100.0),
    failure_probability=st.just(0.0),
    checkpoint_cost_s=st.floats(0.0, 30.0),
    hidden_probability=st.floats(0.0, 1.0),
    visible_now_s=st.floats(0.0, 30.0),
    visible_future_s=st.floats(0.0, 30.0),
    extra_cost_s=st.floats(0.0, 5.0),
    remaining_steps=st.integers(0, 60),
    batch_size=st.integers(1, 256),
)


@given(st.integers(1, 80), st.floats(1e-3, 60.0), st.floats(1e-2, 100.0))
def test_protected_cost_is_the_least_over_every_stretch_count(
    steps: int, rate: float, visible: float
) -> None:
    # brute force over every k: the whole-step cost is not minimised near the continuous optimum
    # once stretches are one or two steps long
    by_k = [
        (k - 1) * visible + rate * sum(length * length for length in _balanced(steps, k)) / 2.0
        for k in range(1, steps + 1)
    ]
    assert protected_cost(steps, rate, visible) == pytest.approx(min(by_k), rel=1e-9)


def _balanced(steps: int, k: int) -> list[int]:
    q, r = divmod(steps, k)
    return [q + 1] * r + [q] * (k - r)


def test_adaptive_monotone_where_the_continuous_optimum_misled_it() -> None:
    # hypothesis found it: at p = 0.28125 the plan that checkpoints now was priced with too few
    # stretches (14-17 instead of 19), so waiting looked cheaper and the rule declined, although it
    # checkpointed at p = 0.25
    context = StepContext(
        step_index=1, regeneration_s=4.0, step_s=57.0, failure_probability=0.0, checkpoint_cost_s=0.0,
        hidden_probability=0.0, visible_now_s=0.0, visible_future_s=21.0, extra_cost_s=2.0,
        remaining_steps=19, batch_size=11,
    )  # fmt: skip
    rule = AdaptiveRule()
    assert rule.choose(attrs.evolve(context, failure_probability=0.25)).checkpoint
    assert rule.choose(attrs.evolve(context, failure_probability=0.28125)).checkpoint


@given(contexts, st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_adaptive_is_monotone_in_the_hazard(context: StepContext, p1: float, p2: float) -> None:
    low, high = sorted((p1, p2))
    rule = AdaptiveRule()
    at_low = rule.choose(attrs.evolve(context, failure_probability=low))
    at_high = rule.choose(attrs.evolve(context, failure_probability=high))
    assert at_low.hazard <= at_high.hazard
    if at_low.checkpoint:
        # Monotone in what it protects: a plan with a checkpoint that beat "never" at the lower
        # hazard beats it by more at the higher one, so there the rule checkpoints now or its best
        # plan checkpoints a few steps later (delay_steps > 0). Not always *now*: where this
        # checkpoint would be followed by a second one soon, one checkpoint a step later can be
        # cheaper than both, and that window opens only at a higher hazard.
        c = attrs.evolve(context, failure_probability=high)
        rate = -math.log1p(-high)
        plan = compare_now_and_later(
            c.regeneration_s / c.step_s,
            c.remaining_steps,
            at_high.hazard * c.step_s,
            c.visible_future_s + c.extra_cost_s,
            RenewalLoss(rate, c.step_s, c.restore_s, at_high.hazard / rate),
        )
        assert at_high.checkpoint or plan.delay_steps > 0


def test_adaptive_may_wait_one_step_at_a_higher_hazard() -> None:
    # u = 1/3 unprotected steps, 2 to go, now costs 1.5 s visible, a later checkpoint 3.5 s.
    # With a = h d: never 2a(u + 1) = 2.67a; now, one stretch 1.5 + 2a; now and after step 1
    # 5 + a; wait one step 3.5 + a(u + 1) = 3.5 + 1.33a. Best: never below a = 2.25, now up to
    # a = 3, waiting from 3 to 4.5, now-and-later above.  Steps of 600 s keep the rate per step
    # below 0.01, where the loss under restarts is the first-order one within a few percent.
    context = StepContext(
        step_index=1, regeneration_s=200.0, step_s=600.0, failure_probability=0.0, checkpoint_cost_s=0.0,
        hidden_probability=0.0, visible_now_s=0.0, visible_future_s=2.0, extra_cost_s=1.5,
        remaining_steps=2, batch_size=1,
    )  # fmt: skip
    rule = AdaptiveRule()

    def decide(a: float) -> bool:
        p = -math.expm1(-a / 600.0)  # batch_size 1: the hazard is -log(1 - p) per step
        return rule.choose(attrs.evolve(context, failure_probability=p)).checkpoint

    assert [decide(a) for a in (2.0, 2.6, 3.7, 5.0)] == [False, True, False, True]


@given(contexts, st.floats(1e-6, 0.5), st.floats(0.0, 500.0))
def test_adaptive_is_monotone_in_the_work_at_risk(context: StepContext, p: float, more: float) -> None:
    rule = AdaptiveRule()
    base = attrs.evolve(context, failure_probability=p)
    if rule.choose(base).checkpoint:
        assert rule.choose(attrs.evolve(base, regeneration_s=context.regeneration_s + more)).checkpoint


@given(contexts)
def test_adaptive_never_checkpoints_without_hazard(context: StepContext) -> None:
    assert not AdaptiveRule().choose(context).checkpoint


@given(contexts, st.floats(1e-6, 0.5))
def test_adaptive_protects_work_when_checkpoints_are_free(context: StepContext, p: float) -> None:
    free = attrs.evolve(
        context, failure_probability=p, visible_now_s=0.0, visible_future_s=0.0, extra_cost_s=0.0
    )
    verdict = AdaptiveRule().choose(free)
    has_work = context.regeneration_s > 0 and context.remaining_steps >= 1
    assert verdict.checkpoint == has_work


def test_task_and_node_learn_their_own_hazard_and_cost() -> None:
    shared = SharedEstimators(failure_model=FixedStepProbability(0.01))
    flaky = PolicySpec.parse("adaptive").build(shared, task="oom", node="a")
    steady = PolicySpec.parse("adaptive").build(shared, task="calc", node="a")
    other = PolicySpec.parse("adaptive").build(shared, task="calc", node="b")
    for _ in range(20):
        flaky.failure_model.observe_exposure(5.0)
        steady.failure_model.observe_exposure(5.0)
        other.failure_model.observe_exposure(5.0)
    for _ in range(4):
        flaky.on_failure(now=1.0)
    p_flaky = flaky.failure_model.failure_probability(5.0)
    p_steady = steady.failure_model.failure_probability(5.0)
    p_other = other.failure_model.failure_probability(5.0)
    assert p_flaky > p_steady  # the task's own failures
    assert p_steady > p_other  # node "a" also saw them, node "b" did not
    assert p_other < 0.01  # calc and b: exposure without failures
    slow = PolicySpec.parse("always").build(shared, node="slow-disk")
    fast = PolicySpec.parse("always").build(shared, node="nvme")
    for cost in (8.0, 9.0, 10.0):
        assert slow.decide(StepObservation(1, 1.0, 1.0, now=0.0)).checkpoint
        slow.on_checkpoint_ready(cost)
        slow.on_failure(now=0.0)
        slow.on_restore()
    fast.decide(StepObservation(1, 1.0, 1.0, now=0.0))
    fast.on_checkpoint_ready(0.5)
    assert slow.checkpoint_costs.estimate > fast.checkpoint_costs.estimate


def test_unmeasured_cost_is_at_least_as_long_as_the_running_probe() -> None:
    shared = SharedEstimators(
        failure_model=FixedStepProbability(0.05), checkpoint_costs=CheckpointCostModel(initial_s=1.0)
    )
    first = PolicySpec.parse("always").build(shared)
    second = PolicySpec.parse("adaptive").build(shared)
    assert first.decide(StepObservation(1, 2.0, 1.0, now=3.0)).checkpoint
    late = second.decide(StepObservation(1, 8.0, 1.0, now=10.0))
    assert late.checkpoint_cost_s == 7.0  # the probe has run 7 s and is not done
    first.on_checkpoint_ready(7.5)
    after = second.decide(StepObservation(2, 8.0, 1.0, now=19.0))
    assert after.checkpoint_cost_s == 7.5
    assert shared.checkpoint_costs.probes_in_flight == (1 if late.checkpoint else 0)


def test_cooldown_after_a_timeout_still_holds_for_adaptive() -> None:
    policy = PolicySpec.parse("adaptive", cooldown_s=20.0).build(
        SharedEstimators(failure_model=FixedStepProbability(0.5))
    )
    assert policy.decide(StepObservation(1, 5.0, 1.0, now=6.0, remaining_steps=10)).checkpoint
    policy.on_checkpoint_timeout(now=8.0, elapsed_s=2.0)
    blocked = policy.decide(StepObservation(2, 5.0, 1.0, now=27.9, remaining_steps=9))
    assert (blocked.checkpoint, blocked.reason) == (False, Reason.COOLDOWN)
    assert policy.decide(StepObservation(3, 5.0, 1.0, now=28.0, remaining_steps=8)).checkpoint


def test_adaptive_beats_the_paper_rule_where_checkpoints_show() -> None:
    stress = Workload(12, UniformRange(1.0, 5.0), UniformRange(0.1, 2.0), UniformRange(2.0, 8.0))
    summaries = compare_policies(
        [PolicySpec.parse(name) for name in ("adaptive", "paper", "never")],
        config=SimulationConfig(fail_prob=0.05),
        runs=4,
        seed=5,
        workload=stress,
        num_trajectories=16,
        estimators=lambda: SharedEstimators(failure_model=FixedStepProbability(0.05)),
        carry_estimators=True,
    )
    rollout = {s.policy: s.metrics["rollout_s"].mean for s in summaries}
    assert rollout["adaptive"] < rollout["paper"]


def test_share_of_trajectories_at_least_as_long() -> None:
    lengths = TrajectoryLengthModel(window=4)
    assert lengths.share_at_least(3) is None
    for n in (1, 6, 6, 2):
        lengths.observe(n)
    assert lengths.share_at_least(6) == 0.5
    assert lengths.share_at_least(2) == 0.75
    assert lengths.share_at_least(5.6) == 0.5  # rounded to whole steps
    lengths.observe(6)  # the oldest (1) leaves the window
    assert lengths.share_at_least(2) == 1.0
    assert lengths.mean == pytest.approx((20 + 1 + 6 + 6 + 2 + 6) / 6)


def test_only_trajectories_at_least_as_long_compete_for_the_critical_path() -> None:
    shared = SharedEstimators(failure_model=FixedStepProbability(0.02), batch_size=12)
    policy = PolicySpec.parse("adaptive").build(shared)
    obs = StepObservation(2, 3.0, 0.5, now=7.0, remaining_steps=4)
    cold = policy.decide(obs)
    assert cold.contenders == 12  # no finished trajectory yet: the whole batch
    for n in (1, 1, 2, 3, 3, 4, 6, 6, 6, 6, 6, 6):
        shared.trajectory_lengths.observe(n)
    longest = PolicySpec.parse("adaptive").build(shared).decide(obs)
    assert longest.contenders == 6  # half the batch is as long as 6 steps
    shortest = PolicySpec.parse("adaptive").build(shared).decide(attrs.evolve(obs, remaining_steps=0.0))
    assert shortest.contenders == 10  # 2 steps: all but the two 1-step trajectories
    # fewer contenders, lighter weight: the longest trajectory's hazard is closer to its own rate
    assert longest.hazard < cold.hazard
    only = SharedEstimators(failure_model=FixedStepProbability(0.02), batch_size=12)
    for n in (1, 1, 2, 3, 3, 4, 5, 5, 5, 5, 5, 6):
        only.trajectory_lengths.observe(n)
    alone = PolicySpec.parse("adaptive").build(only).decide(obs)
    assert alone.contenders == 1
    assert alone.hazard == pytest.approx(-math.log1p(-0.02))


def test_a_lone_long_trajectory_is_not_weighted_like_a_full_batch() -> None:
    # One 8-step trajectory is the critical path of every batch; eleven 1-2 step ones finish early.
    # Checkpoints cost more than a response, so at p = 0.01 the best plan for the batch is never.
    long = Trajectory([3.0] * 8, [0.5] * 8, [6.0] * 8)
    short = [Trajectory([3.0] * (1 + j % 2), [0.5] * (1 + j % 2), [6.0] * (1 + j % 2)) for j in range(11)]
    summaries = compare_policies(
        [PolicySpec.parse(name) for name in ("adaptive", "never")],
        config=SimulationConfig(fail_prob=0.01),
        runs=30,
        seed=3,
        trace=[long, *short],
        estimators=lambda: SharedEstimators(failure_model=FixedStepProbability(0.01)),
        carry_estimators=True,
    )
    by_name = {s.policy: s for s in summaries}
    # after the first batch the policy knows the lengths and the long trajectory stops paying
    # visible checkpoints that the batch's weight would have bought
    assert by_name["adaptive"].metrics["checkpoints"].mean < 1.0
    assert by_name["adaptive"].metrics["rollout_s"].mean <= by_name["never"].metrics["rollout_s"].mean * 1.01


def test_share_of_trajectories_lasting_at_least_as_long() -> None:
    lengths = TrajectoryLengthModel(window=3)
    lengths.observe(4)  # no duration told: the step counts alone
    assert lengths.share_lasting_at_least(10.0) is None
    for steps, seconds in ((4, 10.0), (4, 30.0), (4, 20.0)):
        lengths.observe(steps, duration_s=seconds)
    assert lengths.share_lasting_at_least(20.0) == pytest.approx(2 / 3)
    assert lengths.share_lasting_at_least(31.0) == 0.0
    lengths.observe(4, duration_s=40.0)  # the oldest duration (10 s) leaves the window
    assert lengths.share_lasting_at_least(15.0) == 1.0


def _finish_eleven(shared: SharedEstimators) -> None:
    """Eleven 6-step trajectories of 3.5 s a step have finished (failure-free): 21 s each."""
    for _ in range(11):
        policy = PolicySpec.parse("adaptive").build(shared)
        for k in range(1, 6):
            if policy.decide(StepObservation(k, 3.0, 0.5, now=3.5 * k, remaining_steps=6 - k)).checkpoint:
                policy.on_checkpoint_ready(0.5)
        policy.on_trajectory_end(6, StepObservation(6, 3.0, 0.5, now=21.0))


def test_a_trajectory_projected_to_outlast_the_batch_weighs_its_own_rate() -> None:
    # Every trajectory has 6 steps, so the step counts see no slack; the seconds do.
    shared = SharedEstimators(failure_model=FixedStepProbability(0.02), batch_size=12)
    _finish_eleven(shared)
    own_rate = -math.log1p(-0.02)
    typical = PolicySpec.parse("adaptive").build(shared)
    usual = typical.decide(StepObservation(1, 2.9, 0.5, now=3.4, remaining_steps=5))
    assert usual.contenders == 12  # projected within the finished ones: the whole batch competes
    assert usual.hazard > 3 * own_rate
    slow = PolicySpec.parse("adaptive").build(shared)
    # one slow step: 6 s of work and 5 more steps of ~3.5 s, projected past the 21 s of the rest
    decision = slow.decide(StepObservation(1, 5.5, 0.5, now=6.0, remaining_steps=5))
    assert decision.contenders == 1
    assert decision.hazard == pytest.approx(own_rate)


def test_the_slowest_trajectory_does_not_pay_checkpoints_the_batch_weight_would_buy() -> None:
    # One 6-step trajectory three times as slow as eleven others of 6 steps is the critical path
    # of every batch.  Its checkpoints (12 s) outlast its responses (6 s), and at p = 0.02 its own
    # failures do not repay them: never is best for it; the others' checkpoints hide in their slack.
    slow = Trajectory([6.0] * 6, [3.0] * 6, [12.0] * 6)
    fast = [Trajectory([2.5] * 6, [0.5] * 6, [12.0] * 6) for _ in range(11)]
    summaries = compare_policies(
        [PolicySpec.parse(name) for name in ("adaptive", "never")],
        config=SimulationConfig(fail_prob=0.02, failure_streams="per-step"),
        runs=30,
        seed=3,
        trace=[slow, *fast],
        estimators=lambda: SharedEstimators(failure_model=FixedStepProbability(0.02)),
        carry_estimators=True,
    )
    by_name = {s.policy: s for s in summaries}
    # after the first batch the slow one knows it outlasts the rest and stops checkpointing
    assert by_name["adaptive"].metrics["visible_checkpoint_s"].mean < 1.0
    assert by_name["adaptive"].metrics["rollout_s"].mean <= by_name["never"].metrics["rollout_s"].mean * 1.01


def test_an_early_projection_within_the_responses_spread_still_competes() -> None:
    # Finished trajectories of 6 steps whose responses alternate 1 s and 5 s (21 s each): one slow
    # response early says little about the end, a very slow one does.
    shared = SharedEstimators(failure_model=FixedStepProbability(0.02), batch_size=12)
    shared.checkpoint_costs.observe(0.5)
    for _ in range(11):
        policy = PolicySpec.parse("adaptive").build(shared)
        now = 0.0
        for k in range(1, 6):
            now += (1.0 if k % 2 else 5.0) + 0.5
            if policy.decide(
                StepObservation(k, 1.0 if k % 2 else 5.0, 0.5, now=now, remaining_steps=6 - k)
            ).checkpoint:
                policy.on_checkpoint_ready(0.5)
        policy.on_trajectory_end(6, StepObservation(6, 5.0, 0.5, now=now + 5.5))
    # 5.5 s done and 5 steps of ~3.5 s: projected 23 s, past the 21 s of the others, but by less
    # than the spread of five responses (two standard deviations: ~8.9 s)
    unsure = (
        PolicySpec.parse("adaptive")
        .build(shared)
        .decide(StepObservation(1, 5.0, 0.5, now=5.5, remaining_steps=5))
    )
    assert unsure.contenders == 12
    # 20.5 s done: past the others by more than that spread
    sure = (
        PolicySpec.parse("adaptive")
        .build(shared)
        .decide(StepObservation(1, 20.0, 0.5, now=20.5, remaining_steps=5))
    )
    assert sure.contenders == 1
