"""Turning a scheduler batch into tensors, running the model and sampling: the engine's torch side."""

from __future__ import annotations

import torch

from belayer_shadow._engine._layers import AttentionMetadata
from belayer_shadow._engine._model import Qwen3Model
from belayer_shadow._engine._sampler import keyed_uniform, sample
from belayer_shadow._engine._scheduler import SchedulerBatch

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs forward passes of `model` with its KV cache in `arena`.

    `arena` is (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), as belayer-gpumem's
    KV server lays it out; layer i's key cache is `arena[i, 0]`, its value cache `arena[i, 1]`.
    """

    def __init__(self, model: Qwen3Model, arena: torch.Tensor) -> None:
        self.model = model
        self.block_size = int(arena.shape[3])
        self.kv_caches = [(arena[i, 0], arena[i, 1]) for i in range(arena.shape[0])]
        self.device = model.device
        self.dtype = arena.dtype

    def run(self, batch: SchedulerBatch) -> tuple[list[int], list[float]]:
        """The next token and its logprob for every sequence of `batch`."""
        inputs = self._prepare_prefill(batch) if batch.is_prefill else self._prepare_decode(batch)
        logits = self.model.forward(*inputs)
        temperatures = [s.params.temperature for s in batch.seqs]
        top_ps = [s.params.top_p for s in batch.seqs]
        uniforms = [0.0 if s.params.greedy else keyed_uniform(s.seed, s.next_index) for s in batch.seqs]
        return sample(logits, temperatures, top_ps, uniforms)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _prepare_prefill(
        self, batch: SchedulerBatch
    ) -> tuple[
        torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], AttentionMetadata, torch.Tensor
    ]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        for seq, table in zip(batch.seqs, batch.block_tables, strict=True):
            n = len(seq)
            input_ids += seq.token_ids
            positions += range(n)
            slots += (table[p // bs] * bs + p % bs for p in range(n))
            last.append(len(input_ids) - 1)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(slots),
            seq_lens=tuple(len(s) for s in batch.seqs),
        )
        return self._tensor(input_ids), self._tensor(positions), self.kv_caches, meta, self._tensor(last)

    def _prepare_decode(
        self, batch: SchedulerBatch
    ) -> tuple[
        torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], AttentionMetadata, torch.Tensor
    ]:
        bs = self.block_size
        positions = [len(s) - 1 for s in batch.seqs]
        slots = [table[p // bs] * bs + p % bs for p, table in zip(positions, batch.block_tables, strict=True)]
        width = max(len(t) for t in batch.block_tables)
        # Padding points at block 0; the context-length mask keeps it out of the attention.
        tables = [list(t) + [0] * (width - len(t)) for t in batch.block_tables]
        block_tables = torch.tensor(tables, dtype=torch.int64, device=self.device)
        cached = torch.arange(width * bs, device=self.device).unsqueeze(0)
        beyond = cached > self._tensor(positions).unsqueeze(1)
        # An additive float mask: CPU SDPA is several times faster with it than with a bool mask.
        mask = torch.zeros(beyond.shape, dtype=self.dtype, device=self.device).masked_fill_(
            beyond, float("-inf")
        )
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._tensor(slots),
            block_tables=block_tables,
            decode_mask=mask[:, None, None, :],
        )
        input_ids = self._tensor([s.last_token_id for s in batch.seqs])
        return (
            input_ids,
            self._tensor(positions),
            self.kv_caches,
            meta,
            self._tensor(list(range(len(positions)))),
        )
