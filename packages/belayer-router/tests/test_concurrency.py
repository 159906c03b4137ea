"""Hundreds of concurrent streams through several failures: no token lost, none repeated."""

from __future__ import annotations

import anyio
import pytest

from belayer_router import RouterClient, RouterConfig, TokenEvent, running_router
from belayer_router.testing import expected_tokens, running_worker, wait_until

pytestmark = pytest.mark.anyio

NUM_STREAMS = 240
MAX_TOKENS = 40


async def test_hundreds_of_streams_survive_crash_handover_lost_slot_and_unhealthy_slot() -> None:
    config = RouterConfig(resume_wait_s=0.3, prefix_interval=16)
    async with (
        running_router(config) as (url, app),
        running_worker(1, token_delay_s=0.01) as (url0, w0),
        running_worker(2, token_delay_s=0.01) as (url0b, w0b),
        running_worker(1, token_delay_s=0.01) as (url1, w1),
        running_worker(1, token_delay_s=0.01) as (url2, _w2),
        running_worker(1, token_delay_s=0.01) as (url3, w3),
        RouterClient(url) as client,
    ):
        for slot, worker_url in (("s0", url0), ("s1", url1), ("s2", url2), ("s3", url3)):
            await client.register(slot, worker_url, 1)
        outputs: dict[int, list[tuple[int, int]]] = {}

        async def run(seed: int) -> None:
            events = outputs.setdefault(seed, [])
            async for event in client.generate_stream([seed], MAX_TOKENS, seed=seed):
                if isinstance(event, TokenEvent):
                    events.append((event.index, event.token_id))

        async with anyio.create_task_group() as group:
            for seed in range(NUM_STREAMS):
                group.start_soon(run, seed)
            await wait_until(lambda: sum(len(v) for v in outputs.values()) >= NUM_STREAMS * 5, 60)
            w0.kill()  # crash with a handover to epoch 2
            await client.unregister("s0", 1)
            await client.register("s0", url0b, 2)
            w1.kill()  # crash with no replacement: its requests move after resume_wait
            await client.mark_unhealthy("s2")  # bad hardware: moved at once
        for seed in range(NUM_STREAMS):
            assert outputs[seed] == list(enumerate(expected_tokens(seed, MAX_TOKENS))), seed
        assert app.metrics.num_resumes >= NUM_STREAMS // 2
        assert w0b.requests
        assert w3.requests
        assert app.metrics.num_tokens == NUM_STREAMS * MAX_TOKENS
        assert all(record.num_preserved == MAX_TOKENS for record in app.journal.records.values())
