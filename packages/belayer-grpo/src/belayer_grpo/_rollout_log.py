"""The rollout log: each finished sample of a step made durable as it finishes, for ``--resume``.

``RUN_DIR/rollouts/step_<N>.jsonl`` holds one JSON line per finished sample, its index
``group * samples_per_prompt + sample`` and, for math, every field of `Sample` the trainer reads;
for the agentic workloads the whole `AgenticTrajectory` (tokens, logprobs, loss mask, reward,
indices, checkpoints and recoveries) and the group's ``attempt`` (a group sampled again after an
unrecoverable trajectory).  Each line is written, flushed and fsynced before the next; one
``{"ended": true}`` line follows once the step's metrics are recorded.  A run resumed from the checkpoint of step K (`replay_ended_steps`) trains
again on the samples of the ended steps after K (nothing generated; the same update, as training
is deterministic given its samples), and the step the kill interrupted takes the samples it had
finished (`read_step_log`) and generates only the others, with the same per-request seeds.  So a
checkpoint is needed only at the start of the run (step 0) and every ``system.checkpoint_every``
steps, not before every rollout; the logs up to a checkpoint's step are removed (`prune_logs`).

Between them (since 0.6.3, with ``system.resume_grace_s > 0``) an agentic step logs the journal of
its trajectories in flight (`StepLog.append_event`): each committed action and each ready sandbox
checkpoint, as ``{"event": ..., "v": 1, "trajectory_id": ...}`` lines (`belayer_grpo._agentic.journal`).
They are kept apart from the samples (`LoggedStep.events`), so a log without them (0.6.0) reads as
before; a trainer that adopts the killed one's router continues each begun trajectory from them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from belayer_grpo._agentic import AgenticTrajectory
from belayer_grpo._agentic.journal import TrajectoryJournal, read_journals
from belayer_grpo._errors import CheckpointError
from belayer_grpo._rollout_math import Sample

__all__ = [
    "LoggedStep",
    "StepLog",
    "kept_trajectories",
    "prune_logs",
    "read_step_log",
    "replay_ended_steps",
    "step_log_path",
]

_NAME = re.compile(r"step_(\d+)\.jsonl$")
_FIELDS = [field.name for field in attrs.fields(Sample)]


def step_log_path(run_dir: Path, step: int) -> Path:
    """Where step ``step``'s samples go: ``run_dir/rollouts/step_<step>.jsonl``."""
    return run_dir / "rollouts" / f"step_{step:06d}.jsonl"


@attrs.frozen
class LoggedStep:
    """What a step log holds: its records (finished samples) in order, whether the step ended, the
    length of its whole lines (a torn last line, cut by a kill mid-write, is not counted) and the
    journal events of its trajectories in flight, in order."""

    path: Path
    records: list[dict[str, Any]]
    ended: bool
    num_bytes: int
    events: list[dict[str, Any]] = attrs.field(factory=list)

    def journals(self) -> dict[str, TrajectoryJournal]:
        """Each logged trajectory's journal by its id (`belayer_grpo._agentic.journal.read_journals`)."""
        try:
            return read_journals(self.events)
        except ValueError as error:
            raise CheckpointError(
                f"{self.path}: {error}; remove the file to generate the step again"
            ) from error

    def samples(self, prompts: Sequence[Sequence[int]]) -> dict[int, Sample]:
        """The math samples by index, each checked against ``prompts`` (the prompt token ids of
        every index of the step): a log written for other prompts raises `CheckpointError`."""
        out = {}
        for record in self.records:
            try:
                index = int(record["index"])
                sample = Sample(**{name: record[name] for name in _FIELDS})
            except (KeyError, TypeError, ValueError) as error:
                raise self._malformed(record, error) from error
            if index >= len(prompts) or list(prompts[index]) != sample.prompt_ids:
                raise self._mismatch(f"sample {index}")
            out[index] = sample
        return out

    def trajectories(
        self, task_ids: Sequence[str], run_id: str
    ) -> dict[tuple[int, int, int], AgenticTrajectory]:
        """The agentic trajectories by ``(group_index, sample_index, attempt)``, each checked
        against the step's tasks (``task_ids`` by group) and its ``run_id``."""
        out = {}
        for record in self.records:
            try:
                trajectory = AgenticTrajectory.from_record(record["trajectory"])
                attempt = int(record["attempt"])
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise self._malformed(record, error) from error
            group = trajectory.group_index
            if (
                group >= len(task_ids) or trajectory.task_id != task_ids[group]
                or not trajectory.trajectory_id.startswith(f"{run_id}-")
            ):  # fmt: skip
                raise self._mismatch(f"trajectory {trajectory.trajectory_id}")
            out[(group, trajectory.sample_index, attempt)] = trajectory
        return out

    def _malformed(self, record: dict[str, Any], error: Exception) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: a record is not a logged sample ({type(error).__name__}: {error}; keys "
            f"{sorted(record)[:8]}); remove the file to generate the step again"
        )

    def _mismatch(self, what: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: {what} was generated for another prompt than this step's (was the "
            "configuration changed?); resume with the run's own config.json, or remove the file"
        )


