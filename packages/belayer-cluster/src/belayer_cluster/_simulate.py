"""A discrete-event simulation of a synchronous RL (GRPO) job at a scale we cannot run.

One step is a rollout phase on the rollout nodes, a train phase on the trainer nodes and a weight
sync; every `k` steps the trainer writes a blocking checkpoint. Failures arrive as a Poisson
process (rate linear in the GPU count) and each is one of four classes; what a failure costs
depends on the recovery strategy:

- a failure that rolls back (every failure but a sandbox loss under `JOB_RESTART`; a trainer
  failure under every strategy) loses the steps since the last checkpoint and costs
  `detection_s + checkpoint_restart_s` of downtime; failures during that downtime are absorbed
  (the restart replaces the nodes anyway);
- a rollout-side failure that does not roll back delays the rollout phase. Every rollout worker's
  requests span the whole phase, so the phase ends when the slowest worker is done: a recovery
  that regenerates from scratch (`ROLE_RESTART`, and every baseline sandbox loss) ends that
  worker at `failure + recovery + rollout_s`; a token-level resume (`BELAYER`) ends it at
  `its nominal end + recovery`. A failure after the worker's nominal end, or on a rollout node
  outside the rollout phase, only makes the worker late for the next rollout phase.

Standard library only (no ray, no numpy): `belayer-cluster scale` starts fast.
"""

from __future__ import annotations

import enum
import itertools
import math
import random
from collections.abc import Sequence

import attrs

from belayer_cluster._errors import ClusterConfigError
from belayer_cluster._simulate_inputs import SimInputs

__all__ = [
    "Failure",
    "FailureKind",
    "RunResult",
    "Strategy",
    "checkpoint_every_steps",
    "draw_failures",
    "run_job",
]

DAY_S = 86_400.0


class FailureKind(enum.Enum):
    """The four failure classes the simulation draws."""

    WORKER_CRASH = "worker_crash"  # a rollout worker's process dies; its node lives
    NODE_LOSS = "node_loss"  # a rollout node is lost (GPU, HBM, network, host)
    SANDBOX_LOSS = "sandbox_loss"  # an agentic sandbox (container) is lost
    TRAINER_FAILURE = "trainer_failure"  # a crash or a lost node on the trainer side


class Strategy(enum.Enum):
    """How the job recovers from a failure."""

    JOB_RESTART = "job_restart"  # (a) restart the whole job from the last trainer checkpoint
    ROLE_RESTART = "role_restart"  # (b) restart the failed worker from scratch, regenerate
    BELAYER = "belayer"  # (c) shadow handover, node-loss resume, sandbox restore, token-level


@attrs.frozen
class Failure:
    """One failure: when (seconds since the job started) and which class."""

    time_s: float
    kind: FailureKind


@attrs.frozen
class RunResult:
    """One simulated run: wall time, useful time and what the failures did."""

    strategy: Strategy
    wall_s: float
    useful_s: float
    steps: int
    checkpoint_every_steps: int
    num_failures: int
    num_rollbacks: int
    checkpoint_s: float

    @property
    def ratio(self) -> float:
        """Effective training time ratio: useful time (completed steps) / wall time."""
        return self.useful_s / self.wall_s


def _rolls_back(kind: FailureKind, strategy: Strategy) -> bool:
    if kind is FailureKind.TRAINER_FAILURE:
        return True
    return strategy is Strategy.JOB_RESTART and kind is not FailureKind.SANDBOX_LOSS


def _recovery(kind: FailureKind, strategy: Strategy, inputs: SimInputs) -> tuple[float, bool]:
    """(recovery seconds, regenerates from scratch) for a failure that does not roll back."""
    if strategy is Strategy.BELAYER:
        return {
            FailureKind.WORKER_CRASH: inputs.shadow_handover_s,
            FailureKind.NODE_LOSS: inputs.node_loss_resume_s,
            FailureKind.SANDBOX_LOSS: inputs.sandbox_restore_s,
        }[kind], False
    if kind is FailureKind.SANDBOX_LOSS:
        return inputs.sandbox_restart_s, True
    return inputs.worker_restart_s, True


def rollback_rate_per_s(inputs: SimInputs, gpus: int, strategy: Strategy) -> float:
    """How often failures that roll the job back to its checkpoint arrive (per second)."""
    hardware = inputs.failures_per_gpu_day * gpus / DAY_S
    if strategy is Strategy.JOB_RESTART:
        return hardware
    return hardware * (1.0 - inputs.rollout_fraction)


def checkpoint_every_steps(inputs: SimInputs, gpus: int, strategy: Strategy) -> int:
    """Steps between checkpoints: `checkpoint_interval_s`, or Young's interval when it is 0."""
    interval_s = inputs.checkpoint_interval_s
    if interval_s == 0:
        rate = rollback_rate_per_s(inputs, gpus, strategy)
        if rate == 0 or inputs.checkpoint_write_s == 0:
            return 1_000_000_000  # nothing ever rolls back (or checkpoints are free): one at the end
        interval_s = math.sqrt(2.0 * inputs.checkpoint_write_s / rate)
    return max(1, round(interval_s / inputs.step_s))


