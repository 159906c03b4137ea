"""The rollout log that ``--resume`` reads, and the ``--resume`` configuration and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from belayer_envckpt import Checkpoint, ExecResult
from belayer_grpo import ExitCode, GrpoConfigError
from belayer_grpo._agentic import AgenticTrajectory, CheckpointRecord, RecoveryRecord
from belayer_grpo._agentic.journal import LoggedAction, action_event, checkpoint_event, rewind_event
from belayer_grpo._checkpointing import save_checkpoint
from belayer_grpo._cli import main
from belayer_grpo._config import load_config, load_run_config
from belayer_grpo._errors import CheckpointError
from belayer_grpo._rollout_log import (
    StepLog,
    kept_trajectories,
    prune_logs,
    read_step_log,
    replay_ended_steps,
    step_log_path,
)
from belayer_grpo._rollout_math import Sample

_PROMPTS = [[1, 2], [1, 2], [3, 4], [3, 4]]  # 2 groups of 2


def _sample(index: int) -> Sample:
    return Sample(
        group=index // 2, prompt_ids=_PROMPTS[index], completion_ids=[5, index], logprobs=[-0.1 * index, -1 / 3],
        loss_mask=[1, 1], reward=float(index % 2), finish_reason="stop", num_resumes=0, text=str(index),
    )  # fmt: skip


def test_samples_come_back_exactly_and_a_torn_last_line_is_cut_off(tmp_path: Path) -> None:
    path = step_log_path(tmp_path, 3)
    log = StepLog.open(path)
    log.append_sample(2, _sample(2))
    log.append_sample(0, _sample(0))
    log.close()
    whole = path.stat().st_size
    with path.open("ab") as file:
        file.write(b'{"index": 1, "group": 0, "prompt_ids": [1,')  # the kill came mid-write
    logged = read_step_log(path)
    assert logged.samples(_PROMPTS) == {2: _sample(2), 0: _sample(0)}
    assert not logged.ended
    assert logged.num_bytes == whole
    # The resumed step appends after the whole lines: the torn one is gone.
    log = StepLog.open(path, logged.num_bytes)
    log.append_sample(1, _sample(1))
    log.end()
    again = read_step_log(path)
    assert sorted(again.samples(_PROMPTS)) == [0, 1, 2]
    assert again.ended
    assert json.loads(path.read_text().splitlines()[-1]) == {"ended": True}


def test_a_log_for_other_prompts_or_broken_inside_is_refused(tmp_path: Path) -> None:
    path = step_log_path(tmp_path, 1)
    log = StepLog.open(path)
    log.append_sample(1, _sample(1))
    log.close()
    with pytest.raises(CheckpointError, match="another prompt"):
        read_step_log(path).samples([[9], [9], [9], [9]])
    path.write_text("not json\n" + path.read_text())
    with pytest.raises(CheckpointError, match="remove the file"):
        read_step_log(path)
    assert read_step_log(tmp_path / "missing.jsonl").records == []


def test_well_formed_json_that_is_not_a_logged_sample_is_a_checkpoint_error(tmp_path: Path) -> None:
    """JSON of the wrong shape (not an object, a sample without its fields, a trajectory record
    without one) is refused with what to do, not a KeyError or AttributeError."""
    path = step_log_path(tmp_path, 1)
    path.parent.mkdir(parents=True)
    path.write_text("[1, 2]\n")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        read_step_log(path)
    path.write_text(json.dumps({"index": 0, "group": 0}) + "\n")
    with pytest.raises(CheckpointError, match=r"not a logged sample.*remove the file"):
        read_step_log(path).samples(_PROMPTS)
    path.write_text(json.dumps({"index": 0, "attempt": 0, "trajectory": {"task_id": "t"}}) + "\n")
    with pytest.raises(CheckpointError, match="not a logged sample"):
        read_step_log(path).trajectories(["t"], "run")


def test_replay_trains_on_the_ended_steps_in_index_order_and_stops_at_the_interrupted_one(
    tmp_path: Path,
) -> None:
    for step in (1, 2, 3):
        log = StepLog.open(step_log_path(tmp_path, step))
        for index in (3, 1, 0, 2):
            if step < 3 or index < 2:
                log.append_sample(index, _sample(index))
        log.end() if step < 3 else log.close()
    batches: list[tuple[int, dict[int, Sample]]] = []
    last = replay_ended_steps(
        tmp_path, 0, lambda step, logged: batches.append((step, logged.samples(_PROMPTS)))
    )
    assert last == 2  # step 3 did not end: it is the one to resume
    assert batches == [(1, {i: _sample(i) for i in range(4)}), (2, {i: _sample(i) for i in range(4)})]
    prune_logs(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_000003.jsonl"]


def test_resume_takes_the_saved_config_and_refuses_a_folder_it_cannot_resume(tmp_path: Path) -> None:
    with pytest.raises(GrpoConfigError, match=r"no config\.json"):
        load_run_config(tmp_path)
    saved = load_config(None, ["data.workload=math", "algorithm.steps=7"])
    (tmp_path / "config.json").write_text(json.dumps(saved.to_dict()))
    with pytest.raises(GrpoConfigError, match="first checkpoint"):
        load_run_config(tmp_path)
    assert main(["train", "--resume", str(tmp_path)]) == ExitCode.USAGE
    save_checkpoint(tmp_path / "checkpoints", 0, {"model": {}, "optimizer": {}, "sampler": {}})
    config = load_run_config(tmp_path, ["algorithm.steps=9", "system.run_dir=elsewhere"])
    assert (config.data.workload, config.algorithm.steps) == ("math", 9)
    assert (config.system.run_dir, config.system.resume) == (str(tmp_path.resolve()), "latest")
    assert config.chaos == saved.chaos
    assert config.rollout == saved.rollout


def _trajectory(group: int, sample: int, attempt: int) -> AgenticTrajectory:
    again = f"-r{attempt}" if attempt else ""
    checkpoint = CheckpointRecord(1, 1, "router:contexts/t/1", "h", "r", 0.5, 0.1, kind="full")
    recovery = RecoveryRecord(
        failed_prefix=2, failed_turn=2, reason="killed", restored_prefix=1, restored_turn=1, from_checkpoint=True,
        restore_s=0.3, tokens_regenerated=4, rounds_regenerated=1, expected_repo_hash="a", actual_repo_hash="a",
        context_matches=True, prefix_matches=True, restore_timings_ms={"restore": 1.5},
    )  # fmt: skip
    return AgenticTrajectory(
        f"run-step4-g{group}{again}-s{sample}", f"task{group}", group, sample, [9, 9, 5, group], [0, 0, 1, 1],
        [0.0, 0.0, -0.5, -1 / 3], 2, float(sample), "submit", 1, 1, 1, 0, "ok", "adaptive", 1.0,
        [checkpoint], [recovery], step_checkpoint_s=[None], failed_steps=[2],
    )  # fmt: skip


def test_agentic_trajectories_come_back_whole_and_only_complete_groups_are_kept(tmp_path: Path) -> None:
    path = step_log_path(tmp_path, 4)
    log = StepLog.open(path)
    # Group 0 lost a trajectory in its first sampling and was sampled again; group 1 kept its
    # first; group 2 has one of two finished (the kill came): it enters no batch.
    for group, sample, attempt in [(0, 0, 0), (1, 1, 0), (0, 1, 1), (1, 0, 0), (0, 0, 1), (2, 0, 0)]:
        log.append_trajectory(group * 2 + sample, attempt, _trajectory(group, sample, attempt))
    log.end()
    found = read_step_log(path).trajectories(["task0", "task1", "task2"], "run-step4")
    assert found[(0, 1, 1)] == _trajectory(0, 1, 1)  # every field, records included
    kept = kept_trajectories(found, 2)
    assert [(t.group_index, t.sample_index, t.trajectory_id) for t in kept] == [
        (0, 0, "run-step4-g0-r1-s0"), (0, 1, "run-step4-g0-r1-s1"), (1, 0, "run-step4-g1-s0"), (1, 1, "run-step4-g1-s1"),
    ]  # fmt: skip
    with pytest.raises(CheckpointError, match="another prompt"):
        read_step_log(path).trajectories(["task0", "other", "task2"], "run-step4")
    with pytest.raises(CheckpointError, match="another prompt"):
        read_step_log(path).trajectories(["task0", "task1", "task2"], "run-step5")


def _published(store: Path, trajectory: str, checkpoint_id: str, prefix: int) -> Checkpoint:
    """A checkpoint's manifest in ``store`` (no layer: the journal only names and loads it)."""
    path = store / trajectory / checkpoint_id
    path.mkdir(parents=True)
    checkpoint = Checkpoint(
        checkpoint_id, trajectory, prefix, f"router:contexts/{trajectory}/{prefix}", "img", {}, "c0", 1, {}, {},
        path, kind="full",
    )  # fmt: skip
    (path / "manifest.json").write_text(json.dumps(checkpoint.to_manifest()))
    return checkpoint


