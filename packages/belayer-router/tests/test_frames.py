"""``tokens`` frames: the tokens of one engine step in one event, and what a bad frame does.

A malformed, truncated or oversized frame is a typed `WorkerStreamError`: the stream is fenced,
none of the frame's tokens reaches the journal or the client, and the request resumes elsewhere
with exactly the tokens an uninterrupted run produces.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest

from belayer_router import RouterClient, RouterConfig, WorkerStreamError, running_router, serving
from belayer_router.testing import FakeWorker, expected_tokens, logprob_of, running_worker, token_at
from belayer_router.worker import MAX_FRAME_BYTES, WorkerTokens, encode_worker_tokens, parse_worker_event

pytestmark = pytest.mark.anyio

GOOD = {"type": "tokens", "epoch": 1, "index": 0, "token_ids": [5, 6], "logprobs": [-0.1, -0.2]}
MALFORMED: list[Any] = [
    {**GOOD, "token_ids": []},
    {**GOOD, "logprobs": [-0.1]},
    {**GOOD, "token_ids": [5, -6]},
    {**GOOD, "token_ids": [5, True]},
    {**GOOD, "token_ids": [5, 6.5]},
    {**GOOD, "token_ids": [5, 2**32]},  # beyond u32: the client link could not carry it
    {**GOOD, "token_ids": "56"},
    {**GOOD, "logprobs": [-0.1, "x"]},
    {**GOOD, "logprobs": [-0.1, None]},
    {**GOOD, "index": -1},
    {**GOOD, "epoch": "1"},
    {k: v for k, v in GOOD.items() if k != "logprobs"},
    {**GOOD, "token_ids": list(range(5000)), "logprobs": [0.0] * 5000},
]


def test_a_frame_round_trips() -> None:
    line = encode_worker_tokens(3, 7, [1, 2, 3], [-0.5, -1.0, -1.5])
    assert parse_worker_event(line) == WorkerTokens(3, 7, (1, 2, 3), (-0.5, -1.0, -1.5))


@pytest.mark.parametrize("frame", MALFORMED)
def test_malformed_frames_are_typed_errors(frame: Any) -> None:
    with pytest.raises(WorkerStreamError, match="malformed"):
        parse_worker_event(json.dumps(frame).encode())


@pytest.mark.parametrize("line", [json.dumps(GOOD).encode()[:-5], b"", b"\xff\xfe", b"[1, 2]"])
def test_truncated_and_garbage_lines_are_typed_errors(line: bytes) -> None:
    with pytest.raises(WorkerStreamError):
        parse_worker_event(line)


async def test_frames_through_a_kill_and_handover_give_the_exact_tokens() -> None:
    config = RouterConfig(resume_wait_s=30.0)
    async with (
        running_router(config) as (url, app),
        running_worker(1, frame_tokens=8, die_after=20) as (url_a, worker_a),
        running_worker(2, frame_tokens=5) as (url_b, _b),
        RouterClient(url) as client,
    ):
        await client.register("s0", url_a, 1)
        async with serving_replacement(url, worker_a, url_b):
            completion = await client.generate([1, 2], 64, seed=21, request_id="framed")
        record = app.journal.records["framed"]
    assert completion.token_ids == expected_tokens(21, 64)
    assert completion.logprobs == [logprob_of(t) for t in completion.token_ids]
    assert record.token_ids == completion.token_ids
    assert completion.num_resumes == 1


@asynccontextmanager
async def serving_replacement(url: str, dead: FakeWorker, url_b: str) -> AsyncIterator[None]:
    """Register ``url_b`` as epoch 2 of slot s0 once ``dead`` has died."""

    async def replace() -> None:
        await dead.died.wait()
        async with RouterClient(url) as admin:
            await admin.register("s0", url_b, 2)

    async with anyio.create_task_group() as group:
        group.start_soon(replace)
        yield
        group.cancel_scope.cancel()


class BadFrameWorker:
    """Sends good frames for the first ``good`` tokens, then ``bad`` (a line, maybe oversized)."""

    def __init__(self, good: int, bad: bytes) -> None:
        self.good, self.bad = good, bad
        self.hit = anyio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request = json.loads((await receive())["body"])
        self.hit.set()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        tokens = [token_at(request["seed"], i) for i in range(self.good)]
        line = encode_worker_tokens(1, 0, tokens, [logprob_of(t) for t in tokens])
        await send({"type": "http.response.body", "body": line + self.bad, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


BAD_LINES = {
    "length_mismatch": json.dumps({**GOOD, "index": 4, "logprobs": [-0.1]}).encode() + b"\n",
    "wrong_index": encode_worker_tokens(1, 9, [1, 2], [-0.1, -0.2]),
    "past_max_tokens": encode_worker_tokens(1, 4, list(range(40)), [-0.1] * 40),
    "stale_epoch": encode_worker_tokens(7, 4, [1, 2], [-0.1, -0.2]),
    "truncated": encode_worker_tokens(1, 4, [1, 2], [-0.1, -0.2])[:-9],
    "oversized": b'{"type":"tokens","epoch":1,"index":4,"token_ids":[' + b"1," * (MAX_FRAME_BYTES // 2 + 8),
}


@pytest.mark.parametrize("name", list(BAD_LINES))
async def test_a_bad_frame_fences_the_stream_and_journals_nothing_of_it(name: str) -> None:
    bad = BadFrameWorker(4, BAD_LINES[name])
    answers: list[dict[str, Any]] = []
    async with (
        running_router(RouterConfig(resume_wait_s=60.0)) as (url, app),
        serving(bad, log_level="critical") as bad_url,
        running_worker(2) as (good_url, _good),
        RouterClient(url) as client,
        httpx.AsyncClient(base_url=url, timeout=120) as http,
    ):
        await client.register("bad", bad_url, 1)

        async def generate() -> None:
            body = {"prompt_token_ids": [1], "max_tokens": 12, "seed": 8, "request_id": "r", "stream": False}
            answers.append((await http.post("/generate", json=body)).json())

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(generate)
                await bad.hit.wait()  # the request went to the bad worker first
                await client.register("bad", good_url, 2)  # its replacement
        journaled = list(app.journal.records["r"].token_ids)
        resumes = app.metrics.num_resumes
    assert answers[0]["token_ids"] == expected_tokens(8, 12)  # nothing lost, nothing repeated
    assert journaled == expected_tokens(8, 12)  # no token of the bad frame was journaled
    assert resumes == 1
