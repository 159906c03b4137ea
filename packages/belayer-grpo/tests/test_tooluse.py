"""The tool-use task family: generation, scoring (prefix consistency), the ANSWER action."""

from __future__ import annotations

from typing import Any, cast

import pytest

from belayer_envckpt import ExecResult, Sandbox
from belayer_grpo._agentic import (
    Answer,
    BashAction,
    ToolObservation,
    ToolUseTask,
    generate_tooluse_tasks,
    parse_action,
)
from belayer_grpo._agentic.context import render_prompt
from belayer_grpo._agentic.environment import repository_hash
from belayer_grpo._errors import SandboxCommandError


def test_tasks_are_seeded_and_the_held_out_split_is_disjoint() -> None:
    train, held = generate_tooluse_tasks(3, held_out=20)
    assert (len(train), len(held)) == (80, 20)
    assert generate_tooluse_tasks(3, held_out=20) == (train, held)
    assert generate_tooluse_tasks(4, held_out=20)[1] != held
    assert not {t.instance_id for t in train} & {t.instance_id for t in held}
    assert sorted(t.value for t in train + held) == list(range(100))
    task = held[0]
    assert render_prompt(task).startswith(f"Save {task.value:02d} to file a")


def test_the_answer_must_follow_from_what_the_sandbox_really_returned() -> None:
    task = ToolUseTask("tool-07", 7)
    stored = ToolObservation("echo 07 > a", 0, "")
    read = ToolObservation("cat a", 0, "07\n")
    assert task.answer == "07"
    assert task.score("07", [stored, read]) == 1.0
    assert task.score("08", [stored, read]) == 0.0
    assert task.score(None, [stored, read]) == 0.0
    # Right from the prompt, but never read back from the sandbox: no reward.
    assert task.score("07", [stored]) == 0.0
    assert task.score("07", [stored, ToolObservation("echo 07", 0, "07\n")]) == 0.0
    # The state was lost (a sandbox restarted from its image): the read fails, whatever the answer.
    lost = ToolObservation("cat a", 1, "cat: can't open 'a': No such file or directory\n")
    assert task.score("07", [stored, lost]) == 0.0
    assert task.score("", [stored, lost]) == 0.0
    # A wrong value stored and read back consistently is still wrong.
    wrong = [ToolObservation("echo 03 > a", 0, ""), ToolObservation("cat a", 0, "03\n")]
    assert task.score("03", wrong) == 0.0


def test_answer_lines_end_the_episode_and_actions_win_over_them() -> None:
    assert parse_action("ANSWER: 75\n") == Answer("75")
    assert parse_action("ACTION: cat a\nANSWER: 75\n") == BashAction("cat a")


class FakeSandbox:
    """Stands in for belayer-envckpt's Sandbox: answers probes from a script of results."""

    id = "fake"

    def __init__(self, answers: list[ExecResult]) -> None:
        self.answers = answers
        self.probes = 0

    def probe(self, command: Any, timeout_s: float = 60.0, *, workdir: str | None = None) -> ExecResult:
        self.probes += 1
        return self.answers.pop(0)


def test_a_malformed_repository_hash_is_asked_again_then_reported() -> None:
    good = ExecResult("a" * 64 + "\n", "", 0, 0.01)
    empty = ExecResult("", "", 0, 0.01)  # seen under load: exit 0, no output
    flaky = FakeSandbox([empty, good])
    assert repository_hash(cast(Sandbox, flaky), "/w", retry_pause_s=0.0) == "a" * 64
    assert flaky.probes == 2
    broken = FakeSandbox([empty, empty, empty])
    with pytest.raises(SandboxCommandError, match="3 times"):
        repository_hash(cast(Sandbox, broken), "/w", retry_pause_s=0.0)
    assert broken.probes == 3
