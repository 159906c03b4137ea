"""The worker protocol against a real router, heartbeat, handover flag and event log."""

from __future__ import annotations

import json
import math
import os
import struct
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from handover_helpers import router

from belayer_router import GenerateRequest, RouterClient, worker_request_body
from belayer_router.worker import WorkerFinish, WorkerTokens, decode_step, parse_worker_event
from belayer_shadow import LLMEngine, ModelConfig, SamplingParams, StepOutput, allocate_kv_arena, init_weights
from belayer_shadow._workers._events import EventLog, read_events, read_state, write_state
from belayer_shadow._workers._heartbeat import HandoverFlag, Heartbeat
from belayer_shadow._workers._link import LinkConn
from belayer_shadow._workers._service import EngineService, _Job
from belayer_shadow._workers._shadow import check_device_health
from belayer_shadow._workers._stepper import Delivery, Stepper
from belayer_shadow._workers._worker import register_worker

PROMPT = [5, 17, 99, 3, 250, 8]
MAX_TOKENS = 24


def _engine() -> LLMEngine:
    config = ModelConfig.default()
    return LLMEngine(config, init_weights(config, 0), allocate_kv_arena(config, 64, 16))


def _greedy(prompt: list[int], max_tokens: int) -> list[int]:
    engine = _engine()
    engine.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [out.token_id for out in engine.step()]
    return tokens


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[str, str, EngineService]]:
    """(router URL, worker URL, service): one in-process worker registered for slot `w` at epoch 1."""
    from belayer_router import serving

    service = EngineService(
        _engine(), Heartbeat(tmp_path / "hb"), EventLog(tmp_path / "events.jsonl", "test")
    )
    async with (
        router() as (router_url, _app),
        serving(service, log_level="critical") as url,
        anyio.create_task_group() as group,
    ):
        group.start_soon(service.run_loop)
        async with RouterClient(router_url, "test-admin-token") as admin:
            assert await register_worker(admin, "w", url, service) == 1
        yield router_url, url, service
        group.cancel_scope.cancel()


def _body(generated: list[int], epoch: int = 1, request_id: str = "r1") -> dict[str, object]:
    request = GenerateRequest(prompt_token_ids=tuple(PROMPT), max_tokens=MAX_TOKENS, temperature=0.0)
    return worker_request_body(request, request_id, 7, generated, epoch)


async def _post_lines(url: str, body: dict[str, object]) -> list[dict[str, object]]:
    async with httpx.AsyncClient() as client:
        response = await client.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


def _frame_tokens(events: list[dict[str, object]]) -> list[tuple[int, int]]:
    """(index, token id) of every token in the stream's ``tokens`` frames, checking each frame's shape."""
    tokens: list[tuple[int, int]] = []
    for event in events:
        if event["type"] != "tokens":
            continue
        assert set(event) == {"type", "epoch", "index", "token_ids", "logprobs"}
        token_ids, logprobs, first = event["token_ids"], event["logprobs"], event["index"]
        assert isinstance(token_ids, list)
        assert isinstance(logprobs, list)
        assert isinstance(first, int)
        assert len(token_ids) == len(logprobs) > 0
        assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs)
        tokens += [(first + offset, token_id) for offset, token_id in enumerate(token_ids)]
    return tokens


@pytest.mark.anyio
async def test_router_generation_equals_engine_and_events_carry_epoch(
    served: tuple[str, str, EngineService],
) -> None:
    router_url, url, service = served
    reference = _greedy(PROMPT, MAX_TOKENS)
    async with RouterClient(router_url) as client:
        completion = await client.generate(PROMPT, MAX_TOKENS, temperature=0.0)
    assert completion.token_ids == reference
    events = await _post_lines(url, _body([]))
    assert all(e["epoch"] == 1 for e in events)
    assert {e["type"] for e in events[:-1]} == {"tokens"}  # one frame per engine step, no token lines
    assert _frame_tokens(events) == list(enumerate(reference))
    assert events[-1] == {"type": "finish", "epoch": 1, "finish_reason": "length"}
    age = service.heartbeat.age_s()
    assert age is not None
    assert age < 5


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["continue", "regenerate"])
async def test_resume_continues_exactly(served: tuple[str, str, EngineService], mode: str) -> None:
    _router_url, url, service = served
    service.resume_mode = mode  # type: ignore[assignment]
    reference = _greedy(PROMPT, MAX_TOKENS)
    events = await _post_lines(url, _body(reference[:5]))
    assert {e["type"] for e in events} == {"tokens", "finish"}
    assert _frame_tokens(events) == list(enumerate(reference))[5:]
    assert service.num_tokens_regenerated == (5 if mode == "regenerate" else 0)


