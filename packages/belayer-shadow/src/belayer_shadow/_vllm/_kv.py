"""vLLM's KV cache in the KV server's arena: every KV tensor of vLLM re-pointed at the arena's bytes.

vLLM 0.32 allocates its whole KV cache as one int8 buffer (`vllm.v1.worker.utils.allocate_kv_cache`)
and every layer's cache (and the kernel-block views the attention layers get) is a view of it.
`bind_arena` moves each of those tensors, in place, onto the same offsets of the arena's storage
(`Tensor.set_`), so every holder (the model runner's list, each attention layer's `kv_cache`) then
reads and writes the arena, and vLLM's own buffer is freed (resized to 0 bytes).

It is done after vLLM started, not by patching vLLM: a shadow warms its engine up on vLLM's own
buffer while the main worker serves on the arena, and moves onto the arena when it stands by.
"""

from __future__ import annotations

from typing import Any

import torch

from belayer_shadow._engine._config import ModelConfig
from belayer_shadow._engine._model import torch_dtype
from belayer_shadow._errors import LLMEngineError

__all__ = ["VLLM_CPU_BLOCK_SIZE", "arena_bytes", "bind_arena", "max_tokens_in"]

# vLLM's CPU attention uses blocks of 128 positions (vllm/platforms/cpu.py) unless told otherwise.
VLLM_CPU_BLOCK_SIZE = 128


def arena_bytes(arena: torch.Tensor) -> torch.Tensor:
    """The arena as one flat uint8 tensor (the same storage)."""
    if not arena.is_contiguous():
        raise LLMEngineError("the KV server's arena is not contiguous; cannot lay vLLM's KV cache on it")
    return arena.reshape(-1).view(torch.uint8)


def max_tokens_in(config: ModelConfig, nbytes: int) -> int:
    """Positions of vLLM's KV cache (whole blocks of VLLM_CPU_BLOCK_SIZE, one kept spare) in `nbytes`."""
    itemsize = torch.empty((), dtype=torch_dtype(config.dtype)).element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
    blocks = nbytes // (per_token * VLLM_CPU_BLOCK_SIZE)
    return max(blocks - 1, 0) * VLLM_CPU_BLOCK_SIZE


def bind_arena(runner: Any, arena: torch.Tensor) -> int:
    """Re-point every tensor on vLLM's KV buffer (in `runner`, vLLM's model runner) at `arena`'s
    bytes, same offsets, and free vLLM's buffer; returns how many tensors moved. Raises
    LLMEngineError if the arena is too small.
    """
    caches = list(getattr(runner, "kv_caches", []))
    if not caches:
        raise LLMEngineError("vLLM's model runner has no KV cache to place in the arena")
    old = caches[0].untyped_storage()
    pointer, nbytes = old.data_ptr(), old.nbytes()
    flat = arena_bytes(arena)
    if flat.numel() < nbytes:
        raise LLMEngineError(
            f"vLLM's KV cache needs {nbytes} bytes, the KV server's arena has {flat.numel()}; "
            "start the slot with more KV blocks"
        )
    if pointer == flat.untyped_storage().data_ptr():
        return 0  # bound already
    storage, base = flat.untyped_storage(), flat.storage_offset()
    del caches
    # The holders of vLLM's KV cache: the model runner's list and each attention layer's
    # `kv_cache` (views of the buffer; a view's base keeps the buffer alive from C++, so it moves too).
    layers = getattr(getattr(runner, "compilation_config", None), "static_forward_context", {})
    holders = [getattr(layer, "kv_cache", None) for layer in layers.values()]
    holders += list(getattr(runner, "kv_caches", []))
    found: dict[int, torch.Tensor] = {}
    for tensor in holders:
        if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().data_ptr() != pointer:
            continue
        found[id(tensor)] = tensor
        if tensor._base is not None:
            found[id(tensor._base)] = tensor._base
    moved = 0
    with torch.no_grad():
        for tensor in found.values():
            size = tensor.element_size()
            if base % size:
                raise LLMEngineError("the KV server's arena is not aligned for vLLM's KV cache dtype")
            tensor.set_(storage, base // size + tensor.storage_offset(), tensor.size(), tensor.stride())
            moved += 1
    del found
    # Every cache vLLM computes with must now be in the arena (else its K/V would be split).
    target = storage.data_ptr()
    held = {f"layer {name}": getattr(layer, "kv_cache", None) for name, layer in layers.items()}
    held.update({f"runner.kv_caches[{i}]": t for i, t in enumerate(getattr(runner, "kv_caches", []))})
    stray = [
        f"{name} ({kv.untyped_storage().data_ptr():#x}, {type(kv).__name__}, moved {moved})"
        for name, kv in held.items()
        if isinstance(kv, torch.Tensor) and kv.numel() and kv.untyped_storage().data_ptr() != target
    ]
    if stray:
        raise LLMEngineError(f"vLLM's KV caches not in the arena after the move: {stray[:3]}")
    # Whatever still refers to vLLM's buffer from C++ (a view's base) gets an empty storage: its
    # memory is freed here, and vLLM's K/V live only in the arena from now on.
    old.resize_(0)
    del old
    return moved