def kept_trajectories(
    trajectories: dict[tuple[int, int, int], AgenticTrajectory], num_samples: int
) -> list[AgenticTrajectory]:
    """The trajectories of an ended step that entered its batch, in group then sample order: per
    group the one attempt with all ``num_samples`` samples finished (an attempt that lost one was
    sampled again; a group with no complete attempt was dropped)."""
    attempts: dict[tuple[int, int], list[AgenticTrajectory]] = {}
    for (group, _sample, attempt), trajectory in trajectories.items():
        attempts.setdefault((group, attempt), []).append(trajectory)
    kept = [
        sorted(found, key=lambda t: t.sample_index)
        for found in attempts.values()
        if len(found) == num_samples
    ]
    return [trajectory for group in sorted(kept, key=lambda g: g[0].group_index) for trajectory in group]


def read_step_log(path: Path) -> LoggedStep:
    """The records of ``path`` (none when it does not exist); a broken line that is not the last
    raises `CheckpointError`."""
    if not path.is_file():
        return LoggedStep(path, [], False, 0)
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    ended = False
    offset = 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        if end < 0:
            break  # torn last line: the kill came mid-write
        try:
            record = json.loads(data[offset:end])
        except ValueError as error:
            raise CheckpointError(
                f"{path}: line at byte {offset} is not JSON ({error}); remove the file to generate the step again"
            ) from error
        if not isinstance(record, dict):
            raise CheckpointError(
                f"{path}: line at byte {offset} is not a JSON object; remove the file to generate the step again"
            )
        offset = end + 1
        if record.get("ended"):
            ended = True
        elif "event" in record:
            events.append(record)
        else:
            records.append(record)
    return LoggedStep(path, records, ended, offset, events)


@attrs.define
class StepLog:
    """The open log of one step: `append` each finished sample, `end` once the step is recorded."""

    path: Path
    _file: IO[bytes]

    @classmethod
    def open(cls, path: Path, keep_bytes: int = 0) -> StepLog:
        """Open ``path`` for appending after its first ``keep_bytes`` bytes (a resumed step's whole
        lines: a torn line is cut off so the next line starts clean); 0 starts it empty."""
        path.parent.mkdir(parents=True, exist_ok=True)
        file = path.open("r+b" if keep_bytes and path.exists() else "wb")
        file.truncate(keep_bytes)
        file.seek(keep_bytes)
        return cls(path, file)

    def append_sample(self, index: int, sample: Sample) -> None:
        """Write one math sample durably (flush and fsync) before returning."""
        self._write({"index": index, **attrs.asdict(sample)})

    def append_trajectory(self, index: int, attempt: int, trajectory: AgenticTrajectory) -> None:
        """Write one agentic trajectory (``attempt``: its group's sampling) durably."""
        self._write({"index": index, "attempt": attempt, "trajectory": trajectory.to_record()})

    def append_event(self, event: dict[str, Any]) -> None:
        """Write one journal event of a trajectory in flight (`belayer_grpo._agentic.journal`) durably."""
        self._write(event)

    def end(self) -> None:
        """Mark the step as ended (its metrics are recorded) and close the file."""
        self._write({"ended": True})
        self.close()

    def close(self) -> None:
        """Close the file (what was appended stays)."""
        self._file.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())


def replay_ended_steps(run_dir: Path, after_step: int, train_on: Callable[[int, LoggedStep], object]) -> int:
    """Call ``train_on(step, logged)`` for every ended step after ``after_step``, in order, and
    return the last such step (``after_step`` when there is none).  ``train_on`` draws the step's
    prompts as the run did (advancing the sampler), checks the log against them and trains."""
    step = after_step
    while (logged := read_step_log(step_log_path(run_dir, step + 1))).ended:
        train_on(step + 1, logged)
        step += 1
    return step


def prune_logs(run_dir: Path, up_to_step: int) -> None:
    """Remove the step logs of steps ``<= up_to_step`` (a checkpoint of that step covers them)."""
    folder = run_dir / "rollouts"
    if folder.is_dir():
        for path in folder.iterdir():
            if (match := _NAME.search(path.name)) and int(match.group(1)) <= up_to_step:
                path.unlink(missing_ok=True)
