"""What vLLM's CPU build repacks, and what undoing it costs: bytes, repack ms, matmul ms per step.

    python benchmarks/bench_vllm_repack.py      # needs belayer-shadow[vllm]

After loading, vLLM's CPU path hands every linear weight to
`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`, which packs it for oneDNN (or
sgl-kernel / zentorch) and drops the original. belayer-shadow's loader undoes that: the layers
compute with `F.linear` on views of the weight server. For the three model sizes of
bench_throughput_vllm, with vLLM's fused shapes (qkv_proj, o_proj, gate_up_proj, down_proj per
layer, and the LM head), this measures in one process:
- the bytes vLLM would repack (a transient copy at load for belayer) and the time the repack takes;
- one decode step's matmuls (32 rows, one thread), vLLM's packed kernel against F.linear on the
  original weight (the throughput both give while serving).
Saves JSON to benchmarks/results/bench_vllm_repack.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from belayer_shadow import ModelConfig

RESULTS = Path(__file__).parent / "results" / "bench_vllm_repack.json"
SIZES = {
    "1M": {},  # the default model
    "28M": {"hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64},
    "164M": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 13, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64},
}  # fmt: skip


def linear_shapes(config: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, out, in) of every linear weight vLLM's Qwen3 has, fused as vLLM fuses them."""
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    shapes = []
    for layer in range(config.num_hidden_layers):
        shapes += [
            (f"layers.{layer}.qkv_proj", q + 2 * kv, h),
            (f"layers.{layer}.o_proj", h, q),
            (f"layers.{layer}.gate_up_proj", 2 * config.intermediate_size, h),
            (f"layers.{layer}.down_proj", h, config.intermediate_size),
        ]
    return [*shapes, ("lm_head", config.vocab_size, h)]


def timed(fn: Any, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(size: str, rows: int, repeats: int) -> dict[str, Any]:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    config = ModelConfig.from_dict({**ModelConfig.default().to_dict(), **SIZES[size]})
    generator = torch.Generator().manual_seed(0)
    repack_s = 0.0
    packed_s = linear_s = 0.0
    nbytes = 0
    for _name, out_features, in_features in linear_shapes(config):
        weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        nbytes += weight.numel() * weight.element_size()
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        start = time.perf_counter()
        dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        repack_s += time.perf_counter() - start
        x = torch.randn(rows, in_features, generator=generator)
        packed = module.cpu_linear
        with torch.no_grad():
            assert torch.allclose(packed(x, module.weight, None), F.linear(x, weight), atol=1e-3, rtol=1e-3)
            packed_s += timed(lambda packed=packed, x=x, m=module: packed(x, m.weight, None), repeats)
            linear_s += timed(lambda x=x, w=weight: F.linear(x, w), repeats)
    return {
        "size": size,
        "linear_weights": len(linear_shapes(config)),
        "repacked_bytes": nbytes,
        "repack_ms": repack_s * 1e3,
        "decode_step_matmul_ms_packed": packed_s * 1e3,
        "decode_step_matmul_ms_f_linear": linear_s * 1e3,
        "f_linear_over_packed": linear_s / packed_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rows", type=int, default=32, help="rows of one decode step (running requests)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(size, args.rows, args.repeats) for size in args.sizes]
    report = {
        "config": {"rows": args.rows, "repeats": args.repeats, "threads": 1, "dtype": "float32"},
        "results": results,
        "machine": "shared 2-core build machine, other engineers' jobs running (loaded)",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        print(
            f"{r['size']}: {r['linear_weights']} linear weights, {r['repacked_bytes'] / 2**20:.1f} MiB repacked "
            f"in {r['repack_ms']:.1f} ms; one decode step's matmuls ({args.rows} rows): packed "
            f"{r['decode_step_matmul_ms_packed']:.2f} ms, F.linear {r['decode_step_matmul_ms_f_linear']:.2f} ms "
            f"({r['f_linear_over_packed']:.2f}x)"
        )


if __name__ == "__main__":
    main()
