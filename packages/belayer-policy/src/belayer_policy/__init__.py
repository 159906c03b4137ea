"""Adaptive, risk-aware checkpoint policy for agentic RL rollouts, and its trace-driven simulator.

After every environment step the agent loop calls :meth:`CheckpointPolicy.decide`; the policy
checkpoints iff ``p_t * C_t > c_t * (1 - q(x; c_t)) + extra_cost_s``.
"""

from __future__ import annotations

from importlib.metadata import version

from belayer_policy._calibration import ClockProbe, CostCalibration
from belayer_policy._cli import ExitCode
from belayer_policy._decision import Decision, Reason, StepObservation
from belayer_policy._errors import BelayerPolicyError, PolicyArgumentError, PolicyStateError, TraceFormatError
from belayer_policy._estimators import (
    CheckpointCostModel,
    RegenerationCost,
    ResponseTimeModel,
    RestoreCostModel,
    TrajectoryLengthModel,
)
from belayer_policy._hazard import ConstantHazard, FailureModel, FixedStepProbability, OnlineHazard
from belayer_policy._horizon import (
    HorizonVerdict,
    batch_step_hazard,
    compare_now_and_later,
    critical_share,
    protected_cost,
)
from belayer_policy._kinds import CHECKPOINT_KINDS, KIND_PRIORS_S, KindCosts
from belayer_policy._policy import CheckpointPolicy
from belayer_policy._pooled import CostModel, HazardView, KeyTable, PooledCost
from belayer_policy._renewal import RenewalLoss
from belayer_policy._report import PolicySummary, Stats, compare_policies, format_table, percentile
from belayer_policy._rules import (
    AdaptiveRule,
    AlwaysRule,
    DecisionRule,
    EveryKRule,
    NeverRule,
    PaperRule,
    StepContext,
    Verdict,
)
from belayer_policy._simulator import (
    PER_ATTEMPT,
    PER_STEP,
    BatchOutcome,
    SimulationConfig,
    TrajectoryOutcome,
    simulate_batch,
    simulate_trajectory,
)
from belayer_policy._spec import PolicySpec, SharedEstimators
from belayer_policy._trace import append_trace, load_trace, save_trace
from belayer_policy._workload import ScheduledFailure, Trajectory, UniformRange, Workload

__version__ = version("belayer-policy")

__all__ = [
    "CHECKPOINT_KINDS",
    "KIND_PRIORS_S",
    "PER_ATTEMPT",
    "PER_STEP",
    "AdaptiveRule",
    "AlwaysRule",
    "BatchOutcome",
    "BelayerPolicyError",
    "CheckpointCostModel",
    "CheckpointPolicy",
    "ClockProbe",
    "ConstantHazard",
    "CostCalibration",
    "CostModel",
    "Decision",
    "DecisionRule",
    "EveryKRule",
    "ExitCode",
    "FailureModel",
    "FixedStepProbability",
    "HazardView",
    "HorizonVerdict",
    "KeyTable",
    "KindCosts",
    "NeverRule",
    "OnlineHazard",
    "PaperRule",
    "PolicyArgumentError",
    "PolicySpec",
    "PolicyStateError",
    "PolicySummary",
    "PooledCost",
    "Reason",
    "RegenerationCost",
    "RenewalLoss",
    "ResponseTimeModel",
    "RestoreCostModel",
    "ScheduledFailure",
    "SharedEstimators",
    "SimulationConfig",
    "Stats",
    "StepContext",
    "StepObservation",
    "TraceFormatError",
    "Trajectory",
    "TrajectoryLengthModel",
    "TrajectoryOutcome",
    "UniformRange",
    "Verdict",
    "Workload",
    "append_trace",
    "batch_step_hazard",
    "compare_now_and_later",
    "compare_policies",
    "critical_share",
    "format_table",
    "load_trace",
    "percentile",
    "protected_cost",
    "save_trace",
    "simulate_batch",
    "simulate_trajectory",
]