@pytest.mark.anyio
async def test_the_router_link_carries_one_frame_per_step_for_all_requests(
    served: tuple[str, str, EngineService],
) -> None:
    """Registered with ``link=True``, the worker streams every request over one link, exactly."""
    router_url, _url, service = served
    reference = _greedy(PROMPT, MAX_TOKENS)
    results: list[list[int]] = []
    async with RouterClient(router_url, "test-admin-token") as client:
        [slot] = await client.workers()
        assert slot["link"] is True

        async def one() -> None:
            results.append((await client.generate(PROMPT, MAX_TOKENS, temperature=0.0)).token_ids)

        steps_before = service.num_steps
        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(one)
    assert results == [reference] * 4
    assert (
        0 < service.num_link_frames <= service.num_steps - steps_before
    )  # one frame per step, not per request
    assert service.num_tokens >= 4 * MAX_TOKENS


@pytest.mark.anyio
async def test_a_client_leaving_the_router_aborts_its_request_over_the_link(
    served: tuple[str, str, EngineService],
) -> None:
    router_url, _url, service = served
    body = {"prompt_token_ids": PROMPT, "max_tokens": 900, "request_id": "gone"}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream("POST", f"{router_url}/generate", json=body) as response,
    ):
        async for _line in response.aiter_lines():
            break
    with anyio.fail_after(60):
        while service.engine.has_unfinished() or service._jobs:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert service.num_tokens < 900
    assert service.num_link_frames > 0


def test_a_step_goes_out_as_one_frame_per_request(tmp_path: Path) -> None:
    """Each job gets one ``tokens`` frame per step (hidden regenerated tokens left out), then its finish."""
    service = EngineService(
        _engine(), Heartbeat(tmp_path / "hb"), EventLog(tmp_path / "e.jsonl", "t"), epoch=4
    )
    params = SamplingParams(max_tokens=8)
    streams = {}
    jobs = {}
    for request_id, hidden in (("a", 0), ("b", 2), ("gone", 0)):
        send, receive = anyio.create_memory_object_stream[bytes](100)
        jobs[request_id] = _Job(request_id, PROMPT, params, send, num_hidden=hidden)
        streams[request_id] = receive
    jobs["gone"].finished = True  # aborted while the step ran: its tokens are dropped
    service._dispatch(
        [
            (jobs["a"], StepOutput("a", 3, 11, -0.5)),
            (jobs["b"], StepOutput("b", 1, 21, -0.1)),  # hidden: the client has it already
            (jobs["a"], StepOutput("a", 4, 12, -0.25, finish_reason="stop")),
            (jobs["b"], StepOutput("b", 2, 22, -0.2)),
            (jobs["b"], StepOutput("b", 3, 23, -0.3)),
            (jobs["gone"], StepOutput("gone", 0, 1, -1.0)),
        ]
    )
    assert _drain(streams["gone"]) == []
    a = [parse_worker_event(line) for line in _drain(streams["a"])]
    assert a == [WorkerTokens(4, 3, (11, 12), (-0.5, -0.25)), WorkerFinish(4, "stop")]
    b = [parse_worker_event(line) for line in _drain(streams["b"])]
    assert b == [WorkerTokens(4, 2, (22, 23), (-0.2, -0.3))]
    assert (service.num_tokens, service.num_tokens_regenerated) == (4, 1)


