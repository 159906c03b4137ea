"""The sampled token's logprob only: a cheaper gather for vLLM's sampler.

The worker protocol streams one logprob per token (the sampled one's; no top-k). vLLM's sampler
computes the raw logprobs (a log_softmax over the vocabulary; on the CPU the cheapest way to the
normaliser: `torch.logsumexp` takes about 2x its time, `benchmarks/bench_vllm_logprobs.py`)
and then gathers with `Sampler.gather_logprobs`, which for zero top logprobs still runs a top-k,
two concatenations and its rank count. `install` replaces that gather, on one sampler, by one that
takes only the sampled token's logprob and its rank (vLLM's own compiled count); any request for
top logprobs (`num_logprobs > 0`) still goes through vLLM's gather. Same values, same ranks.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["install", "sampled_logprobs"]


def sampled_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> Any:
    """vLLM's `LogprobsTensors` for `token_ids` (one per row of `logprobs`) with no top-k: the
    token, its logprob and its rank (1 = most likely), each one column."""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than
    from vllm.v1.sample.sampler import Sampler

    if num_logprobs != 0:
        return Sampler.gather_logprobs(logprobs, num_logprobs, token_ids)
    chosen_ids = token_ids.unsqueeze(-1)
    chosen = logprobs.gather(-1, chosen_ids)
    # As vLLM's gather: a batch of any size reuses the one compiled count (no re-compile at 1 row).
    torch._dynamo.decorators.mark_unbacked(logprobs, 0)
    torch._dynamo.decorators.mark_unbacked(chosen, 0)
    ranks = batched_count_greater_than(logprobs, chosen)
    return LogprobsTensors(chosen_ids.to(torch.int32), chosen, ranks)


def install(worker: Any) -> bool:
    """Make `worker`'s sampler gather with `sampled_logprobs` (an instance attribute over vLLM's
    static method); True once installed."""
    sampler = worker.model_runner.sampler
    sampler.gather_logprobs = sampled_logprobs
    return bool(sampler.gather_logprobs is sampled_logprobs)
