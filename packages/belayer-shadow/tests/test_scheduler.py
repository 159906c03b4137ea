"""Scheduling decisions, in plain Python: admission, batching limits, preemption order, finishing."""

from __future__ import annotations

from typing import Any

from belayer_shadow import SamplingParams
from belayer_shadow._engine._block_manager import BlockManager
from belayer_shadow._engine._scheduler import Scheduler
from belayer_shadow._engine._sequence import Sequence, SequenceStatus


def seq(request_id: str, length: int, max_tokens: int = 100, stop: tuple[int, ...] = ()) -> Sequence:
    return Sequence(
        request_id=request_id,
        token_ids=list(range(length)),
        num_prompt_tokens=length,
        params=SamplingParams(max_tokens=max_tokens, temperature=0, stop_token_ids=stop),
        seed=0,
        arrival=0,
    )


def scheduler(num_blocks: int = 16, block_size: int = 4, **kwargs: Any) -> Scheduler:
    limits: dict[str, Any] = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1000} | kwargs
    return Scheduler(BlockManager(num_blocks, block_size), **limits)


def test_prefill_first_then_decode_of_everyone() -> None:
    s = scheduler()
    s.add(seq("a", 5))
    s.add(seq("b", 3))
    batch = s.schedule()
    assert batch is not None
    assert batch.is_prefill
    assert [q.request_id for q in batch.seqs] == ["a", "b"]
    assert [len(t) for t in batch.block_tables] == [2, 1]
    s.postprocess(batch, [7, 7], [0.0, 0.0])
    batch = s.schedule()
    assert batch is not None
    assert not batch.is_prefill
    assert [q.request_id for q in batch.seqs] == ["a", "b"]
    # b grew to 4 tokens: still one block; a to 6: two blocks.
    assert [len(t) for t in batch.block_tables] == [2, 1]


def test_batched_token_and_sequence_limits() -> None:
    s = scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    for name in "abc":
        s.add(seq(name, 6))
    first = s.schedule()
    assert first is not None
    assert [q.request_id for q in first.seqs] == ["a"]
    second = s.schedule()
    assert second is not None
    assert [q.request_id for q in second.seqs] == ["b"]
    third = s.schedule()  # two running: c must wait; the step is a decode
    assert third is not None
    assert not third.is_prefill
    assert [q.request_id for q in s.waiting] == ["c"]


def test_a_sequence_longer_than_the_token_budget_still_runs_alone() -> None:
    s = scheduler(max_num_batched_tokens=4)
    s.add(seq("long", 9))
    batch = s.schedule()
    assert batch is not None
    assert [q.request_id for q in batch.seqs] == ["long"]


def test_preemption_takes_the_newest_running_sequence() -> None:
    s = scheduler(num_blocks=3, block_size=2)
    s.add(seq("old", 2))
    s.add(seq("new", 2))
    batch = s.schedule()
    assert batch is not None
    s.postprocess(batch, [1, 1], [0.0, 0.0])  # both now 3 tokens: need 2 blocks each, 3 exist
    batch = s.schedule()
    assert batch is not None
    assert [q.request_id for q in batch.seqs] == ["old"]
    assert s.num_preemptions == 1
    assert [q.request_id for q in s.waiting] == ["new"]
    assert s.waiting[0].status is SequenceStatus.WAITING
    assert s.block_manager.num_free_blocks == 1
    assert len(s.waiting[0]) == 3  # its tokens are kept for the recompute


def test_a_lone_sequence_that_cannot_grow_preempts_itself() -> None:
    s = scheduler(num_blocks=1, block_size=2)
    s.add(seq("x", 2))
    batch = s.schedule()
    assert batch is not None
    s.postprocess(batch, [1], [0.0])
    assert s.schedule() is None
    assert s.num_preemptions == 1
    assert s.block_manager.num_free_blocks == 1


def test_finish_on_stop_length_and_model_len_frees_blocks() -> None:
    s = scheduler(max_model_len=5)
    s.add(seq("stop", 2, stop=(9,)))
    s.add(seq("length", 2, max_tokens=1))
    s.add(seq("model-len", 4))
    batch = s.schedule()
    assert batch is not None
    outs = s.postprocess(batch, [9, 3, 3], [-1.0, -2.0, -3.0])
    assert [(o.request_id, o.index, o.finish_reason) for o in outs] == [
        ("stop", 0, "stop"),
        ("length", 0, "length"),
        ("model-len", 0, "length"),
    ]
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 16


def test_reset_kv_requeues_running_sequences_in_order_before_waiting_ones() -> None:
    s = scheduler(max_num_seqs=2)
    for name in "abc":
        s.add(seq(name, 3))
    assert s.schedule() is not None
    s.reset_kv()
    assert [q.request_id for q in s.waiting] == ["a", "b", "c"]
    assert not s.running
    assert s.block_manager.num_free_blocks == 16


def test_abort_anywhere() -> None:
    s = scheduler(max_num_seqs=1)
    s.add(seq("run", 3))
    s.add(seq("wait", 3))
    s.schedule()
    assert s.abort("wait")
    assert s.abort("run")
    assert not s.abort("run")
    assert not s.has_unfinished()
    assert s.block_manager.num_free_blocks == 16
