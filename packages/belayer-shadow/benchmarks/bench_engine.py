"""Engine throughput against transformers `generate` on the same model, in the same run.

32 concurrent requests (byte-tokenised prompts of 12..76 tokens), greedy, a fixed number of new
tokens each, on the default small model. Rows: belayer-shadow's engine on a private KV arena,
the same engine attached to real belayer-gpumem host memory servers (weights and KV in other
processes, zero copy), and transformers' batched `generate` (left padding, KV cache).

    python benchmarks/bench_engine.py [--requests 32] [--max-tokens 128] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
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


def prompts(num: int) -> list[list[int]]:
    tokenizer = load_tokenizer()
    text = "The quick brown fox jumps over the lazy dog while the rollout engine keeps streaming tokens. "
    return [tokenizer.encode(text[: 12 + (i * 7) % 65]) for i in range(num)]


def run_engine(engine: LLMEngine, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, prompt in enumerate(batch):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        engine.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(batch))}
    while engine.has_unfinished():
        for step in engine.step():
            out[step.request_id].append(step.token_id)
    return [out[f"r{i}"] for i in range(len(batch))]


def run_hf(model: Qwen3ForCausalLM, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
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
    return generated[:, width:].tolist()


def measure(fn: Callable[[], list[list[int]]], repeats: int) -> tuple[float, list[list[int]]]:
    fn()  # warm-up
    times = []
    result: list[list[int]] = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, the same for every system")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = ModelConfig.default()
    weights = init_weights(config, seed=0)
    batch = prompts(args.requests)
    longest = max(len(p) for p in batch) + args.max_tokens
    num_blocks = args.requests * -(-longest // BLOCK_SIZE)
    new_tokens = args.requests * args.max_tokens
    rows: list[dict[str, object]] = []

    def engine_factory(params: dict[str, torch.Tensor], arena: torch.Tensor) -> Callable[[], list[list[int]]]:
        engine = LLMEngine(config, params, arena, max_num_seqs=args.requests)
        return lambda: run_engine(engine, batch, args.max_tokens)

    local_s, local_out = measure(
        engine_factory(weights, allocate_kv_arena(config, num_blocks, BLOCK_SIZE)), args.repeats
    )
    rows.append({"system": "belayer-shadow engine (private arena)", "seconds": local_s})

    with tempfile.TemporaryDirectory(prefix="bench-engine-") as tmp:
        layout_file = Path(tmp) / "layout.json"
        layout_file.write_text(json.dumps(weight_layout(config).to_json()))
        with (
            ServerProcess.start(
                ServerConfig(kind="weights", socket=Path(tmp) / "w.sock", layout_file=layout_file)
            ),
            ServerProcess.start(
                ServerConfig(
                    kind="kv",
                    socket=Path(tmp) / "kv.sock",
                    kv_layout=kv_layout(config, num_blocks, BLOCK_SIZE),
                )
            ),
        ):
            fill_weight_server(Path(tmp) / "w.sock", weights)
            attached = LLMEngine.attach(
                config, Path(tmp) / "w.sock", Path(tmp) / "kv.sock", max_num_seqs=args.requests
            )
            try:
                served_s, served_out = measure(
                    lambda: run_engine(attached, batch, args.max_tokens), args.repeats
                )
            finally:
                attached.close()
    rows.append({"system": "belayer-shadow engine on gpumem servers", "seconds": served_s})

    model = Qwen3ForCausalLM(config.to_hf()).eval()
    model.load_state_dict(weights | {"lm_head.weight": weights["model.embed_tokens.weight"]})
    hf_s, hf_out = measure(lambda: run_hf(model, batch, args.max_tokens), args.repeats)
    rows.append({"system": "transformers generate (batched, left-padded)", "seconds": hf_s})

    for row in rows:
        row["tokens_per_s"] = new_tokens / float(row["seconds"])  # type: ignore[arg-type]
        row["speedup_vs_transformers"] = hf_s / float(row["seconds"])  # type: ignore[arg-type]
    same = sum(a == b for a, b in zip(local_out, hf_out, strict=True))
    report = {
        "model": config.to_dict(),
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "greedy_outputs_equal_to_transformers": f"{same}/{len(batch)}",
        "engine_outputs_equal_on_servers": local_out == served_out,
        "rows": rows,
    }
    lines = [
        f"{args.requests} concurrent requests x {args.max_tokens} new tokens, greedy, default model, "
        f"{torch.get_num_threads()} torch threads (median of {args.repeats})",
        "",
        "| system | seconds | tokens/s | speed-up vs transformers |",
        "|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['system']} | {float(row['seconds']):.2f} | {float(row['tokens_per_s']):,.0f} "  # type: ignore[arg-type]
            f"| {float(row['speedup_vs_transformers']):.1f}x |"  # type: ignore[arg-type]
        )
    lines += ["", f"greedy outputs equal to transformers: {same}/{len(batch)} requests"]
    print("\n".join(lines))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report | {"table": lines}, indent=2) + "\n")


if __name__ == "__main__":
    main()
