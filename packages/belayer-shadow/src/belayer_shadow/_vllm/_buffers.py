"""vLLM buffers a text-only worker never reads, freed at start.

vLLM 0.32's model runner allocates an `inputs_embeds` buffer of `max_num_batched_tokens x hidden`
values (16.8 MB for a 512-wide model at 8,192 tokens, 33.5 MB at 1,024 wide) for multimodal models
and prompt embeddings. A text model without prompt embeddings feeds token ids and never touches it
(`GPUModelRunner._preprocess` and `_dummy_run` read it only when `supports_mm_inputs` or
`enable_prompt_embeds`): every vLLM worker of a slot (main and shadow) held it for nothing.
`free_unused_buffers` swaps it for an empty buffer (a slice of it is then empty, never an
out-of-bounds read), so a wrong guess fails loudly with a shape error rather than silently.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["free_unused_buffers"]


def free_unused_buffers(worker: Any) -> int:
    """Free the buffers vLLM's model runner (in `worker`, vLLM's CPU worker) holds for inputs this
    text-only engine never gives it; returns the bytes freed (0 where the model needs them)."""
    runner = worker.model_runner
    if getattr(runner, "supports_mm_inputs", True) or getattr(runner, "enable_prompt_embeds", True):
        return 0
    buffer: Any = getattr(runner, "inputs_embeds", None)
    cpu = getattr(buffer, "cpu", None)
    if not isinstance(cpu, torch.Tensor) or not cpu.numel():
        return 0
    freed = cpu.untyped_storage().nbytes()
    empty = cpu.new_empty((0, *cpu.shape[1:]))
    buffer.cpu = empty
    buffer.gpu = empty  # the CPU runner's device side is the same tensor
    return int(freed)
