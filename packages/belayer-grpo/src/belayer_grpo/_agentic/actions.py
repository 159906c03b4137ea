"""Parse the bash action out of an LLM response.

A response carries its action either as a fenced block (```` ```bash ````, ```` ```sh ````,
```` ```shell ```` or an unlabelled fence; the first such block wins) or, failing that, as a line
``ACTION: <command>``.  The command ``submit`` ends the episode, and so does a line
``ANSWER: <text>`` without an action (the tool-use tasks score the answer).  Anything else is an
`InvalidAction` whose ``feedback`` tells the model what to do instead.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["Answer", "BashAction", "InvalidAction", "ParsedAction", "Submit", "parse_action"]

_FENCE = re.compile(r"```[ \t]*(?P<lang>[A-Za-z0-9_+-]*)[ \t]*\n(?P<body>.*?)```", re.DOTALL)
_ACTION_LINE = re.compile(r"^[ \t]*ACTION:[ \t]*(?P<command>.*?)[ \t]*$", re.MULTILINE)
_ANSWER_LINE = re.compile(r"^[ \t]*ANSWER:[ \t]*(?P<answer>.*?)[ \t]*$", re.MULTILINE)
_SHELLS = ("", "bash", "sh", "shell")
FORMAT_HINT = "Reply with exactly one shell command in a ```bash block (or a line `ACTION: <command>`)."


@attrs.frozen
class BashAction:
    """A shell command to run in the trajectory's sandbox."""

    command: str


@attrs.frozen
class Submit:
    """The model declares the task done: the episode ends and the tests decide the reward."""


@attrs.frozen
class Answer:
    """The model's final answer: the episode ends and the task scores ``text``."""

    text: str


@attrs.frozen
class InvalidAction:
    """The response holds no usable action; ``feedback`` says why and what to send instead."""

    feedback: str


ParsedAction = BashAction | Submit | Answer | InvalidAction


def _check(command: str, max_command_chars: int) -> ParsedAction:
    command = command.strip()
    if not command:
        return InvalidAction(f"The command is empty. {FORMAT_HINT}")
    if "\x00" in command:
        return InvalidAction(f"The command contains a NUL byte. {FORMAT_HINT}")
    if len(command) > max_command_chars:
        return InvalidAction(f"The command is longer than {max_command_chars} characters; split it up.")
    if command == "submit":
        return Submit()
    return BashAction(command)


def parse_action(text: str, *, max_command_chars: int = 4096) -> ParsedAction:
    """The action of ``text`` (see the module docstring for the accepted forms)."""
    for match in _FENCE.finditer(text):
        if match.group("lang").lower() in _SHELLS:
            return _check(match.group("body"), max_command_chars)
    line = _ACTION_LINE.search(text)
    if line is not None:
        return _check(line.group("command"), max_command_chars)
    answer = _ANSWER_LINE.search(text)
    if answer is not None:
        return Answer(answer.group("answer"))
    if re.search(r"```[ \t]*(bash|sh|shell)?[ \t]*\n", text):
        return InvalidAction(f"The ```bash block is not closed with ```. {FORMAT_HINT}")
    return InvalidAction(f"No action found. {FORMAT_HINT} Send `submit` when the task is done.")
