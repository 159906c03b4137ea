"""The one place this package runs commands on the host (tar, criu); commands inside a sandbox
are `_exec.py`'s."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import attrs

from ._errors import CommandError


@attrs.frozen
class CommandResult:
    """What a finished command printed and returned."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def run_command(
    argv: Sequence[str], *, timeout_s: float = 300.0, check: bool = True, hint: str = ""
) -> CommandResult:
    """Run ``argv`` without a shell; with ``check``, a non-zero exit raises `CommandError`."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise CommandError(argv, 127, f"{argv[0]}: not found", hint) from exc
    except subprocess.TimeoutExpired as exc:
        raise CommandError(argv, 124, f"timed out after {timeout_s} s", hint) from exc
    result = CommandResult(list(argv), proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stderr or proc.stdout, hint)
    return result
