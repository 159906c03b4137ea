"""The CLI router as a real process: killed mid-stream and restarted from its persisted journal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from router_helpers import ADMIN_TOKEN, StartRouter

from belayer_router import FinishEvent, RouterClient, TokenEvent
from belayer_router.testing import expected_tokens, running_worker

pytestmark = pytest.mark.anyio


async def test_router_restart_resumes_from_the_persisted_prefix(
    tmp_path: Path, router_process: StartRouter
) -> None:
    journal = tmp_path / "router.jsonl"
    router, url = await router_process(journal)
    restarted = False
    async with running_worker(1, token_delay_s=0.01) as (wurl, worker):
        async with RouterClient(url, admin_token=ADMIN_TOKEN, reconnect_timeout_s=60) as client:
            await client.register("s0", wurl, 1)
            tokens: list[int] = []
            indices: list[int] = []
            finish = None
            async for event in client.generate_stream([1, 2], 40, seed=21, request_id="req-1"):
                if isinstance(event, FinishEvent):
                    finish = event
                else:
                    assert isinstance(event, TokenEvent)
                    tokens.append(event.token_id)
                    indices.append(event.index)
                if len(tokens) == 10 and not restarted:
                    router.kill()  # SIGKILL: no chance to flush anything more
                    await router.wait()
                    await router_process(journal, int(url.rsplit(":", 1)[1]))
                    restarted = True
            assert tokens == expected_tokens(21, 40)
            assert indices == list(range(40))
            assert finish is not None
            assert finish.num_resumes == 1
            metrics = await client.metrics()
            # The registration was persisted too, so the restarted router knows its worker.
            assert [w["url"] for w in await client.workers()] == [wurl]
        resumed = [r for r in worker.requests if r["generated_token_ids"]]
        assert len(resumed) == 1
        assert len(resumed[0]["generated_token_ids"]) % 4 == 0
    regenerated = next(
        int(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("belayer_router_tokens_regenerated")
    )
    # The client had N >= 10 tokens; the restarted router had the preserved prefix P (a multiple of
    # 4, at most 3 behind N) and regenerated the N - P tokens the client already had, unsent.
    preserved = len(resumed[0]["generated_token_ids"])
    assert 0 <= regenerated <= 3
    assert preserved + regenerated >= 10
    ops = [json.loads(line) for line in journal.read_text().splitlines()]
    assert ops[-1] == {"op": "finish", "request_id": "req-1", "finish_reason": "length"}
