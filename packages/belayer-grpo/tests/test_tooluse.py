"""The tool-use task family: generation, scoring (prefix consistency), the ANSWER action."""

from __future__ import annotations

from belayer_grpo._agentic import (
    Answer,
    BashAction,
    ToolObservation,
    ToolUseTask,
    generate_tooluse_tasks,
    parse_action,
)
from belayer_grpo._agentic.context import render_prompt


def test_tasks_are_seeded_and_the_held_out_split_is_disjoint() -> None:
    train, held = generate_tooluse_tasks(3, held_out=20)
    assert (len(train), len(held)) == (80, 20)
    assert generate_tooluse_tasks(3, held_out=20) == (train, held)
    assert generate_tooluse_tasks(4, held_out=20)[1] != held
    assert not {t.instance_id for t in train} & {t.instance_id for t in held}
    task = held[0]
    assert str(task.value) in render_prompt(task)
    assert str(task.operand) in render_prompt(task)


def test_the_answer_must_follow_from_what_the_sandbox_really_returned() -> None:
    task = ToolUseTask("tool-75", 7, 5)
    stored = ToolObservation("echo 7 > a", 0, "")
    read = ToolObservation("cat a", 0, "7\n")
    assert task.answer == "75"
    assert task.score("75", [stored, read]) == 1.0
    assert task.score("74", [stored, read]) == 0.0
    assert task.score(None, [stored, read]) == 0.0
    # Right from the prompt, but never read back from the sandbox: no reward.
    assert task.score("75", [stored]) == 0.0
    assert task.score("75", [stored, ToolObservation("echo 7", 0, "7\n")]) == 0.0
    # The state was lost (a sandbox restarted from its image): the read fails, whatever the answer.
    lost = ToolObservation("cat a", 1, "cat: can't open 'a': No such file or directory\n")
    assert task.score("75", [stored, lost]) == 0.0
    assert task.score("5", [stored, lost]) == 0.0
    # A wrong value stored and read back consistently is still wrong.
    assert task.score("35", [ToolObservation("echo 3 > a", 0, ""), ToolObservation("cat a", 0, "3\n")]) == 0.0


def test_answer_lines_end_the_episode_and_actions_win_over_them() -> None:
    assert parse_action("ANSWER: 75\n") == Answer("75")
    assert parse_action("ACTION: cat a\nANSWER: 75\n") == BashAction("cat a")
