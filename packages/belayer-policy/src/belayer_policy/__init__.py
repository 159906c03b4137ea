"""Adaptive, risk-aware checkpoint policy for agentic RL rollouts, and its trace-driven simulator.

After every environment step the agent loop calls :meth:`CheckpointPolicy.decide`; the policy
checkpoints iff ``p_t * C_t > c_t * (1 - q(x; c_t)) + extra_cost_s``.
"""

from __future__ import annotations

from importlib.metadata import version

from belayer_policy._cli import ExitCode
from belayer_policy._decision import Decision, Reason, StepObservation
from belayer_policy._errors import BelayerPolicyError, PolicyArgumentError, PolicyStateError, TraceFormatError
from belayer_policy._estimators import CheckpointCostModel, RegenerationCost, ResponseTimeModel
from belayer_policy._hazard import ConstantHazard, FailureModel, FixedStepProbability, OnlineHazard
from belayer_policy._policy import (
    AdaptiveRule,
    AlwaysRule,
    CheckpointPolicy,
    DecisionRule,
    EveryKRule,
    NeverRule,
)
from belayer_policy._report import PolicySummary, Stats, compare_policies, format_table, percentile
from belayer_policy._simulator import (
    BatchOutcome,
    SimulationConfig,
    TrajectoryOutcome,
    simulate_batch,
    simulate_trajectory,
)
from belayer_policy._spec import PolicySpec, SharedEstimators
from belayer_policy._workload import (
    ScheduledFailure,
    Trajectory,
    UniformRange,
    Workload,
    load_trace,
    save_trace,
)

__version__ = version("belayer-policy")

__all__ = [
    "AdaptiveRule",
    "AlwaysRule",
    "BatchOutcome",
    "BelayerPolicyError",
    "CheckpointCostModel",
    "CheckpointPolicy",
    "ConstantHazard",
    "Decision",
    "DecisionRule",
    "EveryKRule",
    "ExitCode",
    "FailureModel",
    "FixedStepProbability",
    "NeverRule",
    "OnlineHazard",
    "PolicyArgumentError",
    "PolicySpec",
    "PolicyStateError",
    "PolicySummary",
    "Reason",
    "RegenerationCost",
    "ResponseTimeModel",
    "ScheduledFailure",
    "SharedEstimators",
    "SimulationConfig",
    "Stats",
    "StepObservation",
    "TraceFormatError",
    "Trajectory",
    "TrajectoryOutcome",
    "UniformRange",
    "Workload",
    "compare_policies",
    "format_table",
    "load_trace",
    "percentile",
    "save_trace",
    "simulate_batch",
    "simulate_trajectory",
]
