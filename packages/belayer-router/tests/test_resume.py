"""End to end over loopback HTTP: FakeWorkers behind a real router, resumed through failures."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from belayer_router import FinishEvent, RouterClient, RouterConfig, TokenEvent, running_router
from belayer_router.testing import POISON, expected_tokens, running_worker, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers

PROMPT = [5, 6, 7]


async def collect(
    client: RouterClient, seed: int, max_tokens: int, **options: Any
) -> tuple[list[int], FinishEvent]:
    tokens: list[int] = []
    indices: list[int] = []
    async for event in client.generate_stream(PROMPT, max_tokens, seed=seed, **options):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
            indices.append(event.index)
        else:
            assert indices == list(range(len(tokens)))
            return tokens, event
    raise AssertionError("no finish event")


async def test_uninterrupted_stream_matches_the_worker_sequence() -> None:
    async with running_router() as (url, _), running_worker(1) as (wurl, _), RouterClient(url) as client:
        await client.register("s0", wurl, 1)
        tokens, finish = await collect(client, seed=3, max_tokens=25)
        completion = await client.generate(PROMPT, 25, seed=3)
    assert tokens == expected_tokens(3, 25) == completion.token_ids
    assert (finish.finish_reason, finish.num_generated_tokens, finish.num_resumes) == ("length", 25, 0)
    assert finish.num_prompt_tokens == len(PROMPT)


async def test_stop_token_finishes_with_stop() -> None:
    stop = expected_tokens(4, 30)[9]
    async with running_router() as (url, _), running_worker(1) as (wurl, _), RouterClient(url) as client:
        await client.register("s0", wurl, 1)
        tokens, finish = await collect(client, seed=4, max_tokens=30, stop_token_ids=[stop])
    assert tokens == expected_tokens(4, 30)[:10]
    assert finish.finish_reason == "stop"


async def test_killed_worker_replaced_on_its_slot_gives_the_uninterrupted_output() -> None:
    config = RouterConfig(resume_wait_s=30.0)
    async with (
        running_router(config) as (url, app),
        running_worker(1, die_after=12, token_delay_s=0.001) as (url_a, worker_a),
        running_worker(2) as (url_b, worker_b),
        RouterClient(url) as client,
    ):
        await client.register("s0", url_a, 1)
        result: list[Any] = []

        async def run() -> None:
            result.append(await collect(client, seed=11, max_tokens=40))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await worker_a.died.wait()
            await client.unregister("s0", 1)
            await client.register("s0", url_b, 2)
        tokens, finish = result[0]
        assert tokens == expected_tokens(11, 40)
        assert finish.num_resumes == 1
        resumed = worker_b.requests[0]
        assert resumed["generated_token_ids"] == expected_tokens(11, 12)
        assert resumed["max_tokens"] == 40 - 12
        assert resumed["epoch"] == 2
        assert app.metrics.num_resumes == 1


async def test_without_a_replacement_the_request_finishes_on_another_slot() -> None:
    config = RouterConfig(resume_wait_s=0.2)
    async with (
        running_router(config) as (url, _),
        running_worker(1, die_after=7) as (url_a, _),
        running_worker(1) as (url_b, worker_b),
        RouterClient(url) as client,
    ):
        await client.register("s0", url_a, 1)
        await client.register("s1", url_b, 1)
        tokens, finish = await collect(client, seed=2, max_tokens=30)
    assert tokens == expected_tokens(2, 30)
    assert finish.num_resumes == 1
    assert [len(r["generated_token_ids"]) for r in worker_b.requests] == [7]


async def test_unhealthy_slot_spreads_its_requests_evenly() -> None:
    async with (
        running_router() as (url, app),
        running_worker(1, pause_at=3) as (url_a, worker_a),
        running_worker(1, pause_at=3) as (url_b, worker_b),
        running_worker(1, pause_at=3) as (url_c, worker_c),
        RouterClient(url) as client,
    ):
        for slot, worker_url in (("a", url_a), ("b", url_b), ("c", url_c)):
            await client.register(slot, worker_url, 1)
        results: dict[int, list[int]] = {}

        async def run(seed: int) -> None:
            results[seed] = (await collect(client, seed=seed, max_tokens=10))[0]

        async with anyio.create_task_group() as group:
            for seed in range(30):
                group.start_soon(run, seed)
            await wait_until(
                lambda: not (worker_a.num_paused + worker_b.num_paused + worker_c.num_paused < 30)
            )
            assert (worker_a.num_paused, worker_b.num_paused, worker_c.num_paused) == (10, 10, 10)
            await client.mark_unhealthy("a")
            for worker in (worker_a, worker_b, worker_c):
                worker.resume()
        moved = [sum(1 for r in w.requests if r["generated_token_ids"]) for w in (worker_b, worker_c)]
        assert moved == [5, 5]
        assert results == {seed: expected_tokens(seed, 10) for seed in range(30)}
        slots = {s["slot"]: s for s in await client.workers()}
        assert slots["a"]["healthy"] is False
        assert 'belayer_router_slot_healthy{slot="a"} 0' in app.metrics.render(app.registry)


async def test_replaced_worker_that_keeps_streaming_reaches_no_client() -> None:
    async with (
        running_router() as (url, app),
        running_worker(1, pause_at=5, poison_after_pause=True) as (url_a, zombie),
        running_worker(2) as (url_b, _),
        RouterClient(url) as client,
    ):
        await client.register("s0", url_a, 1)
        result: list[Any] = []

        async def run() -> None:
            result.append(await collect(client, seed=8, max_tokens=20))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await wait_until(lambda: zombie.num_paused >= 1)
            await client.register("s0", url_b, 2)  # handover without unregistering the old one
            zombie.resume()  # the zombie now streams POISON tokens with epoch 1
        tokens, _ = result[0]
        assert POISON not in tokens
        assert tokens == expected_tokens(8, 20)
        assert app.registry.num_handovers == 1


async def test_events_with_a_stale_epoch_are_refused() -> None:
    config = RouterConfig(resume_wait_s=0.1)
    async with (
        running_router(config) as (url, app),
        running_worker(2, claimed_epoch=1) as (url_a, liar),
        running_worker(1) as (url_b, _),
        RouterClient(url) as client,
    ):
        await client.register("s0", url_a, 2)
        await client.register("s1", url_b, 1)
        tokens, finish = await collect(client, seed=5, max_tokens=15)
    assert liar.num_tokens_sent >= 1
    assert tokens == expected_tokens(5, 15)
    assert finish.num_resumes == 1
    assert app.metrics.num_stale_events == 1


async def test_journal_preserves_a_prefix_every_k_tokens_and_at_completion(tmp_path: Any) -> None:
    journal = tmp_path / "journal.jsonl"
    config = RouterConfig(prefix_interval=8, journal_path=journal)
    async with (
        running_router(config) as (url, _),
        running_worker(1, pause_at=10) as (wurl, worker),
        RouterClient(url) as client,
    ):
        await client.register("s0", wurl, 1)
        result: list[Any] = []

        async def run() -> None:
            result.append(
                await client.generate(PROMPT, 21, seed=1, request_id="r1", trajectory_id="t", turn=0)
            )

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await wait_until(lambda: worker.num_paused >= 1)
            mid = await client.request_record("r1")
            worker.resume()
        done = await client.request_record("r1")
        assert (len(mid["token_ids"]), mid["num_preserved"]) == (10, 8)
        assert (done["num_preserved"], done["finish_reason"]) == (21, "length")
        assert done["token_ids"] == result[0].token_ids == expected_tokens(1, 21)
        assert await client.get_context("t") == (0, PROMPT + expected_tokens(1, 21))

    prefix_starts = [
        op["start"] for op in map(json.loads, journal.read_text().splitlines()) if op["op"] == "prefix"
    ]
    assert prefix_starts == [0, 8, 16]


async def test_hung_worker_is_cut_off_by_the_handover_registration() -> None:
    async with (
        running_router() as (url, app),
        running_worker(1, pause_at=6) as (url_a, hung),
        running_worker(2) as (url_b, _),
        RouterClient(url) as client,
    ):
        await client.register("s0", url_a, 1)
        result: list[Any] = []

        async def run() -> None:
            with anyio.fail_after(30):  # without the cut-off this would wait forever
                result.append(await collect(client, seed=13, max_tokens=20))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await wait_until(lambda: hung.num_paused >= 1)
            await client.register("s0", url_b, 2)  # the hung worker never sends another byte
        tokens, finish = result[0]
        assert tokens == expected_tokens(13, 20)
        assert finish.num_resumes == 1
        assert app.metrics.num_stale_events == 0  # cut off by cancellation, not by a late event
        hung.resume()