class GatedEngine:
    """The real engine, whose next step the test can hold in flight (after it computed its outputs,
    before it returns them): the window in which the router may abort and resubmit a request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.inner = engine
        self.hold_next = threading.Event()
        self.held = threading.Event()
        self.release = threading.Event()

    def step(self) -> list[StepOutput]:
        outputs = self.inner.step()
        if self.hold_next.is_set():
            self.hold_next.clear()
            self.held.set()
            self.release.wait(60)
        return outputs

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.mark.anyio
async def test_a_request_resubmitted_at_once_after_its_abort_gets_no_stale_token(tmp_path: Path) -> None:
    """Abort + resubmission of the same request id while a step that still serves the old one is in
    flight: the new submission streams exactly its own tokens, none of the old job's."""
    engine = GatedEngine(_engine())
    service = EngineService(engine, Heartbeat(tmp_path / "hb"), EventLog(tmp_path / "e.jsonl", "t"), epoch=1)  # type: ignore[arg-type]
    outbox, frames = anyio.create_memory_object_stream[bytes](math.inf)
    link = LinkConn(outbox)
    other = [9, 8, 7, 6, 5]
    second = GenerateRequest(prompt_token_ids=tuple(other), max_tokens=8, temperature=0.0)
    reference = _greedy(other, 8)
    tokens: dict[int, list[tuple[int, int]]] = {1: [], 2: []}
    async with anyio.create_task_group() as group:
        group.start_soon(service.run_loop)
        engine.hold_next.set()
        assert service.submit_link(link, 1, {**_body([], request_id="same"), "max_tokens": 200}) is None
        assert await anyio.to_thread.run_sync(engine.held.wait, 60)  # its first token is in flight
        service.abort_link(link, 1)
        assert service.submit_link(link, 2, worker_request_body(second, "same", 7, [], 1)) is None
        engine.release.set()
        with anyio.fail_after(60):
            done = False
            while not done:
                frame = await frames.receive()
                _length, kind = struct.unpack_from("<IB", frame)  # the README's frame header
                assert kind == 3, frame  # STEP (a REJECT would mean the engine still held the old job)
                step = decode_step(memoryview(frame)[5:])
                at = 0
                for handle, first, count in zip(step.handles, step.firsts, step.counts, strict=True):
                    ids = step.token_ids[at : at + count]
                    tokens[handle] += [(first + i, t) for i, t in enumerate(ids)]
                    at += count
                done = 2 in step.finished
        group.cancel_scope.cancel()
    assert tokens == {1: [], 2: list(enumerate(reference))}
    assert not service.engine.has_unfinished()
    assert service._jobs == {}


@pytest.mark.anyio
async def test_the_heartbeat_goes_stale_when_the_step_or_the_event_loop_is_stuck(tmp_path: Path) -> None:
    """The stepping thread touches the heartbeat only in iterations in which the event loop ran too."""
    engine = GatedEngine(_engine())
    heartbeat = Heartbeat(tmp_path / "hb")
    service = EngineService(engine, heartbeat, EventLog(tmp_path / "e.jsonl", "t"), epoch=1)  # type: ignore[arg-type]
    outbox, _frames = anyio.create_memory_object_stream[bytes](math.inf)
    link = LinkConn(outbox)

    async def fresh() -> None:
        with anyio.fail_after(60):
            while (age := heartbeat.age_s()) is None or age > 0.5:  # noqa: ASYNC110
                await anyio.sleep(0.02)

    async with anyio.create_task_group() as group:
        group.start_soon(service.run_loop)
        await fresh()
        engine.hold_next.set()
        assert service.submit_link(link, 1, _body([])) is None
        assert await anyio.to_thread.run_sync(engine.held.wait, 60)
        await anyio.sleep(3)  # the event loop runs on; the step does not return
        stuck_step = heartbeat.age_s()
        engine.release.set()
        await fresh()
        time.sleep(3)  # noqa: ASYNC251  the event loop is stuck; the stepping thread is not
        stuck_loop = heartbeat.age_s()
        await fresh()
        group.cancel_scope.cancel()
    assert stuck_step is not None
    assert stuck_step > 1.0
    assert stuck_loop is not None
    assert stuck_loop > 1.0


def _link_tokens(frame: bytes, tokens: dict[int, list[tuple[int, int]]]) -> set[int]:
    """Add a STEP frame's tokens to ``tokens`` (per handle, (index, token id)); its finished handles."""
    _length, kind = struct.unpack_from("<IB", frame)  # the README's frame header
    assert kind == 3, frame  # STEP
    step = decode_step(memoryview(frame)[5:])
    at = 0
    for handle, first, count in zip(step.handles, step.firsts, step.counts, strict=True):
        ids = step.token_ids[at : at + count]
        tokens.setdefault(handle, []).extend((first + i, t) for i, t in enumerate(ids))
        at += count
    return set(step.finished)


