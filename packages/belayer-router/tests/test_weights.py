"""The weight-version gate: slots report their committed version, the router requires one.

Real routers (uvicorn on loopback) and `FakeWorker`s; a router restarted on its journal keeps
the gate.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter

from belayer_router import (
    FinishEvent,
    RouterClient,
    RouterClientError,
    RouterConfig,
    RouterFleet,
    TokenEvent,
    running_router,
)
from belayer_router.testing import POISON, expected_tokens, running_worker, wait_until

pytestmark = pytest.mark.anyio

TOKEN = "tok"


def _slots(workers: list[dict[str, object]]) -> dict[object, tuple[object, object]]:
    return {w["slot"]: (w["weight_version"], w["current"]) for w in workers}


async def test_a_slot_behind_is_held_out_until_it_reports_the_version_then_comes_back() -> None:
    config = RouterConfig(admin_token=TOKEN)
    async with (
        running_router(config) as (url, _app),
        running_worker(1) as (a_url, a),
        running_worker(1) as (b_url, b),
        RouterClient(url, admin_token=TOKEN) as client,
    ):
        await client.register("a", a_url, 1)
        await client.register("b", b_url, 1)
        assert _slots(await client.workers()) == {"a": (None, True), "b": (None, True)}  # no gate yet
        await client.report_weight_version("a", 1)
        await client.report_weight_version("b", 1)
        await client.require_weight_version(1)
        await client.report_weight_version("a", 2)  # a moved on before the step did: held out
        assert _slots(await client.workers()) == {"a": (2, False), "b": (1, True)}
        await client.require_weight_version(2)  # the step moves on: b is behind
        assert _slots(await client.workers()) == {"a": (2, True), "b": (1, False)}
        assert await client.required_weight_version() == 2
        before = len(b.requests)
        for seed in range(6):
            completion = await client.generate([1, 2], 8, seed=seed)
            assert completion.token_ids == expected_tokens(seed, 8)
        assert len(b.requests) == before  # nothing new went to the slot behind
        assert len(a.requests) >= 6
        await client.report_weight_version("b", 2)  # b catches up: back in rotation, same epoch
        assert _slots(await client.workers()) == {"a": (2, True), "b": (2, True)}
        for seed in range(6, 12):
            completion = await client.generate([1, 2], 8, seed=seed)
            assert completion.token_ids == expected_tokens(seed, 8)
        assert len(b.requests) > before
        assert all(r["epoch"] == 1 for r in b.requests)
        metrics = await client.metrics()
    assert "belayer_router_required_weight_version 2" in metrics
    assert 'belayer_router_slot_weight_version{slot="b"} 2' in metrics


async def test_a_stream_on_a_slot_that_falls_behind_moves_to_a_current_slot() -> None:
    config = RouterConfig(admin_token=TOKEN, resume_wait_s=60)
    async with (
        running_router(config) as (url, app),
        # a pauses before index 5, and after the pause would send POISON: none may reach the client
        running_worker(1, pause_at=5, poison_after_pause=True) as (a_url, a),
        running_worker(1) as (b_url, b),
        RouterClient(url, admin_token=TOKEN) as client,
    ):
        await client.register("a", a_url, 1)
        await client.register("b", b_url, 1)
        await client.report_weight_version("a", 1)
        await client.report_weight_version("b", 0)
        await client.require_weight_version(1)  # only a is current: the request starts there
        tokens: list[int] = []
        finish: FinishEvent | None = None

        async def consume() -> None:
            nonlocal finish
            async for event in client.generate_stream([3], 20, seed=7, request_id="moved"):
                if isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                elif isinstance(event, FinishEvent):
                    finish = event

        async with anyio.create_task_group() as group:
            group.start_soon(consume)
            await wait_until(lambda: a.num_paused == 1)
            await client.report_weight_version("b", 2)
            await client.require_weight_version(2)  # a is behind now: its stream is cut at once
            a.resume()  # what a sends after the cut must not reach the client
        assert tokens == expected_tokens(7, 20)
        assert POISON not in tokens
        assert finish is not None
        assert finish.num_resumes == 1
        moved = [r for r in b.requests if r["request_id"] == "moved"]
        assert [len(r["generated_token_ids"]) for r in moved] == [5]  # resumed with its 5 tokens
        assert app.metrics.num_version_resumes == 1
        assert app.metrics.num_stale_events == 0


async def test_a_cut_stream_comes_back_to_its_own_slot_once_it_is_current_again() -> None:
    """The only slot moves ahead mid-stream (cut), then the step follows: the same worker resumes it."""
    async with (
        running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=60)) as (url, app),
        running_worker(1, pause_at=5) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
    ):
        await client.register("s", w_url, 1)
        await client.report_weight_version("s", 1)
        await client.require_weight_version(1)
        result = []

        async def generate() -> None:
            result.append(await client.generate([9], 12, seed=3, request_id="back"))

        async with anyio.create_task_group() as group:
            group.start_soon(generate)
            await wait_until(lambda: worker.num_paused == 1)
            await client.report_weight_version("s", 2)  # ahead of the step: held out, stream cut
            await client.require_weight_version(2)  # the step follows: current again
            worker.resume()
        assert result[0].token_ids == expected_tokens(3, 12)
        assert result[0].num_resumes == 1
        runs = [len(r["generated_token_ids"]) for r in worker.requests if r["request_id"] == "back"]
        assert runs == [0, 5]  # not fenced: the same worker (epoch 1) continued it
        assert app.metrics.num_version_resumes == 1


async def test_a_request_waits_for_a_current_slot_and_fails_clearly_without_one() -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=60)) as (url, app),
        running_worker(1) as (w_url, worker),
        RouterClient(url, admin_token=TOKEN) as client,
    ):
        await client.register("s", w_url, 1)
        await client.report_weight_version("s", 2)
        await client.require_weight_version(3)
        result = []

        async def generate() -> None:
            result.append(await client.generate([4], 6, seed=1))

        async with anyio.create_task_group() as group:
            group.start_soon(generate)
            await wait_until(lambda: app.metrics.num_waiting == 1)
            assert worker.requests == []  # held: the only slot is behind
            await client.report_weight_version("s", 3)
        assert result[0].token_ids == expected_tokens(1, 6)
    async with (
        running_router(RouterConfig(resume_wait_s=0.2)) as (url, _app),
        running_worker(1) as (w_url, worker),
        RouterClient(url) as client,
    ):
        await client.register("s", w_url, 1)
        await client.require_weight_version(1)  # the slot never reported a version
        with pytest.raises(RouterClientError) as caught:
            await client.generate([4], 6, seed=1)
        assert caught.value.status == 503
        assert "no healthy worker" in caught.value.message
        assert worker.requests == []


async def test_version_calls_refuse_unknown_slots_backward_versions_and_bad_input() -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN)) as (url, _app),
        running_worker(1) as (w_url, _worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        await client.register("s", w_url, 1)
        with pytest.raises(RouterClientError) as unknown:
            await client.report_weight_version("nope", 1)
        assert unknown.value.status == 404
        assert "unknown slot 'nope'" in unknown.value.message
        await client.report_weight_version("s", 4)
        await client.report_weight_version("s", 4)  # a repeat (a retried call) is a no-op
        with pytest.raises(RouterClientError) as backwards:
            await client.report_weight_version("s", 3)
        assert backwards.value.status == 409
        assert "only moves forward" in backwards.value.message
        await client.require_weight_version(4)
        await client.require_weight_version(4)
        with pytest.raises(RouterClientError) as required_backwards:
            await client.require_weight_version(2)
        assert required_backwards.value.status == 409
        assert "already requires weight version 4" in required_backwards.value.message
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for bad in (-1, "5", True, None):
            response = await http.post("/weights/required", json={"version": bad}, headers=auth)
            assert response.status_code == 400
            assert "'version'" in response.json()["error"]["message"]
        unauthorized = await http.post("/slots/s/weights", json={"version": 9})
        assert unauthorized.status_code == 401
        assert _slots(await client.workers()) == {"s": (4, True)}  # nothing refused was applied


async def test_the_gate_survives_a_router_restart_on_its_journal(tmp_path: Path) -> None:
    config = RouterConfig(admin_token=TOKEN, journal_path=tmp_path / "journal.jsonl", resume_wait_s=0.2)
    async with running_worker(1) as (a_url, _a), running_worker(1) as (b_url, b):
        async with running_router(config) as (url, _app), RouterClient(url, admin_token=TOKEN) as client:
            await client.register("a", a_url, 1)
            await client.register("b", b_url, 1)
            await client.report_weight_version("a", 5)
            await client.report_weight_version("b", 4)
            await client.require_weight_version(5)
        async with running_router(config) as (url, app), RouterClient(url, admin_token=TOKEN) as client:
            assert app.registry.required_version == 5
            assert _slots(await client.workers()) == {"a": (5, True), "b": (4, False)}
            for seed in range(4):
                await client.generate([1], 4, seed=seed)
            assert b.requests == []
            with pytest.raises(RouterClientError):
                await client.require_weight_version(4)  # the replayed gate still only moves forward


async def test_a_router_process_sigkilled_and_restarted_keeps_the_gate(
    tmp_path: Path, router_process: StartRouter
) -> None:
    journal = tmp_path / "router.jsonl"
    router, url = await router_process(journal)
    async with running_worker(1) as (a_url, a), running_worker(1) as (b_url, b):
        async with RouterClient(url, admin_token=ADMIN_TOKEN) as client:
            await client.register("a", a_url, 1)
            await client.register("b", b_url, 1)
            await client.report_weight_version("a", 3)
            await client.report_weight_version("b", 2)
            await client.require_weight_version(3)
        router.kill()  # SIGKILL: what the journal has is all there is
        await router.wait()
        await router_process(journal, int(url.rsplit(":", 1)[1]))
        async with RouterClient(url, admin_token=ADMIN_TOKEN) as client:
            assert await client.required_weight_version() == 3
            assert _slots(await client.workers()) == {"a": (3, True), "b": (2, False)}
            for seed in range(4):
                completion = await client.generate([2], 5, seed=seed)
                assert completion.token_ids == expected_tokens(seed, 5)
            assert b.requests == []
            assert len(a.requests) == 4
            await client.report_weight_version("b", 3)
            await client.generate([2], 5, seed=9)
            assert len(b.requests) == 1  # back in rotation: fewer assigned than a


async def test_a_fleet_reports_and_requires_on_every_router() -> None:
    config = RouterConfig(admin_token=TOKEN)
    async with (
        running_router(config) as (url0, app0),
        running_router(config) as (url1, app1),
        running_worker(1) as (w_url, _worker),
        RouterFleet([url0, url1], admin_token=TOKEN) as fleet,
    ):
        await fleet.register("s", w_url, 1)
        await fleet.report_weight_version("s", 7)
        await fleet.require_weight_version(7)
        for app in (app0, app1):
            assert app.registry.required_version == 7
            assert app.registry.slots["s"].weight_version == 7
        with pytest.raises(RouterClientError):
            await fleet.report_weight_version("s", 6)
