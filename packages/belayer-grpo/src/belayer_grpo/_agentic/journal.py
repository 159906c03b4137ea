"""The journal of a trajectory in flight: what a resumed trainer needs to continue it, not start over.

As a trajectory runs, its loop hands each event to a ``note`` callback (the step's rollout log,
`belayer_grpo._rollout_log.StepLog.append_event`, written and fsynced before the loop goes on):

- ``action``: a committed environment step: its turn, the sandbox's prefix after it, the command
  and what it returned (exit code, stdout, stderr), all the loop needs to rebuild its context
  and observations at that turn without running it again, and the hash of the context after its
  observation (a resume that rebuilt another context there rewinds: see ``rewind``);
- ``checkpoint``: a ready checkpoint of the sandbox: its id in the run's checkpoint store, its
  prefix and turn, the router context it is tied to (ref and hash), the repository hash and kind;
- ``rewind``: a recovery took the trajectory back to ``turn``, or a resumed turn after it came
  back other than logged (another command, or another context: a turn the router generated
  anew): later actions and checkpoints no longer hold.

`read_journals` folds a step's events into one `TrajectoryJournal` per trajectory.  A trainer
that adopted the killed one's router continues a begun trajectory from it (`AgentLoop`
``resume``): its turns are sent again under the same request ids (the router answers them from
what it holds), each logged action's result is taken from the journal, and the sandbox is
rebuilt once at the last logged turn: its latest ready checkpoint restored (and verified) and
only the actions after it run again (all of them, in a fresh sandbox, when there is none); a
sandbox failure meanwhile is recovered as any other (restored again, the actions after it run
again).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from belayer_envckpt import BelayerEnvckptError, Checkpoint, ExecResult
from belayer_grpo._agentic.records import CheckpointRecord

__all__ = [
    "JOURNAL_FORMAT",
    "LoggedAction",
    "TrajectoryJournal",
    "action_event",
    "checkpoint_event",
    "read_journals",
    "rewind_event",
]

JOURNAL_FORMAT = 1  # the ``v`` of every event; an event of another format is refused


@attrs.frozen
class LoggedAction:
    """A committed environment step as the journal holds it."""

    turn: int
    prefix: int  # the sandbox's count of committed actions after this one
    command: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float = 0.0
    context_hash: str = ""  # the context after its observation ("" in an older journal: not compared)

    def result(self) -> ExecResult:
        """What the action returned, as `environment.run_action` gave it the first time."""
        return ExecResult(
            stdout=self.stdout, stderr=self.stderr, exit_code=self.exit_code, duration_s=self.duration_s
        )


@attrs.define
class TrajectoryJournal:
    """One trajectory's committed actions (by turn) and ready checkpoints (oldest first)."""

    actions: dict[int, LoggedAction] = attrs.field(factory=dict)
    checkpoints: list[dict[str, Any]] = attrs.field(factory=list)

    @property
    def last_turn(self) -> int:
        """The turn of the last committed action (0: none)."""
        return max(self.actions, default=0)

    def rewind(self, turn: int) -> None:
        """Forget what came after ``turn`` (a recovery went back there)."""
        self.actions = {t: a for t, a in self.actions.items() if t <= turn}
        self.checkpoints = [c for c in self.checkpoints if int(c["turn"]) <= turn]

    def checkpoint_records(self, trajectory_dir: Path) -> list[CheckpointRecord]:
        """The logged checkpoints still in ``trajectory_dir`` (the run's store), oldest first, as
        the loop's records; one whose manifest is gone or unreadable is left out (a restore falls
        back past it to the one before)."""
        out = []
        for entry in self.checkpoints:
            try:
                checkpoint = Checkpoint.load(trajectory_dir / str(entry["checkpoint_id"]))
            except (BelayerEnvckptError, OSError):
                continue
            out.append(
                CheckpointRecord(
                    int(entry["prefix"]), int(entry["turn"]), str(entry["context_ref"]),
                    str(entry["context_hash"]), str(entry["repo_hash"]),
                    duration_s=float(entry.get("duration_s", 0.0)), checkpoint=checkpoint,
                    kind=str(entry.get("kind", "")),
                )
            )  # fmt: skip
        return out


def action_event(
    trajectory_id: str, turn: int, prefix: int, command: str, result: ExecResult, context_hash: str = ""
) -> dict[str, Any]:
    """The ``action`` event of a committed step (``context_hash``: the context after its observation)."""
    return {
        "event": "action", "v": JOURNAL_FORMAT, "trajectory_id": trajectory_id, "turn": turn,
        "prefix": prefix, "command": command, "exit_code": result.exit_code, "stdout": result.stdout,
        "stderr": result.stderr, "duration_s": result.duration_s, "context_hash": context_hash,
    }  # fmt: skip


def checkpoint_event(trajectory_id: str, record: CheckpointRecord) -> dict[str, Any]:
    """The ``checkpoint`` event of a ready checkpoint (its files stay in the run's store)."""
    assert record.checkpoint is not None
    return {
        "event": "checkpoint", "v": JOURNAL_FORMAT, "trajectory_id": trajectory_id,
        "checkpoint_id": record.checkpoint.checkpoint_id, "path": str(record.checkpoint.path),
        "prefix": record.prefix, "turn": record.turn, "context_ref": record.context_ref,
        "context_hash": record.context_hash, "repo_hash": record.repo_hash, "kind": record.kind,
        "duration_s": record.duration_s,
    }  # fmt: skip


def rewind_event(trajectory_id: str, turn: int) -> dict[str, Any]:
    """The ``rewind`` event of a recovery back to ``turn``."""
    return {"event": "rewind", "v": JOURNAL_FORMAT, "trajectory_id": trajectory_id, "turn": turn}


def read_journals(events: Iterable[dict[str, Any]]) -> dict[str, TrajectoryJournal]:
    """Each trajectory's journal from a step's events, in the order they were written.  A malformed
    event raises ``ValueError`` (the caller names the file)."""
    journals: dict[str, TrajectoryJournal] = {}
    for event in events:
        try:
            if int(event.get("v", 0)) != JOURNAL_FORMAT:
                raise ValueError(f"journal format {event.get('v')!r}, this version reads {JOURNAL_FORMAT}")
            journal = journals.setdefault(str(event["trajectory_id"]), TrajectoryJournal())
            kind = event["event"]
            if kind == "action":
                action = LoggedAction(
                    int(event["turn"]), int(event["prefix"]), str(event["command"]), int(event["exit_code"]),
                    str(event["stdout"]), str(event["stderr"]), float(event.get("duration_s", 0.0)),
                    str(event.get("context_hash", "")),
                )  # fmt: skip
                journal.actions[action.turn] = action
            elif kind == "checkpoint":
                lacking = [k for k in ("checkpoint_id", "prefix", "turn", "context_ref", "context_hash",
                                       "repo_hash") if k not in event]  # fmt: skip
                if lacking:  # refused here, not at a restore
                    raise KeyError(lacking[0])
                journal.checkpoints.append(dict(event))
            elif kind == "rewind":
                journal.rewind(int(event["turn"]))
            else:
                raise ValueError(f"unknown journal event {kind!r}")
        except (KeyError, TypeError) as error:
            raise ValueError(f"a journal event lacks a field or has a wrong type ({error!r})") from error
    return journals
