"""The block manager's bookkeeping under random operation sequences (hypothesis state machine)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from belayer_shadow import LLMEngineError
from belayer_shadow._engine._block_manager import BlockManager, num_blocks_for

NUM_BLOCKS, BLOCK_SIZE = 12, 4
SEQ_IDS = st.sampled_from([f"s{i}" for i in range(6)])


class BlockManagerMachine(RuleBasedStateMachine):
    """Model: each sequence's length; the manager must always agree with it."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.lengths: dict[str, int] = {}

    @rule(seq=SEQ_IDS, num_tokens=st.integers(1, 40))
    def allocate(self, seq: str, num_tokens: int) -> None:
        fits = num_blocks_for(num_tokens, BLOCK_SIZE) <= self.manager.num_free_blocks
        assert self.manager.can_allocate(num_tokens) == fits
        if seq in self.lengths or not fits:
            with pytest.raises(LLMEngineError):
                self.manager.allocate(seq, num_tokens)
            return
        table = self.manager.allocate(seq, num_tokens)
        assert len(table) == num_blocks_for(num_tokens, BLOCK_SIZE)
        self.lengths[seq] = num_tokens

    @precondition(lambda self: bool(self.lengths))
    @rule(data=st.data(), extra=st.integers(0, 9))
    def grow(self, data: st.DataObject, extra: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.lengths)))
        target = self.lengths[seq] + extra
        before = list(self.manager.block_table(seq))
        missing = num_blocks_for(target, BLOCK_SIZE) - len(before)
        fits = missing <= self.manager.num_free_blocks
        assert self.manager.can_grow(seq, target) == fits
        if not fits:
            with pytest.raises(LLMEngineError):
                self.manager.grow(seq, target)
            assert self.manager.block_table(seq) == before
            return
        table = self.manager.grow(seq, target)
        assert table[: len(before)] == before  # existing positions never move
        self.lengths[seq] = target

    @rule(seq=SEQ_IDS)
    def free(self, seq: str) -> None:
        self.manager.free(seq)
        self.lengths.pop(seq, None)
        assert not self.manager.has_blocks(seq)

    @rule()
    def reset(self) -> None:
        self.manager.reset()
        self.lengths.clear()

    @invariant()
    def blocks_are_owned_once_and_accounted_for(self) -> None:
        owned = [b for seq in self.lengths for b in self.manager.block_table(seq)]
        assert len(owned) == len(set(owned))
        assert all(0 <= b < NUM_BLOCKS for b in owned)
        assert len(owned) + self.manager.num_free_blocks == NUM_BLOCKS
        for seq, length in self.lengths.items():
            assert len(self.manager.block_table(seq)) >= num_blocks_for(length, BLOCK_SIZE)


TestBlockManager = BlockManagerMachine.TestCase


def test_grow_without_allocate_and_bad_pool_are_errors() -> None:
    manager = BlockManager(4, 2)
    with pytest.raises(LLMEngineError, match="allocate first"):
        manager.grow("x", 3)
    with pytest.raises(LLMEngineError, match="num_blocks"):
        BlockManager(0, 16)
