"""Engine throughput against transformers `generate` on the same model, in the same run.

32 concurrent requests (byte-tokenised prompts of 12..76 tokens), greedy, on the default small
model, in two workloads: every request wants the same number of new tokens ("uniform"), and
the lengths vary as in RL rollouts ("mixed", 16..256). Systems: belayer-shadow's engine on a
private KV arena; the same engine attached to real belayer-gpumem host memory servers (weights
and KV cache owned by other processes, zero copy); transformers' `generate` on one static,
left-padded batch of all 32 (it runs until the longest request is done); and transformers'
`generate` serving the requests one at a time. Throughput counts only the tokens requested.

    python benchmarks/bench_engine.py [--requests 32] [--max-tokens 128] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from belayer_gpumem import ServerConfig, ServerProcess
from belayer_shadow import (
    LLMEngine,
    ModelConfig,
    SamplingParams,
    allocate_kv_arena,
    fill_weight_server,
    init_weights,
    kv_layout,
    load_tokenizer,
    weight_layout,
)

RESULTS = Path(__file__).parent / "results" / "bench_engine.json"
BLOCK_SIZE = 16
Outputs = list[list[int]]


def prompts(num: int) -> list[list[int]]:
    tokenizer = load_tokenizer()
    text = "The quick brown fox jumps over the lazy dog while the rollout engine keeps streaming tokens. "
    return [tokenizer.encode(text[: 12 + (i * 7) % 65]) for i in range(num)]


def run_engine(engine: LLMEngine, batch: list[list[int]], lengths: list[int]) -> Outputs:
    for i, (prompt, n) in enumerate(zip(batch, lengths, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id].append(step.token_id)
    return [out[f"r{i}"] for i in range(len(batch))]


def hf_generate(model: Qwen3ForCausalLM, batch: list[list[int]], max_tokens: int) -> Outputs:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        generated = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    rows: Outputs = generated[:, width:].tolist()
    return rows


def run_hf_batched(model: Qwen3ForCausalLM, batch: list[list[int]], lengths: list[int]) -> Outputs:
    # One static batch: every row runs until the longest request is done; keep what each asked.
    rows = hf_generate(model, batch, max(lengths))
    return [row[:n] for row, n in zip(rows, lengths, strict=True)]


def run_hf_one_by_one(model: Qwen3ForCausalLM, batch: list[list[int]], lengths: list[int]) -> Outputs:
    return [hf_generate(model, [p], n)[0] for p, n in zip(batch, lengths, strict=True)]


def measure(fn: Callable[[], Outputs], repeats: int) -> tuple[float, Outputs]:
    fn()  # warm-up
    times = []
    result: Outputs = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


@contextmanager
def memory_servers(
    config: ModelConfig, num_blocks: int, weights: dict[str, torch.Tensor]
) -> Iterator[tuple[Path, Path]]:
    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        run = Path(tmp)
        (run / "layout.json").write_text(json.dumps(weight_layout(config).to_json()))
        kv = kv_layout(config, num_blocks, BLOCK_SIZE)
        with (
            ServerProcess.start(
                ServerConfig(kind="weights", socket=run / "w.sock", layout_file=run / "layout.json")
            ),
            ServerProcess.start(ServerConfig(kind="kv", socket=run / "kv.sock", kv_layout=kv)),
        ):
            fill_weight_server(run / "w.sock", weights)
            yield run / "w.sock", run / "kv.sock"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (uniform)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every system")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = ModelConfig.default()
    weights = init_weights(config, seed=0)
    batch = prompts(args.requests)
    workloads = {
        "uniform": [args.max_tokens] * args.requests,
        "mixed": [16 + (i * 61) % 241 for i in range(args.requests)],
    }
    longest = max(len(p) for p in batch) + max(max(v) for v in workloads.values())
    num_blocks = args.requests * -(-longest // BLOCK_SIZE)
    model = Qwen3ForCausalLM(config.to_hf())
    model.eval()  # type: ignore[no-untyped-call]
    model.load_state_dict(weights | {"lm_head.weight": weights["model.embed_tokens.weight"]})
    local = LLMEngine(
        config, weights, allocate_kv_arena(config, num_blocks, BLOCK_SIZE), max_num_seqs=args.requests
    )

    rows: list[dict[str, object]] = []
    checks: dict[str, object] = {}
    with memory_servers(config, num_blocks, weights) as (weights_socket, kv_socket):
        served = LLMEngine.attach(config, weights_socket, kv_socket, max_num_seqs=args.requests)
        try:
            for name, lengths in workloads.items():
                systems: dict[str, tuple[Callable[[], Outputs], int]] = {
                    "belayer-shadow engine (private arena)": (
                        partial(run_engine, local, batch, lengths),
                        args.repeats,
                    ),
                    "belayer-shadow engine on gpumem servers": (
                        partial(run_engine, served, batch, lengths),
                        args.repeats,
                    ),
                    "transformers generate, one static batch": (
                        partial(run_hf_batched, model, batch, lengths),
                        args.repeats,
                    ),
                    "transformers generate, one request at a time": (
                        partial(run_hf_one_by_one, model, batch, lengths),
                        1,
                    ),
                }
                outputs: dict[str, Outputs] = {}
                timings: dict[str, float] = {}
                for system, (fn, repeats) in systems.items():
                    timings[system], outputs[system] = measure(fn, repeats)
                    print(f"{name:8s} {system:48s} {timings[system]:7.2f} s", flush=True)
                hf_batch = timings["transformers generate, one static batch"]
                hf_single = timings["transformers generate, one request at a time"]
                for system, seconds in timings.items():
                    rows.append(
                        {
                            "workload": name,
                            "system": system,
                            "seconds": seconds,
                            "tokens_per_s": sum(lengths) / seconds,
                            "vs_static_batch": hf_batch / seconds,
                            "vs_one_at_a_time": hf_single / seconds,
                        }
                    )
                engine_out = outputs["belayer-shadow engine (private arena)"]
                checks[name] = {
                    "engine_equals_engine_on_servers": engine_out
                    == outputs["belayer-shadow engine on gpumem servers"],
                    "engine_equals_transformers_one_at_a_time": sum(
                        a == b
                        for a, b in zip(
                            engine_out, outputs["transformers generate, one request at a time"], strict=True
                        )
                    ),
                    "requests": len(batch),
                    "new_tokens": sum(lengths),
                }
        finally:
            served.close()

    lines = [
        f"{args.requests} concurrent requests, greedy, default model, {torch.get_num_threads()} torch thread(s), "
        f"median of {args.repeats} (one run for one-at-a-time). uniform: {args.max_tokens} new tokens each; "
        "mixed: 16..256 new tokens.",
        "",
        "| workload | system | seconds | tokens/s | speed-up vs static batch | speed-up vs one at a time |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['workload']} | {row['system']} | {row['seconds']:.2f} | {row['tokens_per_s']:,.0f} "
            f"| {row['vs_static_batch']:.1f}x | {row['vs_one_at_a_time']:.1f}x |"
        )
    lines.append("")
    for name, check in checks.items():
        assert isinstance(check, dict)
        lines.append(
            f"{name}: engine outputs equal on servers: {check['engine_equals_engine_on_servers']}; "
            f"equal to transformers (greedy): {check['engine_equals_transformers_one_at_a_time']}/{check['requests']}"
        )
    print("\n".join(lines))
    report = {
        "model": config.to_dict(),
        "requests": args.requests,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "rows": rows,
        "checks": checks,
        "table": lines,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
