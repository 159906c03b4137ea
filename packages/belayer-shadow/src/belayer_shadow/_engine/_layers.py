"""The decoder's building blocks as functions of tensors it does not own (weights are views)."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

__all__ = ["AttentionMetadata", "RotaryEmbedding", "paged_attention", "rms_norm", "swiglu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 (as transformers' Qwen3RMSNorm)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP: down(silu(gate(x)) * up(x)), with gate and up stacked in `gate_up`."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


class RotaryEmbedding:
    """Rotary position embeddings (rotate-half form) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        # rotate_half(x) * sin == roll(x, half) * signed_sin, with the first half's sign flipped.
        sin = emb.sin()
        self.signed_sin = torch.cat((-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]), dim=-1).to(dtype)
        self.half = head_dim // 2

    def to(self, device: torch.device) -> RotaryEmbedding:
        """Move the tables to `device`."""
        self.cos = self.cos.to(device)
        self.signed_sin = self.signed_sin.to(device)
        return self

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed_sin) rows of `positions`, shaped to broadcast over heads; once per forward."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotate `x` (tokens, heads, head_dim) by its tokens' positions."""
        cos, signed_sin = tables
        return torch.addcmul(x * cos, torch.roll(x, self.half, dims=-1), signed_sin)


@attrs.frozen
class AttentionMetadata:
    """Where a forward pass's tokens go in the paged KV cache and what they attend to.

    `slot_mapping[t]` is token t's flat cache slot (block * block_size + offset). A prefill
    computes whole sequences of `seq_lens` tokens, laid out back to back. A decode computes one
    token per sequence over the cached positions named by padded `block_tables` (B, max_blocks);
    `decode_mask` (B, 1, 1, max_blocks * block_size) is 0 at each sequence's real positions, -inf after.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    seq_lens: tuple[int, ...] = ()
    block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Store this pass's keys/values in the cache, then attend. q (T, H, D), k/v (T, KV, D) -> (T, H*D).

    The cache is (num_blocks, block_size, KV, D) per layer; a query head h reads KV head
    h // (H // KV), as transformers' repeat_kv does.
    """
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    if meta.is_prefill:
        return _prefill_attention(q, k, v, meta.seq_lens)
    assert meta.block_tables is not None
    assert meta.decode_mask is not None
    return _decode_attention(q, k_cache, v_cache, meta.block_tables, meta.decode_mask)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: tuple[int, ...]
) -> torch.Tensor:
    # A prefill starts from an empty cache, so each sequence attends causally to its own new K/V.
    groups = q.shape[1] // k.shape[1]
    outputs = []
    start = 0
    for n in seq_lens:
        qs = q[start : start + n].transpose(0, 1)
        ks = k[start : start + n].transpose(0, 1).repeat_interleave(groups, dim=0)
        vs = v[start : start + n].transpose(0, 1).repeat_interleave(groups, dim=0)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        outputs.append(out.transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    # Gather each sequence's blocks, (B * max_blocks) whole blocks -> (B, KV, L, D). index_select
    # copies whole blocks; advanced indexing (k_cache[block_tables]) is several times slower on CPU.
    flat_tables = block_tables.flatten()
    keys = k_cache.index_select(0, flat_tables).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache.index_select(0, flat_tables).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # The query heads sharing a KV head become that head's query rows: no K/V replication.
    queries = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
    return out.reshape(num_seqs, num_heads * head_dim)
