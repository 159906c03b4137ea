"""The multiplexed worker link: one connection per worker, one binary STEP frame per engine step.

Real routers (in-process uvicorn, and `belayer-router serve` processes), real link workers
(`FakeWorker(link=True)` and, for the fuzzing, `EvilWorker` that answers with crafted frames).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter

from belayer_router import (
    LinkProtocolError,
    RouterApp,
    RouterClient,
    RouterConfig,
    TokenEvent,
    running_router,
    serving,
)
from belayer_router._core._emit import EventEmit
from belayer_router._core._registry import Worker
from belayer_router._wire._frames import STEP, FrameBuffer
from belayer_router._worker._link import LinkPool
from belayer_router.testing import POISON, expected_tokens, logprob_of, running_worker, token_at, wait_until
from belayer_router.worker import (
    LinkAbort,
    LinkStep,
    decode_step,
    encode_abort,
    encode_reject,
    encode_step,
    encode_submit,
    read_link_frames,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers


async def _tokens(client: RouterClient, seed: int, max_tokens: int, **options: Any) -> list[int]:
    return [
        e.token_id
        async for e in client.generate_stream([1, 2], max_tokens, seed=seed, **options)
        if isinstance(e, TokenEvent)
    ]


# The codec.


def test_a_step_frame_round_trips() -> None:
    frame = encode_step(7, [(0, 3, [5, 6], [-0.5, -1.25]), (4, 0, [9], [-2.0])], [(4, "stop"), (2, "length")])
    frames = FrameBuffer().feed(frame[:5]) + FrameBuffer().feed(b"")
    assert frames == []
    buffer = FrameBuffer()
    assert buffer.feed(frame[:9]) == []
    assert buffer.pending == 9
    [(kind, payload)] = buffer.feed(frame[9:] + frame[:3])
    assert kind == STEP
    assert buffer.pending == 3
    assert decode_step(payload) == LinkStep(
        7, [0, 4], [3, 0], [2, 1], [5, 6, 9], [-0.5, -1.25, -2.0], [4, 2], ["stop", "length"]
    )


def _step_payload(frame: bytes) -> memoryview:
    return memoryview(frame)[5:]


BAD_STEPS: list[tuple[str, bytes]] = [
    ("shorter than its header", b"\x01\x02"),
    ("cannot hold", struct.pack("<QII", 1, 1000, 0)),
    ("must carry", struct.pack("<QII3I", 1, 1, 0, 0, 0, 0)),  # an entry of 0 tokens
    ("must be", _step_payload(encode_step(1, [(0, 0, [5], [-1.0])])).tobytes()[:-3]),  # truncated
    ("must be", _step_payload(encode_step(1, [(0, 0, [5], [-1.0])])).tobytes() + b"\x00"),  # trailing
    ("unknown finish reason", struct.pack("<QII", 1, 0, 1) + struct.pack("<I", 0) + b"\x07"),
]


@pytest.mark.parametrize(("message", "payload"), BAD_STEPS)
def test_malformed_step_frames_are_typed_errors(message: str, payload: bytes) -> None:
    with pytest.raises(LinkProtocolError, match=message):
        decode_step(memoryview(payload))


@pytest.mark.parametrize("length", [0, (16 << 20) + 1, 2**32 - 1])
def test_oversized_and_empty_frame_lengths_are_refused_before_their_bytes(length: int) -> None:
    with pytest.raises(LinkProtocolError, match="link frame of"):
        FrameBuffer().feed(struct.pack("<I", length) + b"\x03")


# Requests over the link.


async def test_many_requests_share_one_link_and_get_exact_tokens() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.002) as (url, worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", url, 1, link=True)
        results: dict[int, list[int]] = {}

        async def one(seed: int) -> None:
            results[seed] = await _tokens(client, seed, 40)

        async with anyio.create_task_group() as group:
            for seed in range(32):
                group.start_soon(one, seed)
        assert results == {seed: expected_tokens(seed, 40) for seed in range(32)}
        assert worker.num_links == 1
        assert len(worker.requests) == 32
        [slot] = await client.workers()
        assert slot["link"] is True
        completion = await client.generate([3], 10, seed=5, stop_token_ids=[token_at(5, 4)])
        assert completion.token_ids == expected_tokens(5, 10, (token_at(5, 4),))
        assert completion.finish_reason == "stop"
        assert app.journal.records[completion.request_id].logprobs == [
            logprob_of(t) for t in completion.token_ids
        ]


async def test_a_broken_link_resumes_every_request_on_it_exactly() -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=60.0)
    async with (
        running_worker(1, link=True, die_after_total=150, token_delay_s=0.005) as (url, worker),
        running_worker(2, link=True) as (new_url, new_worker),
        running_router(config) as (router_url, _app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", url, 1, link=True)
        results: dict[int, list[int]] = {}

        async def one(seed: int) -> None:
            results[seed] = await _tokens(client, seed, 30)

        async with anyio.create_task_group() as group:
            for seed in range(12):
                group.start_soon(one, seed)
            with anyio.fail_after(60):
                await worker.died.wait()
            await client.register("s", new_url, 2, link=True)  # the shadow's handover
        assert results == {seed: expected_tokens(seed, 30) for seed in range(12)}
        assert new_worker.num_links == 1
        assert all(len(r["generated_token_ids"]) > 0 for r in new_worker.requests)  # continued, not redone


async def test_client_disconnect_aborts_the_request_on_the_link() -> None:
    async with (
        running_worker(1, link=True, token_delay_s=0.01) as (url, worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN)) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", url, 1, link=True)
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"prompt_token_ids": [1], "max_tokens": 100_000, "seed": 1, "request_id": "gone"}
            async with http.stream("POST", f"{router_url}/generate", json=body) as response:
                async for _ in response.aiter_lines():
                    break
        await wait_until(lambda: worker.num_aborts == 1, 60)
        sent = worker.num_tokens_sent
        await anyio.sleep(0.2)
        assert worker.num_tokens_sent == sent  # the worker stopped generating it
        # The link stays up for the next request.
        assert await _tokens(client, 3, 20) == expected_tokens(3, 20)
        assert worker.num_links == 1
        assert app.journal.records["gone"].finish_reason is None


async def test_a_stale_epoch_is_fenced_on_the_link_and_a_rejected_submission_resumes() -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=60.0)
    async with (
        running_worker(1, link=True, claimed_epoch=0, token_delay_s=0.01) as (url, zombie),
        running_worker(2, link=True) as (new_url, worker),
        running_worker(4, link=True) as (last_url, last),
        running_router(config) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", url, 1, link=True)
        async with anyio.create_task_group() as group:

            async def run() -> None:
                assert await _tokens(client, 4, 20) == expected_tokens(4, 20)

            group.start_soon(run)
            await wait_until(lambda: app.metrics.num_stale_events >= 1, 60)
            await client.register("s", new_url, 2, link=True)
        assert app.journal.records  # and none of the zombie's tokens: the result above is exact
        # A worker asked at an epoch it does not serve rejects the submission (the 409 of
        # /generate); the request resumes on the slot's next worker.
        async with anyio.create_task_group() as group:

            async def run_rejected() -> None:
                assert await _tokens(client, 6, 10) == expected_tokens(6, 10)

            await client.register("s", url, 3, link=True)  # the zombie serves epoch 1, not 3
            group.start_soon(run_rejected)
            await wait_until(lambda: any(r["seed"] == 6 for r in zombie.requests), 60)
            await wait_until(lambda: app.metrics.num_resumes >= 2, 60)
            await client.register("s", last_url, 4, link=True)
        assert last.requests[0]["seed"] == 6
        assert worker.requests[-1]["seed"] != 6


# Fuzzing: a worker that answers its link with crafted frames, against real router processes.


def _bad_frames(handle: int) -> dict[str, bytes]:
    poison = encode_step(1, [(handle, 0, [POISON, POISON], [-1.0, -1.0])])
    return {
        "unknown kind": struct.pack("<IB", 1, 9),
        "truncated step": struct.pack("<I", len(poison) - 7) + poison[4:-3],
        "oversized": struct.pack("<IB", (16 << 20) + 1, 3),
        "never issued handle": encode_step(1, [(handle + 7, 0, [POISON], [-1.0])]),
        "duplicate handle": encode_step(1, [(handle, 0, [POISON], [-1.0]), (handle, 1, [POISON], [-1.0])]),
        "wrong index": encode_step(1, [(handle, 3, [POISON], [-1.0])]),
        "too many tokens": encode_step(1, [(handle, 0, [POISON] * 13, [-1.0] * 13)]),
        "bad reason": struct.pack("<IBQII", 22, 3, 1, 0, 1) + struct.pack("<I", handle) + b"\x05",
        "rejected": encode_reject(handle, "engine refused it"),
        "connection dropped": b"",
    }


class EvilWorker:
    """Serves ``POST /link``: on the first submission, one valid frame then the crafted bad one."""

    def __init__(self, case: str) -> None:
        self.case = case
        self.submitted = anyio.Event()
        self.closed = anyio.Event()

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async for message in read_link_frames(receive):
            if isinstance(message, LinkAbort):
                continue
            self.submitted.set()
            body = self._body(message.handle)
            if self.case == "connection dropped":
                raise RuntimeError("die mid-chunk")  # uvicorn drops the connection
            await send({"type": "http.response.body", "body": body, "more_body": True})
        self.closed.set()

    def _body(self, handle: int) -> bytes:
        return _bad_frames(handle)[self.case]


@pytest.mark.parametrize("case", list(_bad_frames(0)))
async def test_bad_frames_fence_the_link_journal_nothing_and_the_request_resumes_exactly(
    case: str, router_process: StartRouter, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    _process, router_url = await router_process(journal)
    evil = EvilWorker(case)
    async with (
        serving(evil, log_level="critical") as evil_url,
        running_worker(2, link=True) as (good_url, _good),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", evil_url, 1, link=True)
        async with anyio.create_task_group() as group:

            async def run() -> None:
                completion = await client.generate([1, 2], 12, seed=8, request_id="fuzzed")
                assert completion.token_ids == expected_tokens(8, 12)
                assert completion.num_resumes >= 1

            group.start_soon(run)
            with anyio.fail_after(60):
                await evil.submitted.wait()
            with anyio.fail_after(60):  # the request broke: it resumes, waiting for the slot
                while "belayer_router_resumes_total 0" in await client.metrics():  # noqa: ASYNC110  (polling another process)
                    await anyio.sleep(0.05)
            if case not in ("rejected", "connection dropped"):
                with anyio.fail_after(60):
                    await evil.closed.wait()  # the router fenced (closed) the link itself
            await client.register("s", good_url, 2, link=True)
        record = await client.request_record("fuzzed")
        assert record["token_ids"] == expected_tokens(8, 12)
    assert str(POISON) not in journal.read_text()


def test_router_frames_encode_for_workers() -> None:
    [(kind, payload)] = FrameBuffer().feed(encode_submit(3, b'{"a":1}') + b"")
    assert kind == 1
    assert bytes(payload) == b'\x03\x00\x00\x00{"a":1}'
    [(kind, payload)] = FrameBuffer().feed(encode_abort(4))
    assert kind == 2
    assert bytes(payload) == b"\x04\x00\x00\x00"
    [(kind, payload)] = FrameBuffer().feed(encode_reject(5, "stale"))
    assert kind == 4
    assert bytes(payload) == b"\x05\x00\x00\x00stale"


async def test_the_link_flag_is_journaled_and_replayed_and_checked(tmp_path: Path) -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, journal_path=tmp_path / "j.jsonl")
    async with running_router(config) as (url, _app), RouterClient(url, admin_token=ADMIN_TOKEN) as client:
        await client.register("a", "http://127.0.0.1:1", 1, link=True)
        await client.register("b", "http://127.0.0.1:2", 1)
        async with httpx.AsyncClient() as http:
            bad = await http.post(
                f"{url}/workers/register",
                json={"slot": "c", "url": "http://127.0.0.1:3", "epoch": 1, "link": "yes"},
                headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
            )
        assert bad.status_code == 400
        assert "'link'" in bad.json()["error"]["message"]
    replayed = RouterApp(config)
    assert {name: s.worker.link for name, s in replayed.registry.slots.items() if s.worker} == {
        "a": True,
        "b": False,
    }
    await replayed.aclose()


async def test_a_worker_that_hangs_on_its_link_is_cut_after_the_read_timeout() -> None:
    """An idle link has no read deadline; a submission starts one, so a hung worker is cut."""
    config = RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=60.0, worker_read_timeout_s=1.0)
    async with (
        running_worker(1, link=True, pause_at=3) as (url, hung),
        running_worker(2, link=True) as (new_url, _worker),
        running_router(config) as (router_url, app),
        RouterClient(router_url, admin_token=ADMIN_TOKEN) as client,
    ):
        await client.register("s", url, 1, link=True)
        assert await _tokens(client, 1, 3) == expected_tokens(1, 3)  # opens the link (no pause before 3)
        await anyio.sleep(1.5)  # the link is idle longer than the read timeout: no harm
        assert app.metrics.num_resumes == 0
        async with anyio.create_task_group() as group:

            async def run() -> None:
                assert await _tokens(client, 2, 10) == expected_tokens(2, 10)

            group.start_soon(run)
            await wait_until(lambda: app.metrics.num_resumes >= 1, 60)  # cut after ~1 s of silence
            await client.register("s", new_url, 2, link=True)
        assert hung.num_paused == 1
        assert hung.num_links == 1
        hung.resume()


# The link's own lifetime (a `LinkPool` driven directly, against a real link worker).


def _link_pool() -> LinkPool:
    return LinkPool(check=lambda *_: None, apply=lambda *_: None, on_stale=lambda: None)


def _discard() -> EventEmit:
    """An emit for submissions whose tokens the test never applies."""
    return EventEmit(lambda event: None, frames=False)


def _submit_body(seed: int, max_tokens: int) -> bytes:
    body = {
        "prompt_token_ids": [1, 2],
        "max_tokens": max_tokens,
        "seed": seed,
        "generated_token_ids": [],
        "stop_token_ids": [],
        "epoch": 1,
    }
    return json.dumps(body).encode()


async def test_a_request_on_a_link_ends_when_the_routers_links_shut_down() -> None:
    """Cancelling the links' task group (app shutdown) fails the waiting request; it does not hang."""
    async with running_worker(1, link=True, pause_at=0) as (url, hung):
        worker, pool = Worker("s", url, 1, link=True), _link_pool()
        async with anyio.create_task_group() as group:
            pool.group = group
            link = await pool.get(worker, 30.0, 60.0)
            attempt = link.submit(_submit_body(1, 10), None, _discard(), 0)  # type: ignore[arg-type]
            await wait_until(lambda: hung.num_paused == 1, 60)
            group.cancel_scope.cancel()
        with anyio.fail_after(60):
            await attempt.done.wait()
        assert attempt.error is not None
        assert "shut down" in str(attempt.error)
        assert link.broken is not None
        hung.resume()


