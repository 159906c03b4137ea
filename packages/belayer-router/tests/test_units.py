"""Pure bookkeeping: registry epochs and routing, journal prefixes and persistence, wire parsing."""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from belayer_router import (
    GenerateRequest,
    InvalidRequestError,
    Journal,
    JournalError,
    JournalStore,
    NotFoundError,
    Registry,
    RouterApp,
    RouterConfig,
    StaleEpochError,
    WorkerFinish,
    WorkerStreamError,
    WorkerToken,
    parse_worker_event,
    worker_request_body,
)

pytestmark = pytest.mark.anyio


def test_registration_replaces_lower_epochs_and_fences_older_ones() -> None:
    registry = Registry()
    first = registry.register("s", "http://a", 1)
    second = registry.register("s", "http://b", 2)
    assert first.retired
    assert not second.retired
    assert registry.num_handovers == 1
    with pytest.raises(StaleEpochError, match="epoch >= 3"):
        registry.register("s", "http://a", 2)
    with pytest.raises(StaleEpochError):
        registry.unregister("s", 1)
    with pytest.raises(NotFoundError):
        registry.unregister("s", 5)
    with pytest.raises(NotFoundError):
        registry.mark_unhealthy("nope")
    registry.unregister("s", 2)
    registry.unregister("s", 2)
    assert second.retired
    assert registry.slots["s"].worker is None


def test_unhealthy_slots_are_never_picked_nor_reregistered() -> None:
    registry = Registry()
    registry.register("a", "http://a", 1)
    registry.register("b", "http://b", 1)
    registry.mark_unhealthy("a")
    assert registry.pick() is registry.slots["b"].worker
    with pytest.raises(StaleEpochError, match="unhealthy"):
        registry.register("a", "http://a2", 2)


async def test_least_outstanding_routing_and_exclusion() -> None:
    registry = Registry()
    for slot in ("a", "b", "c"):
        registry.register(slot, f"http://{slot}", 1)
    picked = []
    with ExitStack() as attempts:
        for _ in range(6):
            worker = registry.pick()
            assert worker is not None
            picked.append(worker.slot)
            attempts.enter_context(registry.attempt(worker))
        assert [s.num_outstanding for s in registry.slots.values()] == [2, 2, 2]
    assert picked == ["a", "b", "c", "a", "b", "c"]
    assert [s.num_outstanding for s in registry.slots.values()] == [0, 0, 0]
    assert registry.pick(frozenset({("a", 1), ("b", 1), ("c", 1)})) is None


async def test_waiting_for_a_replacement_returns_the_newer_worker_or_none() -> None:
    registry = Registry()
    registry.register("s", "http://a", 1)
    assert await registry.wait_for_replacement("s", 1, 0.01) is None
    registry.register("s", "http://b", 2)
    replacement = await registry.wait_for_replacement("s", 1, 0.01)
    assert replacement is not None
    assert replacement.epoch == 2
    registry.mark_unhealthy("s")
    assert await registry.wait_for_replacement("s", 2, 10.0) is None  # at once


def request(max_tokens: int = 10, **fields: object) -> GenerateRequest:
    return GenerateRequest(prompt_token_ids=(1, 2), max_tokens=max_tokens, **fields)  # type: ignore[arg-type]


def test_journal_prefix_advances_every_k_and_persists(tmp_path: Path) -> None:
    store = JournalStore(tmp_path / "j.jsonl")
    journal = Journal(store, prefix_interval=3)
    record = journal.begin("r", request(7, trajectory_id="t", turn=2), seed=5)
    for token in range(7):
        journal.append(record, token, -0.5)
        assert record.num_preserved == (token + 1) // 3 * 3
    reopened = Journal(JournalStore(tmp_path / "j.jsonl"), prefix_interval=3)
    reopened.load()
    assert reopened.records["r"].token_ids == [0, 1, 2, 3, 4, 5]  # the unpreserved 7th is lost
    journal.finish(record, "length")
    store.close()
    final = Journal(JournalStore(tmp_path / "j.jsonl"))
    final.load()
    assert final.records["r"].token_ids == list(range(7))
    assert final.records["r"].finish_reason == "length"
    assert final.get_context("t") == (2, [1, 2, *range(7)])


