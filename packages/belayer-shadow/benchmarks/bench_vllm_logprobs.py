"""What a decode step's logprobs cost in vLLM's sampler, and the sampled-only gather against it.

    python benchmarks/bench_vllm_logprobs.py [--rows 32] [--repeats 7]   # needs belayer-shadow[vllm]

Per step, for `rows` sequences (one sampled token each), one CPU thread, at the default model's
vocabulary (512) and at Qwen3's (151,936): vLLM's raw logprobs (`Sampler.compute_logprobs`: a
log_softmax over the vocabulary), the alternative normaliser `torch.logsumexp`, vLLM's gather for
zero top logprobs (`Sampler.gather_logprobs`: top-k, rank count, concatenations) and
belayer-shadow's sampled-only gather (`_vllm._logprobs.sampled_logprobs`: the token's logprob and
rank). CPU microseconds per call (process time, median of `repeats` batches, systems interleaved),
with the outputs compared. Saves JSON to benchmarks/results/bench_vllm_logprobs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results" / "bench_vllm_logprobs.json"
VOCABS = (512, 151_936)


def measure(calls: dict[str, Callable[[], Any]], per_batch: int, repeats: int) -> dict[str, float]:
    for call in calls.values():  # warm-up (the rank count is compiled at its first call)
        for _ in range(5):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.process_time()
            for _ in range(per_batch):
                call()
            samples[name].append((time.process_time() - start) / per_batch * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm.v1.sample.sampler import Sampler

    from belayer_shadow._vllm._logprobs import sampled_logprobs

    results: dict[str, Any] = {"config": {**vars(args), "threads": 1, "load_1min": os.getloadavg()[0]}}
    generator = torch.Generator().manual_seed(0)
    for vocab in VOCABS:
        logits = torch.randn(args.rows, vocab, generator=generator)
        tokens = torch.randint(vocab, (args.rows,), generator=generator)
        logprobs = Sampler.compute_logprobs(logits)
        ours, theirs = sampled_logprobs(logprobs, 0, tokens), Sampler.gather_logprobs(logprobs, 0, tokens)
        per_call_us = measure(
            {
                "log_softmax (vLLM's raw logprobs)": partial(Sampler.compute_logprobs, logits),
                "logsumexp (normaliser alone)": partial(torch.logsumexp, logits, dim=-1),
                "vLLM gather_logprobs (0 top)": partial(Sampler.gather_logprobs, logprobs, 0, tokens),
                "sampled-only gather (belayer-shadow)": partial(sampled_logprobs, logprobs, 0, tokens),
            },
            per_batch=200 if vocab < 10_000 else 10,
            repeats=args.repeats,
        )
        results[str(vocab)] = {
            "cpu_us_per_step": per_call_us,
            "same_logprobs_and_ranks": bool(
                torch.equal(ours.logprobs, theirs.logprobs)
                and torch.equal(ours.selected_token_ranks, theirs.selected_token_ranks)
            ),
        }
        print(json.dumps({vocab: results[str(vocab)]}), flush=True)
    results["config"]["load_1min_after"] = os.getloadavg()[0]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
