"""The built-in engine against vLLM, side by side, on the three model sizes of the vLLM benchmarks.

    python benchmarks/bench_engine_vs_vllm.py [--threads 2] [--rounds 3]   # needs belayer-shadow[vllm]

For each size (`bench_throughput_vllm.SIZES`: Qwen3 layout, seeded weights, float32), 32 greedy
requests x 128 new tokens, 16-token prompts, every system in its own process with the same number
of CPU threads (2 by default):
- `stock vLLM`: `vllm.LLM(...).generate` (vLLM's offline batch API);
- `built-in engine`: belayer-shadow's `LLMEngine` stepped directly on a private KV arena;
- `VllmEngine`: belayer-shadow's vLLM engine stepped directly on a weight server (packed weights).
No router, no HTTP: the engines alone. All three are started and warmed (one full round), then
measured in interleaved rounds (the order rotates each round) with the 1-min load average recorded
before each; ratios are taken per round (the median is reported). Greedy outputs are compared.
Saves JSON to benchmarks/results/bench_engine_vs_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_throughput_vllm import SIZES, Child, write_model

RESULTS = Path(__file__).parent / "results" / "bench_engine_vs_vllm.json"
SYSTEMS = {"stock_vllm": "stock", "builtin_engine": "builtin", "vllm_engine_direct": "direct"}


def measure_size(size: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start the three systems on one model folder, then interleaved rounds; per-system results."""
    entry: dict[str, Any] = {"parameters": write_model(size, folder)}
    children: dict[str, Child] = {}
    try:
        for key, role in SYSTEMS.items():
            children[key] = Child(role, folder, args)
        results: dict[str, dict[str, Any]] = {
            key: {"init_s": child.init_s, "tokens_per_s": [], "load_1min": []}
            for key, child in children.items()
        }
        outputs: dict[str, list[list[int]]] = {}
        keys = list(SYSTEMS)
        for round_ in range(args.rounds):
            for key in keys[round_ % len(keys) :] + keys[: round_ % len(keys)]:
                results[key]["load_1min"].append(os.getloadavg()[0])
                rate, outputs[key] = children[key].round()
                results[key]["tokens_per_s"].append(rate)
    finally:
        for child in children.values():
            child.close()
    for key, r in results.items():
        r["median_tokens_per_s"] = statistics.median(r["tokens_per_s"])
        r["outputs_equal_stock"] = outputs[key] == outputs["stock_vllm"]
        if key != "stock_vllm":
            r["ratio_to_stock_per_round"] = [
                a / b for a, b in zip(r["tokens_per_s"], results["stock_vllm"]["tokens_per_s"], strict=True)
            ]
            r["median_ratio_to_stock"] = statistics.median(r["ratio_to_stock_per_round"])
        entry[key] = r
    return entry


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"{cfg['num_requests']} greedy requests x {cfg['max_tokens']} new tokens, {cfg['threads']} CPU "
        f"threads per system, engines stepped directly (no router), {cfg['rounds']} interleaved rounds, "
        "median tokens/s (ratio: median of the per-round ratios to stock vLLM), 1-min load average:",
        "",
        "| model | stock vLLM `LLM.generate` | built-in engine | ratio | VllmEngine | ratio | load | outputs equal |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size, e in sorted(results["sizes"].items(), key=lambda item: item[1]["parameters"]):
        cells = [
            f"{size} ({e['parameters'] / 1e6:.1f} M params)",
            f"{e['stock_vllm']['median_tokens_per_s']:,.0f}",
        ]
        for key in ("builtin_engine", "vllm_engine_direct"):
            cells += [f"{e[key]['median_tokens_per_s']:,.0f}", f"{e[key]['median_ratio_to_stock']:.2f}"]
        loads = [x for key in SYSTEMS for x in e[key]["load_1min"]]
        cells.append(f"{min(loads):.1f}-{max(loads):.1f}")
        cells.append(str(all(e[key]["outputs_equal_stock"] for key in SYSTEMS)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, Any] = {"config": {**vars(args), "cpus": os.cpu_count()}, "sizes": {}}
    if RESULTS.exists():  # sizes not re-run keep their earlier results (--sizes runs a subset)
        results["sizes"] = json.loads(RESULTS.read_text()).get("sizes", {})
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-engine-vs-vllm-") as tmp:
        for size in args.sizes:
            entry = measure_size(size, Path(tmp) / size, args)
            results["sizes"][size] = entry
            print(json.dumps({size: {k: v for k, v in entry.items() if k != "outputs"}}), flush=True)
            RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    table = render(results)
    print(table)
    RESULTS.write_text(json.dumps({**results, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