def test_journal_ignores_a_torn_last_line_and_rejects_corruption(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    journal = Journal(JournalStore(path))
    journal.put_context("t", 0, [1, 2])
    assert journal.store is not None
    journal.store.close()
    with path.open("ab") as file:
        file.write(b'{"op":"context","traj')
    reloaded = Journal(JournalStore(path))
    reloaded.load()
    assert reloaded.get_context("t") == (0, [1, 2])
    reloaded.put_context("t", 1, [3])  # appending drops the torn line first
    again = Journal(JournalStore(path))
    again.load()
    assert again.get_context("t") == (1, [3])
    path.write_bytes(b"garbage\n{}\n")
    with pytest.raises(JournalError, match="line 1 is corrupt"):
        Journal(JournalStore(path)).load()


def test_worker_events_parse_and_reject_garbage() -> None:
    assert parse_worker_event(
        b'{"type":"token","epoch":3,"index":0,"token_id":7,"logprob":-1}'
    ) == WorkerToken(3, 0, 7, -1.0)
    assert parse_worker_event(b'{"type":"finish","epoch":3,"finish_reason":"stop"}') == WorkerFinish(
        3, "stop"
    )
    for bad in (
        b"{",
        b'{"type":"token"}',
        b'{"type":"finish","epoch":1,"finish_reason":"x"}',
        b'{"type":"error","epoch":1,"message":"oom"}',
        b'{"type":"token","epoch":1,"index":0,"token_id":"7","logprob":-1}',
        b'{"type":"token","epoch":1,"index":0,"token_id":7.5,"logprob":-1}',
        b'{"type":"token","epoch":1,"index":0,"token_id":4294967296,"logprob":-1}',
        b'{"type":"token","epoch":1,"index":true,"token_id":7,"logprob":-1}',
        b'{"type":"token","epoch":"1","index":0,"token_id":7,"logprob":-1}',
        b'["token"]',
    ):
        with pytest.raises(WorkerStreamError):
            parse_worker_event(bad)


def test_worker_request_continues_from_the_generated_tokens() -> None:
    body = worker_request_body(request(10, stop_token_ids=(9,)), "r", 42, [4, 5, 6], epoch=2)
    assert body["prompt_token_ids"] == [1, 2]
    assert body["generated_token_ids"] == [4, 5, 6]
    assert body["max_tokens"] == 7
    assert (body["seed"], body["epoch"], body["stop_token_ids"]) == (42, 2, [9])


@pytest.mark.parametrize(
    "line",
    [
        b'{"op":"begin","request_id":"r"}',
        b'{"op":"prefix","request_id":"r"}',
        b'{"op":"context","trajectory_id":"t"}',
    ],
)
def test_journal_with_a_malformed_operation_raises_journal_error(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "j.jsonl"
    good = Journal(JournalStore(path))
    good.begin("r", request(), seed=1)
    assert good.store is not None
    good.store.close()
    with path.open("ab") as file:
        file.write(line + b"\n")
    with pytest.raises(JournalError, match="malformed"):
        Journal(JournalStore(path)).load()


def test_a_journal_with_an_unreplayable_registration_raises_journal_error(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"op":"register","slot":"s","epoch":1}\n')  # no url
    with pytest.raises(JournalError, match="cannot be replayed"):
        RouterApp(RouterConfig(journal_path=path))


def test_put_context_rejects_bad_turns() -> None:
    with pytest.raises(InvalidRequestError):
        Journal().put_context("t", -1, [])


@pytest.mark.parametrize("durability", ["none", "group", "fsync"])
def test_every_durability_mode_persists_and_reloads(tmp_path: Path, durability: str) -> None:
    store = JournalStore(tmp_path / "j.jsonl", durability=durability)  # type: ignore[arg-type]
    ops = [{"op": "context", "trajectory_id": "t", "turn": i, "token_ids": [i]} for i in range(50)]
    for op in ops:
        store.append(op)
    if durability == "group":  # the background thread commits the group without a close
        deadline = time.monotonic() + 60
        while store.num_fsyncs == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.num_fsyncs >= 1
    store.close()
    assert list(JournalStore(tmp_path / "j.jsonl").read()) == ops
    if durability == "fsync":
        assert store.num_fsyncs == 50
    if durability == "none":
        assert store.num_fsyncs == 0


def test_a_failed_group_commit_is_reported_by_the_next_append(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    store = JournalStore(tmp_path / "j.jsonl", durability="group")
    store.append({"op": "context", "trajectory_id": "t", "turn": 0, "token_ids": [0]})
    monkeypatch.setattr(os, "fsync", broken_fsync)
    deadline = time.monotonic() + 60
    with pytest.raises(JournalError, match="could not fsync"):  # noqa: PT012 - poll until reported
        while time.monotonic() < deadline:
            store.append({"op": "context", "trajectory_id": "t", "turn": 1, "token_ids": [1]})
            time.sleep(0.02)
    monkeypatch.undo()
    store.close()  # the error was reported once; a good fsync afterwards closes cleanly


def test_an_unknown_durability_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="durability"):
        JournalStore(tmp_path / "j.jsonl", durability="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize("frames", [True, False])
@pytest.mark.parametrize(
    ("token_ids", "logprobs"),
    [([7], [-1.0]), ((3, 31999, 0), (-0.25, -1e-05, -12.5)), ([5, 6], [0.0, -3.0000000000000004])],
)
def test_a_streams_frame_renders_the_bytes_of_its_events(
    frames: bool, token_ids: list[int], logprobs: list[float]
) -> None:
    """The direct frame rendering (no event objects) writes exactly what the events would."""
    from belayer_router._core._emit import Event
    from belayer_router._server._app import _render, _StreamEmit
    from belayer_router._server._asgi import StreamQueue
    from belayer_router._wire._protocol import TokenEvent, TokensEvent

    queue: StreamQueue[Event] = StreamQueue()
    written: list[bytes] = []

    def write(body: bytes) -> bool:
        written.append(body)
        return True

    queue.write = write
    emit = _StreamEmit(queue, frames)
    emit.frame(40, token_ids, logprobs)
    if frames:
        events: list[TokenEvent | TokensEvent] = [TokensEvent(40, tuple(token_ids), tuple(logprobs))]
    else:
        events = [TokenEvent(40 + i, t, v) for i, (t, v) in enumerate(zip(token_ids, logprobs, strict=True))]
    assert written == [_render(events)]  # type: ignore[arg-type]


def test_an_empty_pre_rendered_body_is_neither_written_nor_queued() -> None:
    """Nothing to send must not start the response (a later error could then not be a 503)."""
    from belayer_router._server._asgi import StreamQueue

    queue: StreamQueue[object] = StreamQueue()
    written: list[bytes] = []

    def write(body: bytes) -> bool:
        written.append(body)
        return True

    queue.write = write
    queue.put_rendered(b"")
    assert written == []
    assert queue.items == []
    queue.put_rendered(b"x\n")
    assert written == [b"x\n"]


@pytest.mark.parametrize("frames", [True, False])
def test_an_event_emit_gives_a_frame_as_the_request_asked_for_it(frames: bool) -> None:
    """A frame through `EventEmit` is one `TokensEvent` for a ``frames`` request, else one
    `TokenEvent` per token, at the frame's indices; plain events pass through unchanged."""
    from belayer_router._core._emit import Emit, Event, EventEmit
    from belayer_router._wire._protocol import FinishEvent, TokenEvent, TokensEvent

    events: list[Event] = []
    emit: Emit = EventEmit(events.append, frames)
    emit.frame(7, [11, 12, 13], [-0.5, -1.5, -2.5])
    finish = FinishEvent("r", "stop", 3, 10, 0)
    emit(finish)
    if frames:
        assert events == [TokensEvent(7, (11, 12, 13), (-0.5, -1.5, -2.5)), finish]
    else:
        assert events == [TokenEvent(7, 11, -0.5), TokenEvent(8, 12, -1.5), TokenEvent(9, 13, -2.5), finish]


def test_a_turns_addition_is_appended_to_the_context_its_finish_recorded_and_journaled_alone(
    tmp_path: Path,
) -> None:
    """One owner per turn's context (issue 32): the generation's finish records prompt + completion
    as ``L_turn``; the client then sends only what the turn added (an observation)."""
    path = tmp_path / "j.jsonl"
    journal = Journal(JournalStore(path))
    record = journal.begin("r", request(3, trajectory_id="t", turn=1), seed=5)
    for token in (7, 8, 9):
        journal.append(record, token, -0.5)
    journal.finish(record, "length")
    assert journal.append_context("t", 1, [40, 41]) == 2 + 3 + 2
    assert journal.get_context("t", 1) == (1, [1, 2, 7, 8, 9, 40, 41])
    with pytest.raises(NotFoundError, match="no context for turn 2 to append to"):
        journal.append_context("t", 2, [1])
    with pytest.raises(InvalidRequestError):
        journal.append_context("t", -1, [1])
    assert journal.store is not None
    journal.store.close()
    ops = [json.loads(line) for line in path.read_text().splitlines()]
    appended = [op for op in ops if op["op"] == "context_append"]
    assert appended == [{"op": "context_append", "trajectory_id": "t", "turn": 1, "token_ids": [40, 41]}]
    assert not [op for op in ops if op["op"] == "context"]  # the context itself was never sent
    reloaded = Journal(JournalStore(path))
    reloaded.load()
    assert reloaded.get_context("t", 1) == (1, [1, 2, 7, 8, 9, 40, 41])  # the same after a restart
