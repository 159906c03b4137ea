"""The scripted agent of the agentic tests, served by belayer-router's `FakeWorker`.

The LLM is outside the agentic workload under test, so `belayer_router.testing.FakeWorker` (a real
HTTP worker on loopback) stands in for it; this module only gives it its "policy": a script that
decodes the prompt (byte tokens), picks the task's commands by a marker the problem statement
contains, counts the observations so far to know the turn, and answers with the command, then the
stop token.  Responses are a pure function of the prompt, so a regenerated or resumed response
equals the original.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from belayer_router import ByteTokenizer
from belayer_router.testing import FakeWorker, running_worker, text_script

STOP = 256

# marker in the prompt -> the commands, one per round; `submit` follows the last one.
SCRIPTS: dict[str, list[str]] = {
    "calc.py": [
        "cat calc.py; echo c1 >> notes.txt",
        "sed -i 's/return a - b/return a + b/' calc.py; echo c2 >> notes.txt",
        "python3 -m unittest -q test_calc; echo c3 >> notes.txt",
        "cat notes.txt",
    ],
    "words.py": [
        "grep -n join words.py; echo w1 >> notes.txt",
        "sed -i 's/join(words)/join(reversed(words))/' words.py; echo w2 >> notes.txt",
        "cat notes.txt",
    ],
    "countdown.py": [
        "sed -i 's/range(start, 0, -1)/range(start, -1, -1)/' countdown.py; echo d1 >> notes.txt",
        "python3 -m unittest -q test_countdown; echo d2 >> notes.txt",
        "cat notes.txt",
    ],
}


def scripted_response(prompt: str, scripts: Mapping[str, Sequence[str]]) -> str:
    """The response the script gives to ``prompt``."""
    turn = prompt.count("<observation")
    for marker, commands in scripts.items():
        if marker in prompt:
            command = commands[turn] if turn < len(commands) else "submit"
            if turn % 2:
                return f"Next step.\nACTION: {command}\n"
            return f"I will run this.\n```bash\n{command}\n```\n"
    return "I do not know this task."


@asynccontextmanager
async def running_policy_worker(
    epoch: int = 1, scripts: Mapping[str, Sequence[str]] = SCRIPTS, **options: Any
) -> AsyncIterator[tuple[str, FakeWorker]]:
    """A `FakeWorker` answering with the scripts, on loopback for the block: ``(url, worker)``.

    ``options`` are `FakeWorker`'s (``token_delay_s``, ``die_after_total``, ...).
    """
    script = text_script(ByteTokenizer(), lambda prompt: scripted_response(prompt, scripts), STOP)
    async with running_worker(epoch, script=script, **options) as (url, worker):
        yield url, worker
