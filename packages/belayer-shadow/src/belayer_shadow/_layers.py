"""The decoder's building blocks as functions of tensors it does not own (weights are views)."""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

__all__ = ["AttentionMetadata", "RotaryEmbedding", "paged_attention", "rms_norm", "swiglu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 (as transformers' Qwen3RMSNorm)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP: down(silu(gate(x)) * up(x))."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class RotaryEmbedding:
    """Rotary position embeddings (rotate-half form) with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.half = head_dim // 2

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` (tokens, heads, head_dim) by each token's position."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        rotated = torch.cat((-x[..., self.half :], x[..., : self.half]), dim=-1)
        return x * cos + rotated * sin


@attrs.frozen
class AttentionMetadata:
    """Where a forward pass's tokens go in the paged KV cache and what they attend to.

    `slot_mapping[t]` is token t's flat cache slot (block * block_size + offset). A prefill
    computes whole sequences of `seq_lens` tokens, laid out back to back. A decode computes one
    token per sequence over `context_lens` cached positions named by padded `block_tables`.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    seq_lens: tuple[int, ...] = ()
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


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
    assert meta.context_lens is not None
    return _decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens)


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
    context_lens: torch.Tensor,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    groups = num_heads // num_kv_heads
    # Gather each sequence's blocks: (B, max_blocks, block_size, KV, D) -> (B, KV, L, D).
    keys = k_cache[block_tables].flatten(1, 2).permute(0, 2, 1, 3)
    values = v_cache[block_tables].flatten(1, 2).permute(0, 2, 1, 3)
    # The query heads sharing a KV head become that head's query rows: no K/V replication.
    queries = q.view(num_seqs, num_kv_heads, groups, head_dim)
    length = keys.shape[2]
    mask = torch.arange(length, device=context_lens.device).unsqueeze(0) < context_lens.unsqueeze(1)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None, None, :])
    return out.reshape(num_seqs, num_heads * head_dim)
