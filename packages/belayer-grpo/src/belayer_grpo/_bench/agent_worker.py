"""`ScriptedAgentWorker`: the LLM of the agentic benchmark, a real HTTP worker behind the router.

The benchmark's tiny CPU policy cannot write shell commands, so the agentic experiments drive the
real agent loop, router, sandboxes and checkpoints with a scripted agent instead: it speaks the
router's worker protocol, reads the task and the turn (observations so far) from the prompt and
streams a fixed response, one byte token every ``token_delay_s`` (the decode time that makes the
response bubbles a checkpoint can hide in).  The script inspects the file, does ``rounds - 2``
sleeping bookkeeping actions, fixes the bug, runs the tests and submits, so every trajectory has
the same number of environment steps.  A build task of the default workload (``Build 375 into
file a, ...``) gets the perfect agent's turns: ``mk 375``, ``cat a``, the number it read.  It records how long each (task, turn) response took.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs

from belayer_router import serving

__all__ = ["STOP_TOKEN", "ScriptedAgentWorker", "running_agent_worker", "script_for"]

STOP_TOKEN = 256  # beyond the byte range: the agent loop's stop token
_BUILD = re.compile(r"Build (\d+) into file a, ")
_OBSERVATION = re.compile(r"OUT -?\d+: (.*)\n")

# prompt marker -> (file to inspect, the fix, the test module)
_TASKS: dict[str, tuple[str, str, str]] = {
    "calc.py": ("calc.py", "sed -i 's/return a - b/return a + b/' calc.py", "test_calc"),
    "words.py": ("words.py", "sed -i 's/join(words)/join(reversed(words))/' words.py", "test_words"),
    "countdown.py": ("countdown.py", "sed -i 's/range(start, 0, -1)/range(start, -1, -1)/' countdown.py",
                     "test_countdown"),
}  # fmt: skip


def script_for(marker: str, rounds: int, action_s: float) -> list[str]:
    """The commands of one trajectory of the task ``marker`` (``rounds`` of them)."""
    source, fix, tests = _TASKS[marker]
    bookkeeping = [
        f"sleep {action_s:.3f}; echo note{i} >> notes.txt; wc -l notes.txt" for i in range(rounds - 3)
    ]
    return [f"cat {source}", *bookkeeping, fix, f"sleep {action_s:.3f}; python3 -m unittest -q {tests}"]


@attrs.define
class ScriptedAgentWorker:
    """ASGI app: ``POST /generate`` streams the scripted response; ``GET /health`` answers 200."""

    epoch: int
    rounds: int
    action_s: float
    token_delay_s: float
    padding: int
    response_s: dict[str, list[float]] = attrs.field(factory=dict)  # "marker/turn" -> durations
    num_requests: int = 0

    def response(self, prompt: str) -> tuple[str, str]:
        """``(key, text)``: the response to ``prompt`` and the ``marker/turn`` it is timed under."""
        build = _BUILD.match(prompt)
        if build is not None:  # the default workload's build task (belayer_grpo._agentic.tooluse)
            seen = _OBSERVATION.findall(prompt)
            if not seen:
                return f"build/{len(seen)}", f"ACTION: mk {build.group(1)}\n"
            if len(seen) == 1:
                return f"build/{len(seen)}", "ACTION: cat a\n"
            return f"build/{len(seen)}", f"ANSWER: {(seen[-1].split() or [''])[-1]}\n"
        turn = prompt.count("<observation")
        for marker in _TASKS:
            if marker in prompt:
                commands = script_for(marker, self.rounds, self.action_s)
                command = commands[turn] if turn < len(commands) else "submit"
                thinking = ("I look at the state of the repository and decide. " * 20)[: self.padding]
                return f"{marker}/{turn}", f"Step {turn + 1}. {thinking}\n```bash\n{command}\n```\n"
        return "unknown/0", "ACTION: submit\n"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        if scope.get("method") == "GET":
            await _reply(send, 200, b'{"status":"ok"}', b"application/json")
            return
        request = json.loads(b"".join(chunks))
        if request.get("epoch") != self.epoch:
            await _reply(send, 409, b'{"error":"stale epoch"}', b"application/json")
            return
        self.num_requests += 1
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})  # fmt: skip
        await self._stream(request, send)

    async def _stream(self, request: dict[str, Any], send: Any) -> None:
        started = time.monotonic()
        prompt_ids = [*request["prompt_token_ids"], *request["generated_token_ids"]]
        key, text = self.response(bytes(t for t in prompt_ids if t < 256).decode(errors="replace"))
        tokens = [*text.encode(), STOP_TOKEN]
        first = len(request["generated_token_ids"])
        reason = "length"
        for index in range(first, min(len(tokens), first + int(request["max_tokens"]))):
            await anyio.sleep(self.token_delay_s)
            event = {
                "type": "token",
                "epoch": self.epoch,
                "index": index,
                "token_id": tokens[index],
                "logprob": -0.1,
            }
            await send(
                {"type": "http.response.body", "body": json.dumps(event).encode() + b"\n", "more_body": True}
            )
            if tokens[index] in request["stop_token_ids"]:
                reason = "stop"
                break
        final = {"type": "finish", "epoch": self.epoch, "finish_reason": reason}
        await send(
            {"type": "http.response.body", "body": json.dumps(final).encode() + b"\n", "more_body": False}
        )
        self.response_s.setdefault(key, []).append(time.monotonic() - started)


async def _reply(send: Any, status: int, body: bytes, content_type: bytes) -> None:
    await send(
        {"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]}
    )
    await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def running_agent_worker(
    rounds: int, action_s: float, token_delay_s: float, padding: int, epoch: int = 1
) -> AsyncIterator[tuple[str, ScriptedAgentWorker]]:
    """A `ScriptedAgentWorker` served on loopback for the block: ``(url, worker)``."""
    worker = ScriptedAgentWorker(epoch, rounds, action_s, token_delay_s, padding)
    async with serving(worker, log_level="critical") as url:
        yield url, worker