def test_the_journal_of_trajectories_in_flight_comes_back_apart_from_the_samples(tmp_path: Path) -> None:
    """Actions, checkpoints and rewinds round-trip through the step log next to finished
    trajectories; a rewind forgets what came after its turn; a torn last event is cut off."""
    store, traj = tmp_path / "env-checkpoints", "run-step4-g0-s1"
    path = step_log_path(tmp_path, 4)
    log = StepLog.open(path)
    log.append_trajectory(0, 0, _trajectory(0, 0, 0))
    first = _published(store, traj, "ck-1", 1)
    record = CheckpointRecord(1, 1, first.context_ref, "ctx1", "repo1", 0.25, checkpoint=first, kind="full")
    for turn, command in [(1, "echo a > f"), (2, "cat f"), (3, "rm f")]:
        result = ExecResult(stdout=f"out{turn}\n", stderr="e" * turn, exit_code=turn - 1, duration_s=0.5)
        log.append_event(action_event(traj, turn, turn, command, result, f"ctx{turn}" if turn > 1 else ""))
        if turn == 1:
            log.append_event(checkpoint_event(traj, record))
    log.append_event(rewind_event(traj, 2))  # a recovery went back to turn 2: turn 3 no longer holds
    log.append_event(checkpoint_event("run-step4-g1-s0", attrs.evolve(record, turn=1)))
    log.close()
    whole = path.stat().st_size
    with path.open("ab") as file:
        file.write(b'{"event": "action", "v": 1, "trajectory_id": "run-step4-g0-s1", "turn": 4, "comm')
    logged = read_step_log(path)
    assert logged.num_bytes == whole
    assert list(logged.trajectories(["task0"], "run-step4")) == [(0, 0, 0)]  # the events are not samples
    journals = logged.journals()
    assert sorted(journals) == ["run-step4-g0-s1", "run-step4-g1-s0"]
    journal = journals[traj]
    assert sorted(journal.actions) == [1, 2]
    assert journal.last_turn == 2
    assert journal.actions[2] == LoggedAction(2, 2, "cat f", 1, "out2\n", "ee", 0.5, "ctx2")
    assert journal.actions[1].context_hash == ""  # not logged (an older journal): not compared
    assert journal.actions[2].result() == ExecResult(
        stdout="out2\n", stderr="ee", exit_code=1, duration_s=0.5
    )
    records = journal.checkpoint_records(store / traj)
    assert records == [record]  # every field; the checkpoint itself loaded from the store
    assert records[0].checkpoint is not None
    assert records[0].checkpoint.checkpoint_id == "ck-1"
    # A checkpoint whose files are gone is left out (a restore falls back past it).
    assert journals["run-step4-g1-s0"].checkpoint_records(store / "run-step4-g1-s0") == []
    # A 0.6.0 log (no events) reads as before; an event of another format is refused.
    assert read_step_log(step_log_path(tmp_path, 9)).journals() == {}
    with path.open("ab") as file:
        file.truncate(whole)
        file.write(json.dumps({"event": "action", "v": 2, "trajectory_id": traj}).encode() + b"\n")
    with pytest.raises(CheckpointError, match="journal format 2"):
        read_step_log(path).journals()
