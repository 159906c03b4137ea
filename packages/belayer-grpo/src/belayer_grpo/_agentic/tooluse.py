"""The tool-use task family: a value stored in the sandbox in one turn, read back in a later one.

Each task gives a value ``v`` and a second number ``b``.  The agent must store ``v`` in the file
``a`` of its sandbox (``ACTION: echo v > a``), read it back (``ACTION: cat a``: the observation
shows what the sandbox really holds) and reply ``ANSWER: <f(read value, b)>``, where ``f`` writes
the value read followed by ``b`` (``v=7, b=5`` -> ``75``).  The reward checks prefix consistency:
it is 1 only when the answer follows from what ``cat a`` really returned AND that is the value
the task gave.  A sandbox whose state was lost (restarted from its image while the agent's
context still says the value was stored) shows ``cat: can't open 'a'`` or an empty file: the
answer is wrong, the reward 0.

Tasks are generated from a seed: every pair ``(v, b)`` of digits, shuffled, split into a
training and a held-out set.  Actions are plain ``sh -c`` commands in ``belayer/busybox``.
"""

from __future__ import annotations

import random

import attrs

__all__ = [
    "TOOLUSE_IMAGE",
    "ToolObservation",
    "ToolUseTask",
    "generate_tooluse_tasks",
    "tooluse_transcript",
]

TOOLUSE_IMAGE = "belayer/busybox:latest"
TOOLUSE_WORKDIR = "/w"
STATE_FILE = "a"


@attrs.frozen
class ToolObservation:
    """What one action returned: the command, its exit status and its output."""

    command: str
    exit_code: int
    output: str


@attrs.frozen
class ToolUseTask:
    """Store ``value`` in the sandbox, read it back, answer ``f(read value, operand)``."""

    instance_id: str
    value: int
    operand: int
    image: str | None = TOOLUSE_IMAGE
    workdir: str = TOOLUSE_WORKDIR

    @property
    def problem_statement(self) -> str:
        """The task's text (the prompt is this line)."""
        return f"Save {self.value} to file {STATE_FILE}, cat it, reply ANSWER: what you read, then {self.operand}\n"

    @staticmethod
    def render_observation(exit_code: int, output: str) -> str:
        """A compact observation (the policy is tiny): ``OUT <exit status>: <output>``."""
        return f"OUT {exit_code}: {output.strip()[:200]}\n"

    def answer_for(self, read_value: str) -> str:
        """``f``: the answer that follows from reading ``read_value`` from the sandbox."""
        return f"{read_value}{self.operand}"

    @property
    def answer(self) -> str:
        """The true answer: what follows from reading the value the task gave."""
        return self.answer_for(str(self.value))

    def score(self, answer: str | None, observations: list[ToolObservation]) -> float:
        """1.0 when ``answer`` follows from what ``cat a`` last returned and that is the stored value."""
        if answer is None:
            return 0.0
        reads = [o for o in observations if o.command.split() == ["cat", STATE_FILE]]
        if not reads:
            return 0.0
        read = reads[-1]
        read_value = read.output.strip() if read.exit_code == 0 else ""
        consistent = answer.strip() == self.answer_for(read_value)
        return 1.0 if consistent and read_value == str(self.value) else 0.0


def generate_tooluse_tasks(seed: int, held_out: int = 20) -> tuple[list[ToolUseTask], list[ToolUseTask]]:
    """Every digit pair ``(value, operand)``, shuffled by ``seed``: (training tasks, held-out tasks)."""
    pairs = [(v, b) for v in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    tasks = [ToolUseTask(f"tool-{v}{b}", v, b) for v, b in pairs]
    return tasks[held_out:], tasks[:held_out]


def tooluse_transcript(task: ToolUseTask) -> list[tuple[str, ToolObservation | None]]:
    """The right turns: (response text, what its action returns or None for the answer)."""
    return [
        (f"ACTION: echo {task.value} > {STATE_FILE}\n", ToolObservation(f"echo {task.value} > a", 0, "")),
        (f"ACTION: cat {STATE_FILE}\n", ToolObservation(f"cat {STATE_FILE}", 0, f"{task.value}\n")),
        (f"ANSWER: {task.answer}\n", None),
    ]