def draw_failures(inputs: SimInputs, gpus: int, horizon_s: float, rng: random.Random) -> list[Failure]:
    """A Poisson trace of failures over `horizon_s` on `gpus` GPUs, each with its class."""
    _check_gpus(inputs, gpus)
    rollout_nodes = round(gpus // inputs.gpus_per_node * inputs.rollout_fraction)
    hardware = inputs.failures_per_gpu_day * gpus / DAY_S
    sandbox = inputs.sandbox_losses_per_node_day * rollout_nodes / DAY_S
    total = hardware + sandbox
    failures: list[Failure] = []
    if total == 0:
        return failures
    time_s = rng.expovariate(total)
    while time_s < horizon_s:
        if rng.random() * total < sandbox:
            kind = FailureKind.SANDBOX_LOSS
        elif rng.random() >= inputs.rollout_fraction:
            kind = FailureKind.TRAINER_FAILURE
        elif rng.random() < inputs.worker_crash_share:
            kind = FailureKind.WORKER_CRASH
        else:
            kind = FailureKind.NODE_LOSS
        failures.append(Failure(time_s, kind))
        time_s += rng.expovariate(total)
    return failures


def _check_gpus(inputs: SimInputs, gpus: int) -> None:
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 2 * inputs.gpus_per_node:
        raise ClusterConfigError(
            f"gpus must be a whole number of at least two nodes ({2 * inputs.gpus_per_node}) (got {gpus!r})"
        )
    if gpus % inputs.gpus_per_node:
        raise ClusterConfigError(
            f"gpus must be a multiple of gpus_per_node={inputs.gpus_per_node} (got {gpus})"
        )


@attrs.define
class _Job:
    """The simulated job's state while `run_job` walks through its phases."""

    inputs: SimInputs
    strategy: Strategy
    failures: Sequence[Failure]
    next_failure: int = 0
    committed_steps: int = 0
    pending_steps: int = 0
    workers_ready_s: float = 0.0  # a rollout worker recovering in the background is back then
    num_rollbacks: int = 0
    checkpoint_s: float = 0.0

    def rollback(self, failure: Failure) -> float:
        """Lose the steps since the checkpoint; returns when the restarted job runs again."""
        self.pending_steps = 0
        self.num_rollbacks += 1
        resume_s = failure.time_s + self.inputs.detection_s + self.inputs.checkpoint_restart_s
        self.workers_ready_s = resume_s
        while self.next_failure < len(self.failures) and self.failures[self.next_failure].time_s < resume_s:
            self.next_failure += 1  # absorbed by the restart
        return resume_s

    def run_phase(self, start_s: float, duration_s: float, rollout: bool) -> tuple[float, Failure | None]:
        """Run one phase from `start_s`; returns (its end, the failure that rolled back or None)."""
        work_end_s = (max(start_s, self.workers_ready_s) if rollout else start_s) + duration_s
        end_s = work_end_s
        while self.next_failure < len(self.failures) and self.failures[self.next_failure].time_s < end_s:
            failure = self.failures[self.next_failure]
            self.next_failure += 1
            if _rolls_back(failure.kind, self.strategy):
                return failure.time_s, failure
            recovery_s, regenerates = _recovery(failure.kind, self.strategy, self.inputs)
            if not rollout:
                if failure.kind is not FailureKind.SANDBOX_LOSS:  # no sandbox is in use outside rollouts
                    self.workers_ready_s = max(self.workers_ready_s, failure.time_s + recovery_s)
            elif failure.time_s < work_end_s:
                if regenerates:
                    end_s = max(end_s, failure.time_s + recovery_s + self.inputs.rollout_s)
                else:
                    end_s = max(end_s, work_end_s + recovery_s)
            elif failure.kind is not FailureKind.SANDBOX_LOSS:  # that worker was done: late for the next step
                self.workers_ready_s = max(self.workers_ready_s, failure.time_s + recovery_s)
        return end_s, None


def run_job(
    inputs: SimInputs, strategy: Strategy, gpus: int, horizon_s: float, failures: Sequence[Failure]
) -> RunResult:
    """Simulate `horizon_s` seconds of the job under `strategy` with the given failure trace."""
    _check_gpus(inputs, gpus)
    if not (math.isfinite(horizon_s) and horizon_s > 0):
        raise ClusterConfigError(f"the simulated time must be > 0 seconds (got {horizon_s!r})")
    if any(later.time_s < earlier.time_s for earlier, later in itertools.pairwise(failures)):
        raise ClusterConfigError("failures must be sorted by time_s")
    every = checkpoint_every_steps(inputs, gpus, strategy)
    job = _Job(inputs, strategy, failures)
    phases = ((inputs.rollout_s, True), (inputs.train_s, False), (inputs.weight_sync_s, False))
    now_s = 0.0
    while now_s < horizon_s:
        failed: Failure | None = None
        for duration_s, rollout in phases:
            now_s, failed = job.run_phase(now_s, duration_s, rollout)
            if failed is not None or now_s > horizon_s:
                break
        if now_s > horizon_s:
            break
        if failed is not None:
            now_s = job.rollback(failed)
            continue
        job.pending_steps += 1
        if job.pending_steps >= every:
            end_s, failed = job.run_phase(now_s, inputs.checkpoint_write_s, False)
            if failed is not None:
                now_s = job.rollback(failed)
                continue
            job.checkpoint_s += min(end_s, horizon_s) - now_s
            now_s = end_s
            if now_s <= horizon_s:
                job.committed_steps += job.pending_steps
                job.pending_steps = 0
    steps = job.committed_steps + job.pending_steps  # steps done when the horizon ends count as done
    return RunResult(
        strategy=strategy,
        wall_s=horizon_s,
        useful_s=steps * inputs.step_s,
        steps=steps,
        checkpoint_every_steps=every,
        num_failures=sum(1 for f in failures if f.time_s < horizon_s),
        num_rollbacks=job.num_rollbacks,
        checkpoint_s=job.checkpoint_s,
    )
