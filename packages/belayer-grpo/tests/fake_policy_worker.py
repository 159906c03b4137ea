"""`FakePolicyWorker`: a real HTTP worker on loopback that speaks the router's worker protocol.

It stands in for the LLM (the inference engine is outside the agentic workload under test).  Its
"policy" is a script: it decodes the prompt (byte tokens), picks the task's script by a marker
the problem statement contains, counts the observations so far to know the turn, and streams the
scripted response as bytes followed by the stop token.  Responses are a pure function of the
prompt, so a regenerated or resumed response equals the original.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs

from belayer_router import serving

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


class WorkerKilled(Exception):
    """Raised inside the ASGI app: uvicorn drops the connection mid-body, like a dying engine."""


@attrs.define
class FakePolicyWorker:
    """Streams scripted responses; with ``die_after`` it dies after that many tokens in total."""

    epoch: int
    scripts: Mapping[str, Sequence[str]] = attrs.field(factory=lambda: SCRIPTS)
    token_delay: float = 0.0
    die_after: int | None = None
    dead: bool = False
    died: anyio.Event = attrs.field(factory=anyio.Event)
    num_requests: int = 0
    num_tokens_sent: int = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if self.dead:
            raise WorkerKilled
        request = json.loads(body)
        self.num_requests += 1
        if request["epoch"] != self.epoch:
            await send({"type": "http.response.start", "status": 409, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error":"stale epoch"}'})
            return
        headers = [(b"content-type", b"application/x-ndjson")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await self._stream(request, send)

    async def _stream(self, request: dict[str, Any], send: Any) -> None:
        prompt = bytes(t for t in request["prompt_token_ids"] if t < 256).decode(errors="replace")
        tokens = [*scripted_response(prompt, self.scripts).encode(), STOP]
        start = len(request["generated_token_ids"])
        reason = "length"
        for index in range(start, min(len(tokens), start + request["max_tokens"])):
            if self.dead or (self.die_after is not None and self.num_tokens_sent >= self.die_after):
                self.dead = True
                self.died.set()
                raise WorkerKilled
            token = tokens[index]
            event = {"type": "token", "epoch": self.epoch, "index": index, "token_id": token, "logprob": -0.5}
            line = json.dumps(event).encode() + b"\n"
            await send({"type": "http.response.body", "body": line, "more_body": True})
            self.num_tokens_sent += 1
            if token in request["stop_token_ids"]:
                reason = "stop"
                break
            await anyio.sleep(self.token_delay)
        final = json.dumps({"type": "finish", "epoch": self.epoch, "finish_reason": reason}).encode()
        await send({"type": "http.response.body", "body": final + b"\n", "more_body": False})


@asynccontextmanager
async def running_policy_worker(
    epoch: int = 1, **options: Any
) -> AsyncIterator[tuple[str, FakePolicyWorker]]:
    """A `FakePolicyWorker` served on loopback for the block: ``(url, worker)``."""
    worker = FakePolicyWorker(epoch, **options)
    async with serving(worker, log_level="critical") as url:
        yield url, worker