@pytest.mark.anyio
async def test_a_link_closed_under_a_step_ends_its_jobs_and_other_links_stream_on(tmp_path: Path) -> None:
    """A STEP frame for a link whose stream is already closed (the router just left, its jobs not
    yet aborted) ends that link's jobs; the other link's frames of the same steps still go out."""
    service = EngineService(
        _engine(), Heartbeat(tmp_path / "hb"), EventLog(tmp_path / "e.jsonl", "t"), epoch=1
    )
    closed_out, closed_in = anyio.create_memory_object_stream[bytes](math.inf)
    closed_in.close()
    outbox, frames = anyio.create_memory_object_stream[bytes](math.inf)
    gone, link = LinkConn(closed_out), LinkConn(outbox)
    reference = _greedy(PROMPT, MAX_TOKENS)
    # Both queued before the loop starts: the engine serves them in the same steps, `gone` first.
    assert service.submit_link(gone, 1, _body([], request_id="gone")) is None
    assert service.submit_link(link, 1, _body([], request_id="kept")) is None
    tokens: dict[int, list[tuple[int, int]]] = {}
    async with anyio.create_task_group() as group:
        group.start_soon(service.run_loop)
        with anyio.fail_after(60):
            while 1 not in _link_tokens(await frames.receive(), tokens):
                pass
        group.cancel_scope.cancel()
    assert tokens == {1: list(enumerate(reference))}
    assert gone.jobs == {}
    assert link.jobs == {}
    assert service._jobs == {}
    assert not service.engine.has_unfinished()


@pytest.mark.anyio
async def test_a_failed_delivery_does_not_strand_the_deliveries_behind_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The event loop's handler raising on one delivery: logged, and the next one is still delivered
    (the engine is idle: no later hand-off would take it)."""
    stepper = Stepper(_engine(), Heartbeat(tmp_path / "hb"), EventLog(None, "t"), 0.05, 0.2)
    bad, good = Delivery([], []), Delivery([], [])
    delivered: list[Delivery] = []

    def deliver(delivery: Delivery) -> None:
        if delivery is bad:
            raise RuntimeError("a bug in the handler")
        delivered.append(delivery)

    stepper.start(deliver)
    try:
        stepper._hand_off(bad)  # as the stepping thread does after a step: queued, one drain posted
        stepper._hand_off(good)
        with anyio.fail_after(60):
            while not delivered:  # noqa: ASYNC110
                await anyio.sleep(0.01)
    finally:
        await anyio.to_thread.run_sync(stepper.stop)
    assert len(delivered) == 1
    assert delivered[0] is good
    assert "a bug in the handler" in caplog.text


@pytest.mark.anyio
async def test_stopping_gives_up_on_a_hung_step_after_its_bound_and_can_start_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A step that does not return does not block the loop's shutdown past `stop_timeout_s`: the stop
    is logged and the step is left to the daemon thread; once it returns, the loop runs again."""
    engine = GatedEngine(_engine())
    log = EventLog(tmp_path / "e.jsonl", "t")
    service = EngineService(engine, Heartbeat(tmp_path / "hb"), log, epoch=1, stop_timeout_s=0.5)  # type: ignore[arg-type]
    outbox, frames = anyio.create_memory_object_stream[bytes](math.inf)
    link = LinkConn(outbox)
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(service.run_loop)
            engine.hold_next.set()
            assert service.submit_link(link, 1, _body([], request_id="held")) is None
            assert await anyio.to_thread.run_sync(engine.held.wait, 60)
            group.cancel_scope.cancel()  # run_loop stops the stepper: it waits at most 0.5 s
        assert service.step_in_progress
        assert "did not return" in caplog.text
        assert "stepper.stop_timed_out" in [event["event"] for event in read_events(tmp_path / "e.jsonl")]
    finally:
        engine.release.set()
    with anyio.fail_after(60):
        while service.step_in_progress:  # noqa: ASYNC110
            await anyio.sleep(0.02)
    service.abort_link(link, 1)
    tokens: dict[int, list[tuple[int, int]]] = {}
    async with anyio.create_task_group() as group:
        group.start_soon(service.run_loop)
        assert service.submit_link(link, 2, _body([], request_id="next")) is None
        with anyio.fail_after(60):
            while 2 not in _link_tokens(await frames.receive(), tokens):
                pass
        group.cancel_scope.cancel()
    assert tokens[2] == list(enumerate(_greedy(PROMPT, MAX_TOKENS)))