async def test_a_link_whose_worker_is_retired_before_it_runs_closes() -> None:
    """A worker retired between `LinkPool.get` and the link's task starting still has its link cut."""
    async with running_worker(1, link=True) as (url, _worker):
        worker, pool = Worker("s", url, 1, link=True), _link_pool()
        async with anyio.create_task_group() as group:
            pool.group = group
            link = await pool.get(worker, 30.0, 60.0)
            worker.retired = True  # as `Registry` retires it: its link's scope is not registered yet
            for scope in worker.links:
                scope.cancel()
            await wait_until(lambda: link.broken is not None, 60)
            assert "retired" in str(link.broken)
            group.cancel_scope.cancel()


async def test_a_submission_after_every_request_was_aborted_gets_a_fresh_read_deadline() -> None:
    """The deadline an aborted request started (the worker quiet since) does not cut the next one."""
    async with running_worker(1, link=True, pause_at=0) as (url, hung):
        worker, pool = Worker("s", url, 1, link=True), _link_pool()
        async with anyio.create_task_group() as group:
            pool.group = group
            link = await pool.get(worker, 30.0, 60.0)
            first = link.submit(_submit_body(1, 10), None, _discard(), 0)  # type: ignore[arg-type]
            await wait_until(lambda: hung.num_paused == 1 and link._read_scope is not None, 60)
            link.abort(first)
            scope = link._read_scope
            assert scope is not None
            assert scope.deadline != math.inf  # the aborted request's deadline
            aborted_at = anyio.current_time()
            await wait_until(lambda: anyio.current_time() > aborted_at, 60)  # time moves on
            submitted_at = anyio.current_time()
            link.submit(_submit_body(2, 10), None, _discard(), 0)  # type: ignore[arg-type]
            scope = link._read_scope  # the reader waits in a read (it is only out of one synchronously)
            assert scope is not None
            assert scope.deadline >= submitted_at + 60.0
            group.cancel_scope.cancel()
        hung.resume()


