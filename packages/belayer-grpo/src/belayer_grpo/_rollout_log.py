"""The rollout log: each finished sample of a step made durable as it finishes, for ``--resume``.

``RUN_DIR/rollouts/step_<N>.jsonl`` holds one JSON line per finished sample (its index
``group * samples_per_prompt + sample`` and every field of `Sample` the trainer reads), each
written, flushed and fsynced before the next, then one ``{"ended": true}`` line once the step's
metrics are recorded.  A run resumed from the checkpoint of step K (`replay_ended_steps`) trains
again on the samples of the ended steps after K (nothing generated; the same update, as training
is deterministic given its samples), and the step the kill interrupted takes the samples it had
finished (`read_step_log`) and generates only the others, with the same per-request seeds.  So a
checkpoint is needed only at the start of the run (step 0) and every ``system.checkpoint_every``
steps, not before every rollout; the logs up to a checkpoint's step are removed (`prune_logs`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from belayer_grpo._errors import CheckpointError
from belayer_grpo._rollout_math import Sample

__all__ = ["LoggedStep", "StepLog", "prune_logs", "read_step_log", "replay_ended_steps", "step_log_path"]

_NAME = re.compile(r"step_(\d+)\.jsonl$")
_FIELDS = [field.name for field in attrs.fields(Sample)]


def step_log_path(run_dir: Path, step: int) -> Path:
    """Where step ``step``'s samples go: ``run_dir/rollouts/step_<step>.jsonl``."""
    return run_dir / "rollouts" / f"step_{step:06d}.jsonl"


@attrs.frozen
class LoggedStep:
    """What a step log holds: the finished samples by index, whether the step ended, and the
    length of its whole lines (a torn last line, cut by a kill mid-write, is not counted)."""

    samples: dict[int, Sample]
    ended: bool
    num_bytes: int


def read_step_log(path: Path, prompts: Sequence[Sequence[int]] | None = None) -> LoggedStep:
    """The samples of ``path`` (an empty `LoggedStep` when it does not exist).

    ``prompts`` (the prompt token ids of every index of the step) checks each sample against the
    step being resumed: a log written for other prompts raises `CheckpointError`, as does a
    broken line that is not the last.
    """
    if not path.is_file():
        return LoggedStep({}, False, 0)
    data = path.read_bytes()
    samples: dict[int, Sample] = {}
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
        offset = end + 1
        if record.get("ended"):
            ended = True
            continue
        index = int(record["index"])
        sample = Sample(**{name: record[name] for name in _FIELDS})
        if prompts is not None and (index >= len(prompts) or list(prompts[index]) != sample.prompt_ids):
            raise CheckpointError(
                f"{path}: sample {index} was generated for another prompt than this step's (was the "
                "configuration changed?); resume with the run's own config.json, or remove the file"
            )
        samples[index] = sample
    return LoggedStep(samples, ended, offset)


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

    def append(self, index: int, sample: Sample) -> None:
        """Write one sample durably (flush and fsync) before returning."""
        self._write({"index": index, **attrs.asdict(sample)})

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


def replay_ended_steps(
    run_dir: Path,
    after_step: int,
    next_prompts: Callable[[], Sequence[Sequence[int]]],
    update: Callable[[list[Sample]], object],
) -> int:
    """Train on the logged samples of every ended step after ``after_step``, in order, and return
    the last such step (``after_step`` when there is none).

    For each step, ``next_prompts()`` draws the step's prompts as the run did (one per index; it
    advances the sampler) and ``update`` is the trainer's update on the samples in index order.
    """
    step = after_step
    while True:
        path = step_log_path(run_dir, step + 1)
        if not path.is_file():
            return step
        logged = read_step_log(path)
        if not logged.ended:
            return step
        prompts = next_prompts()
        checked = read_step_log(path, prompts)
        if len(checked.samples) != len(prompts):
            raise CheckpointError(
                f"{path} ended with {len(checked.samples)} of {len(prompts)} samples; remove it and "
                "the later step logs to generate them again"
            )
        update([checked.samples[index] for index in sorted(checked.samples)])
        step += 1


def prune_logs(run_dir: Path, up_to_step: int) -> None:
    """Remove the step logs of steps ``<= up_to_step`` (a checkpoint of that step covers them)."""
    folder = run_dir / "rollouts"
    if folder.is_dir():
        for path in folder.iterdir():
            if (match := _NAME.search(path.name)) and int(match.group(1)) <= up_to_step:
                path.unlink(missing_ok=True)
