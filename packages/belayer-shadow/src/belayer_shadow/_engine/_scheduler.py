"""Continuous batching: which sequences run in the next forward pass (plain Python, no torch).

Each step is either a prefill (newly admitted or preempted sequences, whole context at once) or
a decode (one token for every running sequence). When the KV pool runs out during decode, the
most recently admitted sequence is preempted: its blocks are freed and it goes back to the
front of the queue, to be recomputed by a prefill later (its tokens are kept, so its output
does not change).
"""

from __future__ import annotations

from collections import deque

import attrs

from belayer_shadow._engine._block_manager import BlockManager
from belayer_shadow._engine._sequence import Sequence, SequenceStatus, StepOutput

__all__ = ["Scheduler", "SchedulerBatch"]


@attrs.frozen
class SchedulerBatch:
    """The sequences of one forward pass.

    Prefill: every position `[0, len(seq))` of each sequence is computed. Decode: the last
    token of each sequence, at position `len(seq) - 1`.
    """

    is_prefill: bool
    seqs: tuple[Sequence, ...]
    block_tables: tuple[tuple[int, ...], ...]


@attrs.define
class Scheduler:
    """Waiting queue, running list and the block manager they share."""

    block_manager: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    waiting: deque[Sequence] = attrs.field(factory=deque)
    running: deque[Sequence] = attrs.field(factory=deque)
    num_preemptions: int = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> bool:
        """Drop a sequence wherever it is; False if it is not here."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, None)
                    return True
        return False

    def schedule(self) -> SchedulerBatch | None:
        """The next batch, or None when nothing can run."""
        batch = self._schedule_prefill()
        if batch:
            return self._batch(True, batch)
        batch = self._schedule_decode()
        return self._batch(False, batch) if batch else None

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if scheduled and num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(len(seq)):
                break
            self.block_manager.allocate(seq.request_id, len(seq))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_cached_tokens = 0
            self.running.append(seq)
            scheduled.append(seq)
            num_tokens += len(seq)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_grow(seq.request_id, len(seq)):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.grow(seq.request_id, len(seq))
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.block_manager.free(seq.request_id)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        self.waiting.appendleft(seq)

    def _batch(self, is_prefill: bool, seqs: list[Sequence]) -> SchedulerBatch:
        tables = tuple(tuple(self.block_manager.block_table(s.request_id)) for s in seqs)
        return SchedulerBatch(is_prefill=is_prefill, seqs=tuple(seqs), block_tables=tables)

    def postprocess(
        self, batch: SchedulerBatch, token_ids: list[int], logprobs: list[float]
    ) -> list[StepOutput]:
        """Record each sequence's sampled token, finish those that are done, and report."""
        outputs: list[StepOutput] = []
        for seq, token_id, logprob in zip(batch.seqs, token_ids, logprobs, strict=True):
            seq.num_cached_tokens = len(seq)
            index = seq.next_index
            seq.append(token_id)
            reason: str | None = None
            if token_id in seq.params.stop_token_ids:
                reason = "stop"
            elif seq.num_new_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
            outputs.append(StepOutput(seq.request_id, index, token_id, logprob, reason))
        return outputs

    def _finish(self, seq: Sequence, reason: str | None) -> None:
        self.block_manager.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def reset_kv(self) -> None:
        """Every cached block is gone (a flush): every running sequence will be prefilled again."""
        self.block_manager.reset()
        for seq in reversed(self.running):
            seq.status = SequenceStatus.WAITING
            seq.num_cached_tokens = 0
            self.waiting.appendleft(seq)
        self.running.clear()