class FakePairWorker:
    """Serves ``POST /link``: once two requests are submitted, one STEP frame carrying both."""

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]
    ) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        handles: list[int] = []
        async for message in read_link_frames(receive):
            if isinstance(message, LinkAbort):
                continue
            handles.append(message.handle)
            if len(handles) == 2:
                frame = encode_step(1, [(handle, 0, [5], [-0.5]) for handle in handles])
                await send({"type": "http.response.body", "body": frame, "more_body": True})


async def test_a_stopped_request_stays_stopped_when_a_later_entry_of_its_frame_fails() -> None:
    """A stop string ends its request at once: an entry after it in the same STEP frame that fails
    (a journal error, say) breaks the link for the others, not for the one already stopped."""
    from belayer_router import WorkerStreamError
    from belayer_router._worker._link import Entry, LinkAttempt, Stop

    seen: list[int] = []

    def apply(worker: Worker, live: list[Entry], stop: Stop) -> None:
        seen.append(len(live))
        stop(live[0][0], "stop")
        raise WorkerStreamError("the journal failed on the second entry")

    pool = LinkPool(check=lambda *_: None, apply=apply, on_stale=lambda: None)
    async with serving(FakePairWorker(), log_level="critical") as url:
        worker = Worker("s", url, 1, link=True)
        async with anyio.create_task_group() as group:
            pool.group = group
            link = await pool.get(worker, 30.0, 60.0)
            attempts: list[LinkAttempt] = [
                link.submit(_submit_body(seed, 10), None, _discard(), 0)  # type: ignore[arg-type]
                for seed in (1, 2)
            ]
            with anyio.fail_after(60):
                for attempt in attempts:
                    await attempt.done.wait()
            group.cancel_scope.cancel()
    assert seen == [2]
    assert attempts[0].finish == "stop"
    assert attempts[0].error is None
    assert attempts[1].finish is None
    assert "journal failed" in str(attempts[1].error)
