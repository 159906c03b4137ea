"""`RouterClient` reconnects after a broken router stream, however long that stream had run."""

from __future__ import annotations

import json
from typing import Any

import anyio
import attrs
import pytest

from belayer_router import FinishEvent, RouterClient, TokenEvent, serving
from belayer_router.testing import WorkerKilled

pytestmark = pytest.mark.anyio


@attrs.define
class FakeRouter:
    """Stands in for the router (outside what these tests check): a real HTTP server that streams
    token ``i`` at index ``i``, breaks its first stream after ``break_after`` tokens, and continues
    from ``num_received_tokens`` when the client comes back."""

    break_after: int
    token_delay_s: float
    requests: list[dict[str, Any]] = attrs.field(factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        self.requests.append(request)
        headers = [(b"content-type", b"application/x-ndjson")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for index in range(request["num_received_tokens"], request["max_tokens"]):
            if len(self.requests) == 1 and index == self.break_after:
                raise WorkerKilled  # uvicorn drops the connection mid-body
            event = {"type": "token", "index": index, "token_id": index, "logprob": 0.0}
            await send(
                {"type": "http.response.body", "body": json.dumps(event).encode() + b"\n", "more_body": True}
            )
            await anyio.sleep(self.token_delay_s)
        finish = {
            "type": "finish",
            "request_id": request["request_id"],
            "finish_reason": "length",
            "num_prompt_tokens": len(request["prompt_token_ids"]),
            "num_generated_tokens": request["max_tokens"],
            "num_resumes": len(self.requests) - 1,
        }
        await send({"type": "http.response.body", "body": json.dumps(finish).encode() + b"\n"})


async def test_a_stream_longer_than_the_reconnect_timeout_still_reconnects() -> None:
    # The first stream runs about 12 * 0.05 = 0.6 s, twice the reconnect timeout, before it breaks.
    router = FakeRouter(break_after=12, token_delay_s=0.05)
    async with (
        serving(router, log_level="critical") as url,
        RouterClient(url, reconnect_timeout_s=0.3) as client,
    ):
        events = [event async for event in client.generate_stream([1, 2], 20, seed=1, request_id="r")]
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert tokens == list(range(20))
    assert isinstance(events[-1], FinishEvent)
    assert [r["num_received_tokens"] for r in router.requests] == [0, 12]
    assert router.requests[1]["request_id"] == "r"
