"""Pure parts of the agentic workload: action parsing, task files, contexts, records, settings."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from belayer_envckpt import ExecResult
from belayer_grpo._agentic import (
    AgenticConfig,
    AgenticTrajectory,
    BashAction,
    CheckpointRecord,
    InvalidAction,
    RecoveryRecord,
    Submit,
    TaskFormatError,
    TokenContext,
    builtin_tasks,
    context_ref,
    count_kinds,
    load_swegym,
    parse_action,
    parse_context_ref,
    render_observation,
    summarize,
)
from belayer_grpo._errors import DataError, UnrecoverableTrajectoryError, describe_error
from belayer_grpo._plot import _MARKERS, sandbox_markers, write_training_plot
from belayer_grpo._rollout_agentic import EnvTotals, format_env
from belayer_router import ByteTokenizer

# -- actions -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Look:\n```bash\nls -la\n```\nthen more", BashAction("ls -la")),
        ("```sh\necho a\necho b\n```", BashAction("echo a\necho b")),
        ("```\ncat x\n```", BashAction("cat x")),
        ("```python\nprint(1)\n```\n```bash\npwd\n```", BashAction("pwd")),
        ("```bash\nfirst\n```\n```bash\nsecond\n```", BashAction("first")),
        ("thinking...\nACTION: grep -n foo bar.py  \nmore", BashAction("grep -n foo bar.py")),
        ("```bash\nsubmit\n```", Submit()),
        ("ACTION: submit", Submit()),
    ],
)
def test_parse_action_accepts_the_documented_forms(text: str, expected: object) -> None:
    assert parse_action(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("I think the bug is in add().", "No action found"),
        ("```bash\n\n```", "empty"),
        ("```bash\nls -la", "not closed"),
        ("```python\nprint(1)\n```", "No action found"),
        ("ACTION:   ", "empty"),
        ("```bash\necho \x00\n```", "NUL"),
    ],
)
def test_parse_action_explains_what_is_wrong(text: str, fragment: str) -> None:
    parsed = parse_action(text)
    assert isinstance(parsed, InvalidAction)
    assert fragment in parsed.feedback
    assert "```bash" in parsed.feedback or "split" in parsed.feedback


def test_parse_action_refuses_overlong_commands() -> None:
    parsed = parse_action("ACTION: " + "x" * 50, max_command_chars=10)
    assert isinstance(parsed, InvalidAction)
    assert "longer than 10" in parsed.feedback


@given(st.text(alphabet=st.characters(blacklist_characters="`\x00\r\n"), min_size=1).filter(str.strip))
def test_a_fenced_command_round_trips(command: str) -> None:
    parsed = parse_action(f"Reasoning.\n```bash\n{command}\n```\n")
    expected = Submit() if command.strip() == "submit" else BashAction(command.strip())
    assert parsed == expected


# -- task files --------------------------------------------------------------------------------


def test_builtin_tasks_are_swegym_records_with_repositories() -> None:
    tasks = builtin_tasks()
    assert len(tasks) == 3
    for task in tasks:
        assert task.source_dir is not None
        assert task.source_dir.is_dir()
        assert task.fail_to_pass
        assert task.image is None
        assert task.workdir == f"/workspace/{task.source_dir.name}"
        assert task.test_command.startswith(f"cp -f /opt/belayer-tasks/{task.source_dir.name}/test_*.py . &&")
    assert builtin_tasks(["belayer__words-1"])[0].instance_id == "belayer__words-1"
    with pytest.raises(TaskFormatError, match="unknown shipped task"):
        builtin_tasks(["nope"])


def test_image_records_take_json_string_test_lists_as_swegym_stores_them(tmp_path: Path) -> None:
    record = {
        "instance_id": "getmoto__moto-5752",
        "repo": "getmoto/moto",
        "problem_statement": "A bug.",
        "FAIL_TO_PASS": json.dumps(["tests/test_a.py::test_x"]),
        "PASS_TO_PASS": "[]",
    }
    path = tmp_path / "swegym.jsonl"
    path.write_text(json.dumps(record) + "\n\n")
    [task] = load_swegym(path, image="local/moto:5752")
    assert task.image == "local/moto:5752"
    assert task.workdir == "/testbed"
    assert task.fail_to_pass == ("tests/test_a.py::test_x",)
    assert task.test_command == "python3 -m pytest -q tests/test_a.py::test_x"


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"problem_statement": "x", "FAIL_TO_PASS": ["t"]}', "'instance_id'"),
        ('{"instance_id": "a/b", "problem_statement": "x", "FAIL_TO_PASS": ["t"]}', "instance_id"),
        ('{"instance_id": "a", "problem_statement": "", "FAIL_TO_PASS": ["t"]}', "problem_statement"),
        ('{"instance_id": "a", "problem_statement": "x", "FAIL_TO_PASS": [3]}', "FAIL_TO_PASS"),
        ('{"instance_id": "a", "problem_statement": "x", "FAIL_TO_PASS": "[oops"}', "FAIL_TO_PASS"),
        ('{"instance_id": "a", "problem_statement": "x", "FAIL_TO_PASS": ["t"]}', "give either 'source'"),
        (
            '{"instance_id": "a", "problem_statement": "x", "source": "../..", "FAIL_TO_PASS": ["t"]}',
            "source",
        ),
        ('{"instance_id": "a", "problem_statement": "x", "image": "i"}', "FAIL_TO_PASS is empty"),
    ],
)
def test_bad_task_lines_name_the_file_and_line(tmp_path: Path, line: str, fragment: str) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n" + line + "\n")
    with pytest.raises(TaskFormatError, match=r"tasks\.jsonl:2") as caught:
        load_swegym(path)
    assert fragment in str(caught.value)
    assert isinstance(caught.value, DataError)


def test_missing_empty_and_duplicate_task_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match="cannot read"):
        load_swegym(tmp_path / "absent.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TaskFormatError, match="no tasks"):
        load_swegym(empty)
    twice = tmp_path / "twice.jsonl"
    line = json.dumps({"instance_id": "a", "problem_statement": "x", "FAIL_TO_PASS": ["t"]})
    twice.write_text(f"{line}\n{line}\n")
    with pytest.raises(TaskFormatError, match=r"twice\.jsonl:2.*appears twice"):
        load_swegym(twice, image="i")


# -- contexts and references -------------------------------------------------------------------


def test_token_context_tracks_mask_and_logprobs_and_truncates_to_an_earlier_turn() -> None:
    tokenizer = ByteTokenizer()
    context = TokenContext.from_prompt(tokenizer, "hi")
    context.add_generated([1, 2, 256], [-0.1, -0.2, -0.3])
    l1 = context.digest()
    context.add_text(tokenizer, "ok")
    assert context.token_ids == [104, 105, 1, 2, 256, 111, 107]
    assert context.generated == [False, False, True, True, True, False, False]
    assert context.logprobs == [0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0]
    context.truncate(5)
    assert context.digest() == l1
    with pytest.raises(ValueError, match="cannot truncate"):
        context.truncate(1)  # into the prompt


def test_observation_is_tail_truncated_and_names_the_exit_status() -> None:
    result = ExecResult(stdout="a" * 50 + "END", stderr="", exit_code=3, duration_s=0.1)
    text = render_observation(result, max_chars=10)
    assert "<observation exit=3>" in text
    assert "[... 43 characters cut ...]" in text
    assert "aaaaaaaEND" in text
    timed_out = ExecResult("", "", -1, 30.0, timed_out=True)
    assert "exit=timeout" in render_observation(timed_out, 100)


def test_context_ref_round_trips_and_rejects_foreign_references() -> None:
    assert parse_context_ref(context_ref("run-g0-s1", 12)) == ("run-g0-s1", 12)
    for bad in ("", "file:/x", "router:contexts/t/", "router:contexts/t/x"):
        with pytest.raises(ValueError, match="context reference"):
            parse_context_ref(bad)


# -- records and settings ----------------------------------------------------------------------


def recovery(consistent: bool, *, tokens: int = 10, seconds: float = 1.0) -> RecoveryRecord:
    return RecoveryRecord(
        failed_prefix=3,
        failed_turn=3,
        reason="killed by chaos",
        restored_prefix=2,
        restored_turn=2,
        from_checkpoint=True,
        restore_s=seconds,
        tokens_regenerated=tokens,
        rounds_regenerated=1,
        expected_repo_hash="a" * 64,
        actual_repo_hash=("a" if consistent else "b") * 64,
        context_matches=True,
        prefix_matches=True,
    )


def trajectory(recoveries: list[RecoveryRecord], reward: float) -> AgenticTrajectory:
    return AgenticTrajectory(
        "t", "task", 0, 0, [1, 2], [0, 1], [0.0, -1.0], 1, reward, "submit", 1, 1, 1, 0, "", "adaptive",
        1.0, [], recoveries,
    )  # fmt: skip


def test_a_recovery_is_consistent_only_if_the_repository_hash_matches() -> None:
    assert recovery(True).prefix_consistent
    assert not recovery(False).prefix_consistent
    assert recovery(False).to_dict()["prefix_consistent"] is False


def test_summarize_totals_a_batch() -> None:
    spared = attrs.evolve(recovery(True, tokens=7, seconds=3.0), restore_timings_ms={"spare_ms": 2.0})
    batch = [
        trajectory([recovery(True, tokens=5, seconds=1.0), spared], 1.0),
        trajectory([], 0.0),
    ]
    totals = summarize(batch)
    assert totals["num_failures"] == 2
    assert totals["num_restores_into_spare"] == 1
    assert spared.to_dict()["into_spare"]
    assert not recovery(True).into_spare
    env = EnvTotals()
    env.add(batch)
    assert env.to_dict()["restores_into_spare"] == 1
    assert [r["into_spare"] for r in env.to_dict()["recoveries"]] == [False, True]
    assert totals["tokens_regenerated"] == 12
    assert totals["restore_s_mean"] == 2.0
    assert totals["restore_s_max"] == 3.0
    assert totals["reward_mean"] == 0.5
    assert totals["all_prefix_consistent"]
    assert not summarize([trajectory([recovery(False)], 1.0)])["all_prefix_consistent"]


def test_checkpoints_are_counted_per_kind_with_their_time_and_wait(tmp_path: Path) -> None:
    def ckpt(kind: str, seconds: float, waited: float) -> CheckpointRecord:
        return CheckpointRecord(1, 1, "router:contexts/t/1", "h", "r", seconds, waited, kind=kind)

    one = attrs.evolve(
        trajectory([attrs.evolve(recovery(True), restored_kind="fresh-runtime")], 1.0),
        checkpoints=[ckpt("fresh-runtime", 0.2, 0.1), ckpt("reference", 0.05, 0.0), ckpt("full", 1.0, 0.5)],
    )
    two = attrs.evolve(trajectory([], 0.0), checkpoints=[ckpt("reference", 0.01, 0.0)], kind_query_s=0.25)
    by_kind = count_kinds([one, two])
    assert {k: v["count"] for k, v in by_kind.items()} == {"full": 1, "fresh-runtime": 1, "reference": 2}
    assert by_kind["reference"]["s"] == pytest.approx(0.06)
    assert by_kind["full"]["waited_s"] == 0.5
    assert summarize([one, two])["checkpoints_by_kind"] == {"full": 1, "fresh-runtime": 1, "reference": 2}
    assert one.summary()["checkpoints_by_kind"]["reference"] == 1
    totals = EnvTotals()
    totals.add([one, two], step=1)
    env = totals.to_dict()
    assert env["checkpoints_by_kind"] == {"full": 1, "fresh-runtime": 1, "reference": 2}
    assert env["checkpoint_waited_s_by_kind"]["fresh-runtime"] == 0.1
    assert env["kind_query_s_total"] == 0.25
    assert env["recoveries_by_kind"] == {"fresh-runtime": 1}
    assert env["recoveries"][0]["restored_kind"] == "fresh-runtime"
    line = format_env(
        {"env_failures": 0, "env_checkpoints": 4, "env_checkpoints_full": 1, "env_checkpoints_fresh_runtime": 1,
         "env_checkpoints_reference": 2, "env_prefix_consistent": 1}
    )  # fmt: skip
    assert "4 checkpoints (1 full, 1 fresh-runtime, 2 reference)" in line


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"checkpoint_policy": "sometimes"}, "policy must be"),
        ({"sandbox_kill_probability": 1.5}, "sandbox_kill_probability"),
        ({"policy_failure_probability": -0.1}, "policy_failure_probability"),
        ({"max_rounds": 0}, "max_rounds"),
        ({"invalid_action": "retry"}, "invalid_action"),
        ({"on_unrecoverable": "ignore"}, "on_unrecoverable"),
        ({"max_resamples": -1}, "max_resamples"),
        ({"spare_sandboxes": -1}, "spare_sandboxes"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(
    tmp_path: Path, overrides: dict[str, object], fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        AgenticConfig(checkpoint_root=tmp_path, **overrides)  # type: ignore[arg-type]


def test_the_policy_is_told_the_injected_failure_probability(tmp_path: Path) -> None:
    assert AgenticConfig(checkpoint_root=tmp_path).failure_probability is None
    assert AgenticConfig(checkpoint_root=tmp_path, sandbox_kill_probability=0.2).failure_probability == 0.2
    explicit = AgenticConfig(
        checkpoint_root=tmp_path, sandbox_kill_probability=0.2, policy_failure_probability=0.05
    )
    assert explicit.failure_probability == 0.05


def test_to_samples_trains_only_on_generated_tokens() -> None:
    from belayer_grpo._agentic import to_samples

    base = trajectory([], 1.0)
    agentic = AgenticTrajectory(
        "t", "task", 2, 1, [9, 9, 5, 6, 7, 8], [0, 0, 1, 1, 0, 1], [0.0, 0.0, -0.5, -0.25, 0.0, -1.0],
        2, 1.0, "submit", 2, 1, 2, 0, "", "adaptive", 1.0, [], [], num_resumed_responses=1,
    )  # fmt: skip
    [sample] = to_samples([agentic])
    assert sample.group == 2
    assert sample.prompt_ids == [9, 9]
    assert sample.completion_ids == [5, 6, 7, 8]
    assert sample.loss_mask == [1, 1, 0, 1]
    assert sample.logprobs == [-0.5, -0.25, 0.0, -1.0]
    assert (sample.reward, sample.finish_reason, sample.num_resumes) == (1.0, "submit", 1)
    assert to_samples([base])[0].completion_ids == [2]


def test_a_trajectory_is_written_in_the_policy_simulators_trace_format(tmp_path: Path) -> None:
    from belayer_policy import load_trace

    recorded = attrs.evolve(
        trajectory([recovery(True, seconds=1.5), recovery(True, seconds=2.5)], 1.0),
        step_response_s=[1.0, 2.0, 3.0],
        step_action_s=[0.1, 0.2, 0.3],
        step_checkpoint_s=[None, 0.4, None],
        failed_steps=[1, 3],  # step 3 is the final test run, outside the committed steps
    )
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(recorded.trace_line(node="n1", meta={"step": 4})) + "\n")
    (loaded,) = load_trace(path)
    assert loaded.response_s == (1.0, 2.0, 3.0)
    assert loaded.action_s == (0.1, 0.2, 0.3)
    assert loaded.checkpoint_s == (0.4, 0.4, 0.4)  # the measured cost fills the steps without one
    assert [(f.step, f.at) for f in loaded.failures] == [(1, 0.99)]
    assert loaded.restore_s == (1.5, 2.5)
    assert (loaded.task, loaded.node) == ("task", "n1")


def test_a_node_loss_waits_for_a_checkpoint_only_while_one_can_still_come() -> None:
    """Issue 33: `chaos.kill_node_at_step` with sandboxes waits for a ready checkpoint on its node,
    but no longer than half the step's trajectories, and never past the rollout's end."""
    from belayer_grpo._cluster.node_chaos import NodeLossHold

    hold = NodeLossHold("victim", num_trajectories=4, wants_checkpoint=True)
    assert not hold.claim("another-node")
    hold.trajectory_finished()
    assert not hold.checkpoint_or_late.is_set()  # 1 of 4: a checkpoint may still come
    hold.trajectory_finished()
    assert hold.checkpoint_or_late.is_set()  # half of them done: the node goes with what it has
    assert hold.claim("victim")  # a checkpoint on it now is still held until the loss is handled
    assert not hold.claim("victim")  # only one trajectory is held

    no_checkpoint = NodeLossHold("victim", num_trajectories=0, wants_checkpoint=True)
    no_checkpoint.trajectory_finished()
    assert not no_checkpoint.checkpoint_or_late.is_set()
    no_checkpoint.rollout_over()  # the rollout ended with no checkpoint on the node: go now
    assert no_checkpoint.checkpoint_or_late.is_set()
    assert no_checkpoint.over.is_set()
    no_checkpoint.released.set()
    assert not no_checkpoint.claim("victim")  # the loss is handled: nothing is held any more


def _raise_empty() -> None:
    raise TimeoutError  # an error whose text is empty, as the router link's could be


def test_describe_error_names_the_type_and_where_even_when_the_text_is_empty() -> None:
    try:
        try:
            _raise_empty()
        except TimeoutError as inner:
            raise UnrecoverableTrajectoryError("t-g0-s1", "the sandbox is gone") from inner
    except UnrecoverableTrajectoryError as error:
        text = describe_error(error)
    assert text.startswith("belayer_grpo._errors.UnrecoverableTrajectoryError (test_agentic_units.py:"), text
    assert ": trajectory t-g0-s1: the sandbox is gone <- TimeoutError (test_agentic_units.py:" in text
    assert "in _raise_empty): TimeoutError()" in text


def test_the_plot_marks_restores_from_a_checkpoint_apart_from_restarts(tmp_path: Path) -> None:
    history = [
        {
            "step": 1,
            "reward_mean": 0.1,
            "accuracy": 0.1,
            "env_failures": 3,
            "env_recoveries_from_checkpoint": 2,
        },
        {"step": 2, "reward_mean": 0.2, "accuracy": 0.2, "env_failures": 0, "env_dropped_groups": 1},
        {
            "step": 3,
            "reward_mean": 0.3,
            "accuracy": 0.3,
            "env_failures": 2,
            "env_recoveries_from_checkpoint": 0,
        },
    ]
    assert sandbox_markers(history) == {
        "restored": [(1, 2)],
        "restarted": [(1, 1), (3, 2)],
        "dropped": [(2, 1)],
    }
    # One height per kind: a step's restarts and dropped groups must not overlap.
    assert len({height for *_, height in _MARKERS.values()}) == len(_MARKERS)
    path = write_training_plot(tmp_path / "training.png", history, {"workload": "tooluse"})
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
