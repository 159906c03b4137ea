"""The tool-use task family: generation, scoring (prefix consistency), the ANSWER action."""

from __future__ import annotations

import functools
import random
from typing import Any, cast

import pytest
import torch

from belayer_envckpt import ExecResult, SandboxLike
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
from belayer_grpo._agentic.tooluse import LAZY_DEMONSTRATION_P, tooluse_demonstration, tooluse_transcript
from belayer_grpo._config import DataConfig, load_config
from belayer_grpo._errors import GrpoConfigError, SandboxCommandError


def test_tasks_are_seeded_and_the_held_out_split_is_disjoint() -> None:
    train, held = generate_tooluse_tasks(3, held_out=40)
    assert (len(train), len(held)) == (960, 40)
    assert generate_tooluse_tasks(3, held_out=40) == (train, held)
    assert generate_tooluse_tasks(4, held_out=40)[1] != held
    # the code's defaults are the embedded default's, and every value held out leaves none to train on
    assert generate_tooluse_tasks(3) == (train, held)
    assert load_config(None, []).data.held_out == DataConfig().held_out == 40
    with pytest.raises(GrpoConfigError, match="must be 0 to 999"):
        generate_tooluse_tasks(3, held_out=1000)
    with pytest.raises(GrpoConfigError, match=r"data\.held_out"):
        load_config(None, ["data.held_out=1000"])
    assert not {t.instance_id for t in train} & {t.instance_id for t in held}
    assert sorted(t.value for t in train + held) == list(range(1000))
    task = held[0]
    assert render_prompt(task).startswith(f"Save {task.value:03d} to file a")


def test_the_warmup_demonstrator_often_answers_without_reading_and_earns_nothing_then() -> None:
    rng = random.Random(0)
    task = ToolUseTask("tool-042", 42)
    transcripts = [tooluse_demonstration(task, rng) for _ in range(2000)]
    lazy = [t for t in transcripts if len(t) == 2]
    assert abs(len(lazy) / len(transcripts) - LAZY_DEMONSTRATION_P) < 0.05
    assert all(t == tooluse_transcript(task) for t in transcripts if len(t) != 2)
    # What the two kinds of transcript earn: the lazy answer is right, but was never read back.
    for transcript, reward in ((lazy[0], 0.0), (tooluse_transcript(task), 1.0)):
        observations = [o for _, o in transcript if o is not None]
        answer = parse_action(transcript[-1][0])
        assert isinstance(answer, Answer)
        assert answer.text == "042"
        assert task.score(answer.text, observations) == reward


def test_the_supervised_warmups_share_one_loop_that_learns() -> None:
    from belayer_grpo._model import build_policy, build_tokenizer, engine_model_config
    from belayer_grpo._rollout_agentic import action_warmup, tooluse_warmup

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config = load_config(None, ["model.hidden_size=32", "model.intermediate_size=64"])
        tokenizer = build_tokenizer(config.model, "tooluse")
        train = generate_tooluse_tasks(0, held_out=40)[0]
        for warmup in (tooluse_warmup, functools.partial(action_warmup, max_rounds=3)):
            model = build_policy(engine_model_config(config.model, tokenizer), seed=0)
            losses = warmup(model, tokenizer, train, steps=40, learning_rate=3e-3, batch_size=4, seed=0)
            assert len(losses) == 40
            assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
            assert not model.training
    finally:
        torch.set_num_threads(threads)  # later in-process tests keep the machine's threads


def test_the_answer_must_follow_from_what_the_sandbox_really_returned() -> None:
    task = ToolUseTask("tool-007", 7)
    stored = ToolObservation("echo 007 > a", 0, "")
    read = ToolObservation("cat a", 0, "007\n")
    assert task.answer == "007"
    assert task.score("007", [stored, read]) == 1.0
    assert task.score("008", [stored, read]) == 0.0
    assert task.score(None, [stored, read]) == 0.0
    # Right from the prompt, but never read back from the sandbox: no reward.
    assert task.score("007", [stored]) == 0.0
    assert task.score("007", [stored, ToolObservation("echo 007", 0, "007\n")]) == 0.0
    # The state was lost (a sandbox restarted from its image): the read fails, whatever the answer.
    lost = ToolObservation("cat a", 1, "cat: can't open 'a': No such file or directory\n")
    assert task.score("007", [stored, lost]) == 0.0
    assert task.score("", [stored, lost]) == 0.0
    # A wrong value stored and read back consistently is still wrong.
    wrong = [ToolObservation("echo 003 > a", 0, ""), ToolObservation("cat a", 0, "003\n")]
    assert task.score("003", wrong) == 0.0


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
    assert repository_hash(cast(SandboxLike, flaky), "/w", retry_pause_s=0.0) == "a" * 64
    assert flaky.probes == 2
    broken = FakeSandbox([empty, empty, empty])
    with pytest.raises(SandboxCommandError, match="3 times"):
        repository_hash(cast(SandboxLike, broken), "/w", retry_pause_s=0.0)
    assert broken.probes == 3