def _drain(stream: anyio.streams.memory.MemoryObjectReceiveStream[bytes]) -> list[bytes]:
    lines: list[bytes] = []
    while True:
        try:
            lines.append(stream.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return lines


@pytest.mark.anyio
async def test_bad_requests_get_clear_errors(served: tuple[str, str, EngineService]) -> None:
    _router_url, url, _service = served
    async with httpx.AsyncClient() as client:
        stale = await client.post(f"{url}/generate", json=_body([], epoch=3))
        assert stale.status_code == 409
        assert "epoch 1" in stale.json()["error"]
        missing = await client.post(f"{url}/generate", json={"epoch": 1})
        assert missing.status_code == 400
        assert "request_id" in missing.json()["error"]
        garbage = await client.post(f"{url}/generate", content=b"{not json")
        assert garbage.status_code == 400
        assert (await client.get(f"{url}/nope")).status_code == 404
        health = (await client.get(f"{url}/health")).json()
        assert health["status"] == "ok"
        assert health["epoch"] == 1
    lines = await _post_lines(url, {**_body([]), "prompt_token_ids": [100_000]})
    assert lines == [{"type": "error", "epoch": 1, "message": lines[0]["message"]}]
    assert "vocabulary" in str(lines[0]["message"]) or "token ids" in str(lines[0]["message"])


@pytest.mark.anyio
async def test_client_disconnect_aborts_the_request(served: tuple[str, str, EngineService]) -> None:
    _router_url, url, service = served
    body = {**_body([], request_id="gone"), "max_tokens": 2000}
    async with httpx.AsyncClient() as client, client.stream("POST", f"{url}/generate", json=body) as response:
        async for _line in response.aiter_lines():
            break
    with anyio.fail_after(30):
        while service.engine.has_unfinished():  # noqa: ASYNC110
            await anyio.sleep(0.01)
    assert service.num_tokens < 2000


def test_heartbeat_records_writer_and_age(tmp_path: Path) -> None:
    heartbeat = Heartbeat(tmp_path / "hb")
    assert heartbeat.age_s() is None
    assert heartbeat.writer_pid() is None
    heartbeat.touch()
    assert heartbeat.writer_pid() == os.getpid()
    age = heartbeat.age_s()
    assert age is not None
    assert age < 5
    past = time.time() - 100
    os.utime(heartbeat.path, (past, past))
    stale = heartbeat.age_s()
    assert stale is not None
    assert stale > 50
    heartbeat.touch()
    fresh = heartbeat.age_s()
    assert fresh is not None
    assert fresh < 5


def test_handover_flag_and_state_files(tmp_path: Path) -> None:
    flag = HandoverFlag(tmp_path / "flag")
    assert not flag.is_raised()
    assert flag.read() is None
    flag.raise_("main exited", exit_code=-9)
    assert flag.is_raised()
    assert flag.read() == {
        "reason": "main exited",
        "exit_code": -9,
        "time": pytest.approx(time.time(), abs=60),
    }
    flag.clear()
    assert not flag.is_raised()
    assert read_state(tmp_path / "state") is None
    write_state(tmp_path / "state", "serving", url="http://x", epoch=2)
    state = read_state(tmp_path / "state")
    assert state is not None
    assert state["state"] == "serving"
    assert state["epoch"] == 2


def test_event_log_times_steps_and_skips_torn_lines(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", "unit")
    with log.step("fast"):
        pass
    with pytest.raises(RuntimeError), log.step("broken"):
        raise RuntimeError("boom")
    with (tmp_path / "events.jsonl").open("a") as handle:
        handle.write('{"torn": ')
    events = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["fast", "broken"]
    assert events[1]["error"] == "RuntimeError: boom"
    assert all(e["source"] == "unit" and e["duration_s"] >= 0 for e in events)
    assert 'step="broken"' in log.render_metrics()
    assert read_events(tmp_path / "missing.jsonl") == []


def test_host_health_check_passes() -> None:
    import torch

    assert check_device_health(torch.device("cpu")) == "host tensor ops correct"
