"""The per-slot broken-stream signal of ``GET /workers``: ``num_stream_failures`` and
``last_stream_failure_at`` count streams that broke on the worker's side, never the router's own
cuts (a handover's retirement, a client that left)."""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx
import pytest
from router_helpers import ADMIN_TOKEN

from belayer_router import RouterClient, RouterConfig, TokenEvent, running_router
from belayer_router.testing import expected_tokens, running_worker, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers


async def _slots(client: RouterClient) -> dict[str, dict[str, Any]]:
    return {s["slot"]: s for s in await client.workers()}


async def _tokens(client: RouterClient, seed: int, max_tokens: int) -> list[int]:
    return [
        e.token_id
        async for e in client.generate_stream([1, 2], max_tokens, seed=seed)
        if isinstance(e, TokenEvent)
    ]


@pytest.mark.parametrize("link", [False, True], ids=["generate", "link"])
async def test_a_killed_worker_counts_on_its_slot_only_and_the_count_survives_reregistration(
    link: bool,
) -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=0.5)
    async with (
        running_worker(1, link=link, die_after=6, token_delay_s=0.005) as (url_a, worker_a),
        running_worker(1, link=link) as (url_b, _),
        running_worker(2, link=link) as (url_a2, _),
        running_router(config) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("a", url_a, 1, link=link)
        before = await _slots(client)
        assert (before["a"]["num_stream_failures"], before["a"]["last_stream_failure_at"]) == (0, None)
        result: list[list[int]] = []
        started = time.time()

        async def run() -> None:
            result.append(await _tokens(client, 4, 30))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            with anyio.fail_after(60):
                await worker_a.died.wait()
            await client.register("b", url_b, 1, link=link)  # where the request resumes
        assert result == [expected_tokens(4, 30)]
        slots = await _slots(client)
        assert slots["a"]["num_stream_failures"] == 1
        failed_at = slots["a"]["last_stream_failure_at"]
        assert isinstance(failed_at, float)
        assert started <= failed_at <= time.time()
        assert (slots["b"]["num_stream_failures"], slots["b"]["last_stream_failure_at"]) == (0, None)
        # A new worker on the slot keeps the slot's count.
        await client.register("a", url_a2, 2, link=link)
        again = (await _slots(client))["a"]
        assert (again["epoch"], again["num_stream_failures"]) == (2, 1)
        assert again["last_stream_failure_at"] == failed_at
        metrics = await client.metrics()
        assert 'belayer_router_slot_stream_failures_total{slot="a"} 1' in metrics


@pytest.mark.parametrize("link", [False, True], ids=["generate", "link"])
async def test_a_client_disconnect_and_a_handover_do_not_count(link: bool) -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=60.0)
    async with (
        running_worker(1, link=link, token_delay_s=0.01) as (url, worker),
        running_worker(1, link=link, pause_at=3) as (url_old, old),
        running_worker(2, link=link) as (url_new, _),
        running_router(config) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", url, 1, link=link)
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"prompt_token_ids": [1], "max_tokens": 100_000, "seed": 1, "request_id": "gone"}
            async with http.stream("POST", f"{router_url}/generate", json=body) as response:
                async for _ in response.aiter_lines():
                    break
        await wait_until(lambda: app.registry.slots["s"].num_outstanding == 0, 60)
        assert worker.num_tokens_sent > 0
        # A handover: the router retires the old worker and cuts its stream itself.
        await client.register("h", url_old, 1, link=link)
        await client.mark_unhealthy("s")
        result: list[list[int]] = []

        async def run() -> None:
            result.append(await _tokens(client, 7, 12))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await wait_until(lambda: old.num_paused >= 1, 60)
            await client.register("h", url_new, 2, link=link)
        assert result == [expected_tokens(7, 12)]
        slots = await _slots(client)
        assert app.metrics.num_resumes == 1
        assert (slots["s"]["num_stream_failures"], slots["s"]["last_stream_failure_at"]) == (0, None)
        assert (slots["h"]["num_stream_failures"], slots["h"]["last_stream_failure_at"]) == (0, None)
