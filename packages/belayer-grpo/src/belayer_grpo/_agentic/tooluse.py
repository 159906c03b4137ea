"""The tool-use task family: a value stored in the sandbox in one turn, read back in a later one.

Each task gives a three-digit value ``v``.  The agent must store it in the file ``a`` of its
sandbox (``ACTION: echo 37 > a``), read it back in a later turn (``ACTION: cat a``: the
observation shows what the sandbox really holds) and reply ``ANSWER: <what it read>``.  The reward
checks prefix consistency: it is 1 only when the answer follows from what ``cat a`` really
returned AND that is the value the task gave.  A sandbox whose state was lost (restarted from its image while the agent's
context still says the value was stored) shows ``cat: can't open 'a'`` or an empty file: the
answer is wrong, the reward 0.

Tasks are generated from a seed: every value 000-999, shuffled, split into a training and a
held-out set with disjoint values.  With 1,000 values a small policy cannot learn the training
values by heart; it has to learn to copy a value, which carries over to the held-out values.
Actions are plain ``sh -c`` commands in ``belayer/busybox``.

The supervised warm-up imitates an imperfect demonstrator (`tooluse_demonstration`): in
`LAZY_DEMONSTRATION_P` of its transcripts it answers right after storing the value, from its own
context, without reading the file back.  That answer earns no reward (it did not come from the
sandbox), so the warmed-up policy starts mostly wrong and GRPO has to learn to read the state.
"""

from __future__ import annotations

import random

import attrs

from belayer_grpo._errors import GrpoConfigError

__all__ = [
    "TOOLUSE_IMAGE",
    "ToolObservation",
    "ToolUseTask",
    "generate_tooluse_tasks",
    "tooluse_demonstration",
    "tooluse_transcript",
]

TOOLUSE_IMAGE = "belayer/busybox:latest"
TOOLUSE_WORKDIR = "/w"
STATE_FILE = "a"
VALUE_DIGITS = 3
LAZY_DEMONSTRATION_P = 0.7  # share of warm-up transcripts that answer without reading the file


@attrs.frozen
class ToolObservation:
    """What one action returned: the command, its exit status and its output."""

    command: str
    exit_code: int
    output: str


@attrs.frozen
class ToolUseTask:
    """Store ``value`` in the sandbox, read it back, answer what was read."""

    instance_id: str
    value: int
    image: str | None = TOOLUSE_IMAGE
    workdir: str = TOOLUSE_WORKDIR

    @property
    def problem_statement(self) -> str:
        """The task's text (the prompt is this line)."""
        return f"Save {self.text} to file {STATE_FILE}, cat it, reply ANSWER: what you read\n"

    @property
    def text(self) -> str:
        """The value as the task writes it (`VALUE_DIGITS` digits)."""
        return f"{self.value:0{VALUE_DIGITS}d}"

    @staticmethod
    def render_observation(exit_code: int, output: str) -> str:
        """A compact observation (the policy is tiny): ``OUT <exit status>: <output>``."""
        return f"OUT {exit_code}: {output.strip()[:200]}\n"

    def answer_for(self, read_value: str) -> str:
        """The answer that follows from reading ``read_value`` from the sandbox."""
        return read_value

    @property
    def answer(self) -> str:
        """The true answer: what follows from reading the value the task gave."""
        return self.answer_for(self.text)

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
        return 1.0 if consistent and read_value == self.text else 0.0


def generate_tooluse_tasks(seed: int, held_out: int = 40) -> tuple[list[ToolUseTask], list[ToolUseTask]]:
    """Every value 000-999, shuffled by ``seed``: (training tasks, held-out tasks).  ``held_out``
    must leave at least one training task."""
    values = list(range(10**VALUE_DIGITS))
    if not 0 <= held_out < len(values):
        raise GrpoConfigError(
            "data.held_out",
            f"must be 0 to {len(values) - 1} (there are {len(values)} values), got {held_out}",
        )
    random.Random(seed).shuffle(values)
    tasks = [ToolUseTask(f"tool-{v:0{VALUE_DIGITS}d}", v) for v in values]
    return tasks[held_out:], tasks[:held_out]


def tooluse_transcript(task: ToolUseTask) -> list[tuple[str, ToolObservation | None]]:
    """The right turns: (response text, what its action returns or None for the answer)."""
    return [
        (
            f"ACTION: echo {task.text} > {STATE_FILE}\n",
            ToolObservation(f"echo {task.text} > {STATE_FILE}", 0, ""),
        ),
        (f"ACTION: cat {STATE_FILE}\n", ToolObservation(f"cat {STATE_FILE}", 0, f"{task.text}\n")),
        (f"ANSWER: {task.answer}\n", None),
    ]


def tooluse_demonstration(task: ToolUseTask, rng: random.Random) -> list[tuple[str, ToolObservation | None]]:
    """One transcript of the warm-up's imperfect demonstrator: with probability
    `LAZY_DEMONSTRATION_P` it skips the read (store, then answer from its context: reward 0),
    else the right turns of `tooluse_transcript`."""
    turns = tooluse_transcript(task)
    if rng.random() < LAZY_DEMONSTRATION_P:
        return [turns[0], turns[-1]]
    return turns
