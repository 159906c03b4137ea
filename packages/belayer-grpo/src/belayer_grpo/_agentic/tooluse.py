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

import hashlib
import io
import random
import re
import tarfile
from typing import ClassVar

import attrs

from belayer_envckpt import BelayerEnvckptError, Engine
from belayer_grpo._errors import GrpoConfigError, SandboxImageError

__all__ = [
    "BUILD_IMAGE",
    "TOOLUSE_IMAGE",
    "BuildTask",
    "ToolObservation",
    "ToolUseTask",
    "ensure_build_image",
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
    # A read-only command whose output is the sandbox's state at the end (None: not read; the
    # score goes by the observations alone).
    state_probe: ClassVar[str | None] = None
    lazy_p: ClassVar[float] = LAZY_DEMONSTRATION_P  # the warm-up demonstrator's share of skipped reads

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

    def transcript(self, rng: random.Random) -> list[tuple[str, ToolObservation | None]]:
        """The right turns (`tooluse_transcript`); ``rng`` draws what the environment would make up."""
        return tooluse_transcript(self)

    def score(
        self, answer: str | None, observations: list[ToolObservation], state: str | None = None
    ) -> float:
        """1.0 when ``answer`` follows from what ``cat a`` last returned and that is the stored value.
        (``state``, what `state_probe` read at the end, is not used by this task.)"""
        if answer is None:
            return 0.0
        reads = [o for o in observations if o.command.split() == ["cat", STATE_FILE]]
        if not reads:
            return 0.0
        read = reads[-1]
        read_value = read.output.strip() if read.exit_code == 0 else ""
        consistent = answer.strip() == self.answer_for(read_value)
        return 1.0 if consistent and read_value == self.text else 0.0


# -- the build task: a slow action whose result the environment makes up -----------------------

BUILD_SECONDS = 1.5
BUILD_ID_HEX = 2  # bytes of /dev/urandom in a build id: 4 hex digits, written as letters
BUILD_ID_LETTERS = "klmnopqrstuvwxyz"  # 0-f as letters: the task's number stays the only digits
# `mk V` builds V into the file ``a``: it takes BUILD_SECONDS, writes ``<build id> V`` there and
# prints it (the number last, where the store task's read shows it), a new id on every run (as a compiler stamps a build, a service hands out a ticket).
# A stand-in for a compile: it waits, it does not load the CPU, so a batch of builds fits on a
# small machine.
MK_SCRIPT = f"""#!/bin/sh
# mk V: build V into ./{STATE_FILE} (takes {BUILD_SECONDS} s) and print "<build id> V"; the id differs on every run.
sleep {BUILD_SECONDS}
id=$(head -c {BUILD_ID_HEX} /dev/urandom | od -An -tx1 | tr -d ' \\n' | tr 0-9a-f {BUILD_ID_LETTERS})
echo "$id $1" > {STATE_FILE}
cat {STATE_FILE}
"""
BUILD_BASE_IMAGE = TOOLUSE_IMAGE
BUILD_IMAGE = f"belayer/grpo-build:{hashlib.sha256(MK_SCRIPT.encode()).hexdigest()[:12]}"
_BUILD_LABEL = "belayer.grpo.image-build"


def _mk_archive() -> bytes:
    data = MK_SCRIPT.encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("bin/mk")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def ensure_build_image(engine: Engine) -> str:
    """`BUILD_IMAGE` (``belayer/busybox`` with ``/bin/mk``), committed locally once; its tag."""
    try:
        if not engine.has_image(BUILD_IMAGE):
            repository, tag = BUILD_IMAGE.rsplit(":", 1)
            engine.commit_archive(
                BUILD_BASE_IMAGE, _mk_archive(), repository=repository, tag=tag, labels={_BUILD_LABEL: "1"}
            )
    except BelayerEnvckptError as error:
        raise SandboxImageError(
            f"building the build task's image {BUILD_IMAGE} from {BUILD_BASE_IMAGE} failed: {error}; "
            "run `bash scripts/setup-system` to build the base image"
        ) from error
    return BUILD_IMAGE


@attrs.frozen
class BuildTask(ToolUseTask):
    """Build ``value`` (``ACTION: mk 375``: it takes seconds, writes the file ``a`` and shows
    ``kqfm 375``: the environment stamps a build id that differs on every run), read the file back
    (``ACTION: cat a``) and reply ``ANSWER: 375``.

    Two properties of real agentic work that make a checkpoint pay: an action that is expensive to
    redo, and an effect that cannot be replayed verbatim (a replay of the actions builds another
    id, so the sandbox no longer holds what the agent saw). The reward checks prefix
    consistency: the answer follows from what ``cat a`` returned, that is the task's value with a
    build id, and the file at the end (`state_probe`) holds exactly every id the agent was shown.
    """

    image: str | None = BUILD_IMAGE
    state_probe: ClassVar[str | None] = f"cat {STATE_FILE}"
    # The build shows the number again before the read: a lazy answer is easier to give, so the
    # demonstrator reads more often than the store task's, or GRPO would see no reward at first.
    lazy_p: ClassVar[float] = 0.5

    @property
    def problem_statement(self) -> str:
        """The task's text (the prompt is this line)."""
        return f"Build {self.text} into file {STATE_FILE}, cat it, reply ANSWER: the number you read\n"

    def answer_for(self, read_value: str) -> str:
        """The answer that follows from reading ``read_value``: the number after the build id."""
        return read_value.split()[-1] if read_value.split() else ""

    def transcript(self, rng: random.Random) -> list[tuple[str, ToolObservation | None]]:
        """The right turns, with a build id drawn from ``rng``."""
        digits = f"{rng.getrandbits(8 * BUILD_ID_HEX):0{2 * BUILD_ID_HEX}x}"
        built = f"{digits.translate(str.maketrans('0123456789abcdef', BUILD_ID_LETTERS))} {self.text}\n"
        build = f"mk {self.text}"
        return [
            (f"ACTION: {build}\n", ToolObservation(build, 0, built)),
            (f"ACTION: cat {STATE_FILE}\n", ToolObservation(f"cat {STATE_FILE}", 0, built)),
            (f"ANSWER: {self.answer_for(built)}\n", None),
        ]

    def score(
        self, answer: str | None, observations: list[ToolObservation], state: str | None = None
    ) -> float:
        """1.0 when ``answer`` follows from what ``cat a`` last returned, that is the task's value
        with a build id, and ``state`` (``a`` at the end) is exactly that and every build the agent
        was shown."""
        if answer is None or state is None:
            return 0.0
        reads = [o for o in observations if o.command.split() == ["cat", STATE_FILE]]
        if not reads or reads[-1].exit_code != 0:
            return 0.0
        read_value = reads[-1].output.strip()
        built = (
            re.fullmatch(rf"[{BUILD_ID_LETTERS}]{{{2 * BUILD_ID_HEX}}} {self.text}", read_value) is not None
        )
        shown = [
            o.output.strip() for o in observations if o.command.split()[:1] == ["mk"] and o.exit_code == 0
        ]
        kept = all(seen == state.strip() for seen in [read_value, *shown])
        return 1.0 if built and kept and answer.strip() == self.answer_for(read_value) else 0.0


def generate_tooluse_tasks(
    seed: int, held_out: int = 40, kind: str = "store"
) -> tuple[list[ToolUseTask], list[ToolUseTask]]:
    """Every value 000-999, shuffled by ``seed``: (training tasks, held-out tasks).  ``held_out``
    must leave at least one training task.  ``kind``: ``store`` (`ToolUseTask`) or ``build``
    (`BuildTask`)."""
    if kind not in ("store", "build"):
        raise GrpoConfigError("data.tool_task", f"must be 'build' or 'store', got {kind!r}")
    values = list(range(10**VALUE_DIGITS))
    if not 0 <= held_out < len(values):
        raise GrpoConfigError(
            "data.held_out",
            f"must be 0 to {len(values) - 1} (there are {len(values)} values), got {held_out}",
        )
    random.Random(seed).shuffle(values)
    make, prefix = (BuildTask, "build") if kind == "build" else (ToolUseTask, "tool")
    tasks = [make(f"{prefix}-{v:0{VALUE_DIGITS}d}", v) for v in values]
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
    `LAZY_DEMONSTRATION_P` it skips the read (stores, then answers from its context: reward 0),
    else the right turns of the task's transcript."""
    turns = task.transcript(rng)
    if rng.random() < task.lazy_p:
        read = f"cat {STATE_FILE}"
        return [turn for turn in turns if turn[1] is None or turn[1].command != read]
    return turns
