"""The engine half of belayer-shadow (private): model, layers, scheduler, KV blocks, sampler, loader.

nano-vllm's split: `_block_manager`, `_scheduler` and `_sequence` are plain-Python bookkeeping,
`_runner` turns a batch into tensors, `_model` / `_layers` compute, `_sampler` samples, and
`_llm_engine.LLMEngine.step()` composes them. Nothing here imports the worker half (`_workers`).
The public API is re-exported from `belayer_shadow`.
"""
