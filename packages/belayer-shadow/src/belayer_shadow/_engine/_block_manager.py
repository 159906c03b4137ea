"""Paged KV bookkeeping: which arena blocks hold which sequence's positions. No torch here."""

from __future__ import annotations

from collections import deque

import attrs

from belayer_shadow._errors import LLMEngineError

__all__ = ["BlockManager", "num_blocks_for"]


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions."""
    return -(-num_tokens // block_size)


@attrs.define
class BlockManager:
    """Owns the free list of a KV arena of `num_blocks` blocks and each sequence's block table.

    Position `p` of a sequence lives in block `table[p // block_size]` at offset
    `p % block_size`. A block belongs to at most one sequence at a time.
    """

    num_blocks: int
    block_size: int
    _free: deque[int] = attrs.field(init=False)
    _tables: dict[str, list[int]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise LLMEngineError("the KV pool needs num_blocks >= 1 and block_size >= 1")
        self._free = deque(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self._free)

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's blocks in position order (empty if it holds none)."""
        return self._tables.get(seq_id, [])

    def has_blocks(self, seq_id: str) -> bool:
        """True if the sequence holds blocks."""
        return seq_id in self._tables

    def can_allocate(self, num_tokens: int) -> bool:
        """True if a sequence of `num_tokens` positions would fit now."""
        return num_blocks_for(num_tokens, self.block_size) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Give a sequence that holds nothing enough blocks for `num_tokens` positions."""
        if seq_id in self._tables:
            raise LLMEngineError(f"sequence {seq_id!r} already holds blocks; free it first")
        needed = num_blocks_for(num_tokens, self.block_size)
        if needed > len(self._free):
            raise LLMEngineError(f"{needed} blocks needed for {seq_id!r}, {len(self._free)} free")
        self._tables[seq_id] = [self._free.popleft() for _ in range(needed)]
        return self._tables[seq_id]

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        """True if the sequence can hold `num_tokens` positions after `grow`."""
        missing = num_blocks_for(num_tokens, self.block_size) - len(self.block_table(seq_id))
        return missing <= len(self._free)

    def grow(self, seq_id: str, num_tokens: int) -> list[int]:
        """Extend the sequence's table (if needed) so that it holds `num_tokens` positions."""
        table = self._tables.get(seq_id)
        if table is None:
            raise LLMEngineError(f"sequence {seq_id!r} holds no blocks; allocate first")
        missing = num_blocks_for(num_tokens, self.block_size) - len(table)
        if missing > len(self._free):
            raise LLMEngineError(f"{missing} more blocks needed for {seq_id!r}, {len(self._free)} free")
        table.extend(self._free.popleft() for _ in range(missing))
        return table

    def free(self, seq_id: str) -> None:
        """Return the sequence's blocks to the pool (no-op if it holds none)."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self._free.extend(table)

    def reset(self) -> None:
        """Forget every table: all blocks are free (after a KV flush)."""
        self._tables.clear()
        self._free = deque(range(self.num_blocks))
