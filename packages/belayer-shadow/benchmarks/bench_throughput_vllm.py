"""Throughput on vLLM: the router + a vLLM main worker (shadow standing by) vs stock `LLM.generate`.

    python benchmarks/bench_throughput_vllm.py      # needs belayer-shadow[vllm]

Three model sizes (Qwen3 layout, seeded weights, float32). For each: 32 concurrent greedy requests
x 128 new tokens, 16-token prompts, one CPU thread for every system:
- `belayer vLLM slot`: `SlotSupervisor(engine="vllm")` (weight server, vLLM main worker on its
  views, a vLLM shadow standing by) behind belayer-router, streamed by 32 concurrent clients;
- `stock vLLM`: `vllm.LLM(...).generate` on the same folder, same threads and KV cache size, in
  its own process (vLLM's offline batch API: no HTTP, no streaming);
- `belayer engine slot`: the same slot with the built-in engine (`engine="belayer"`).
One warm-up round each, then `--rounds` measured rounds (median). Saves JSON to
benchmarks/results/bench_throughput_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from belayer_router import RouterClient, RouterConfig, TokenEvent, running_router
from belayer_shadow import ModelConfig, SlotConfig, SlotSupervisor, init_weights, save_safetensors

RESULTS = Path(__file__).parent / "results" / "bench_throughput_vllm.json"
TOKEN = "bench-admin-token"
KV_CACHE_BYTES = 512 * 1024 * 1024
SIZES = {
    "1M": {},  # the default model
    "28M": {"hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64},
    "164M": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 13, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64},
}  # fmt: skip


def prompts(num_requests: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 256 for j in range(16)] for i in range(num_requests)]


def write_model(size: str, folder: Path) -> int:
    """A model folder (config.json + model.safetensors, seeded init); returns the parameter count."""
    config = ModelConfig.from_dict({**ModelConfig.default().to_dict(), **SIZES[size]})
    folder.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf().to_dict()
    hf["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(hf))
    weights = init_weights(config, seed=0)
    save_safetensors(weights, folder / "model.safetensors")
    return sum(t.numel() for t in weights.values())


def stock(folder: Path, num_requests: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """In this process: vLLM's `LLM.generate` (one thread); tokens/s per round."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    torch.set_num_threads(1)
    start = time.monotonic()
    llm = LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    init_s = time.monotonic() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts(num_requests)]
    llm.generate(inputs[:4], params, use_tqdm=False)  # warm-up
    rates, outputs = [], []
    for _ in range(rounds):
        start = time.monotonic()
        done = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.monotonic() - start
        rates.append(sum(len(d.outputs[0].token_ids) for d in done) / elapsed)
        outputs = [list(d.outputs[0].token_ids) for d in done]
    return {"init_s": init_s, "tokens_per_s": rates, "outputs": outputs}


def direct(folder: Path, num_requests: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """In this process: `VllmEngine` stepped directly (no router, no HTTP), on a weight server
    filled with `weight_layout`'s table (every parameter a view); tokens/s per round."""
    import torch

    from belayer_gpumem import ServerConfig, ServerProcess
    from belayer_shadow import SamplingParams, fill_weight_server, load_safetensors, weight_layout
    from belayer_shadow._vllm import VllmEngine

    config = ModelConfig.from_json_file(folder / "config.json")
    with tempfile.TemporaryDirectory(prefix="bench-direct-") as tmp:
        sockets = Path(tmp) / "sockets"
        sockets.mkdir(mode=0o700)
        layout = Path(tmp) / "layout.json"
        layout.write_text(json.dumps(weight_layout(config).to_json()))
        server = ServerProcess.start(
            ServerConfig(kind="weights", socket=sockets / "w.sock", layout_file=layout)
        )
        try:
            fill_weight_server(sockets / "w.sock", load_safetensors(folder / "model.safetensors"))
            torch.set_num_threads(1)
            start = time.monotonic()
            engine = VllmEngine(
                config, sockets / "w.sock", max_num_seqs=num_requests, kv_cache_bytes=KV_CACHE_BYTES
            )
            init_s = time.monotonic() - start
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            rates, copied = [], engine.copied_params
            for round_ in range(rounds + 1):  # the first round warms up
                count = 4 if round_ == 0 else num_requests
                start = time.monotonic()
                for i, prompt in enumerate(prompts(num_requests)[:count]):
                    engine.add_request(f"{round_}-{i}", prompt, params)
                produced = 0
                while engine.has_unfinished():
                    produced += len(engine.step())
                if round_:
                    rates.append(produced / (time.monotonic() - start))
            engine.close()
        finally:
            server.stop()
    return {"init_s": init_s, "tokens_per_s": rates, "copied_params": copied}


async def through_router(url: str, num_requests: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    tokens: list[list[int]] = [[] for _ in range(num_requests)]
    async with RouterClient(url, timeout=600) as client, anyio.create_task_group() as group:

        async def one(i: int, prompt: list[int]) -> None:
            async for event in client.generate_stream(prompt, max_tokens, temperature=0.0, seed=i):
                if isinstance(event, TokenEvent):
                    tokens[i].append(event.token_id)

        start = time.monotonic()
        for i, prompt in enumerate(prompts(num_requests)):
            group.start_soon(one, i, prompt)
    elapsed = time.monotonic() - start
    return sum(len(t) for t in tokens) / elapsed, tokens


async def slot_run(engine: str, folder: Path, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    async with running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=600)) as (url, _app):
        config = SlotConfig(
            slot="s0",
            router_url=url,
            run_dir=run_dir,
            admin_token=TOKEN,
            model=folder / "config.json",
            weights=folder / "model.safetensors",
            engine=engine,
            max_num_seqs=args.num_requests,
            # vLLM's KV cache lives in this arena: 8 x 16-position blocks per 128-position vLLM
            # block, two vLLM blocks per request (prompt + 128 tokens), one spare.
            num_kv_blocks=16 * args.num_requests + 16,
            start_timeout_s=900.0,
            # A prefill of 32 prompts on the larger models can outlast the default 0.5 s hang
            # threshold on a loaded machine; this benchmark measures throughput, not detection.
            stale_s=10.0,
        )
        slot = SlotSupervisor(config)
        start = time.monotonic()
        await anyio.to_thread.run_sync(slot.start)
        try:
            await anyio.to_thread.run_sync(lambda: slot.wait_protected(900.0))
            init_s = time.monotonic() - start
            await through_router(url, 4, args.max_tokens)  # warm-up
            rates, outputs = [], []
            for _ in range(args.rounds):
                rate, outputs = await through_router(url, args.num_requests, args.max_tokens)
                rates.append(rate)
            return {"init_s": init_s, "tokens_per_s": rates, "outputs": outputs}
        finally:
            await anyio.to_thread.run_sync(slot.stop)


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "stock"}, "sizes": {}}
    if RESULTS.exists():  # sizes not re-run keep their earlier results (--sizes runs a subset)
        results["sizes"] = json.loads(RESULTS.read_text()).get("sizes", {})
    with tempfile.TemporaryDirectory(prefix="bench-throughput-vllm-") as tmp:
        for size in args.sizes:
            folder = Path(tmp) / size
            entry: dict[str, Any] = {"parameters": write_model(size, folder)}
            command = [sys.executable, __file__, "--stock", str(folder), "--rounds", str(args.rounds)]
            command += ["--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)]
            done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=1800)
            entry["stock_vllm"] = json.loads(done.stdout.strip().splitlines()[-1])
            entry["belayer_vllm_slot"] = anyio.run(slot_run, "vllm", folder, Path(tmp) / f"{size}-vllm", args)
            entry["belayer_engine_slot"] = anyio.run(
                slot_run, "belayer", folder, Path(tmp) / f"{size}-ours", args
            )
            reference = entry["stock_vllm"]["outputs"]
            for key in ("belayer_vllm_slot", "belayer_engine_slot"):
                entry[key]["outputs_equal_stock"] = entry[key]["outputs"] == reference
            for key in ("stock_vllm", "belayer_vllm_slot", "belayer_engine_slot"):
                entry[key]["median_tokens_per_s"] = statistics.median(entry[key]["tokens_per_s"])
                del entry[key]["outputs"]
            results["sizes"][size] = entry
            print(json.dumps({size: entry}), flush=True)
            RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return results


def add_direct(args: argparse.Namespace) -> None:
    """Measure `VllmEngine` in process for `--sizes` and add it to the saved results."""
    results = json.loads(RESULTS.read_text())
    with tempfile.TemporaryDirectory(prefix="bench-throughput-vllm-") as tmp:
        for size in args.sizes:
            folder = Path(tmp) / size
            write_model(size, folder)
            command = [sys.executable, __file__, "--direct", str(folder), "--rounds", str(args.rounds)]
            command += ["--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)]
            done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=1800)
            entry = json.loads(done.stdout.strip().splitlines()[-1])
            entry["median_tokens_per_s"] = statistics.median(entry["tokens_per_s"])
            results["sizes"][size]["vllm_engine_direct"] = entry
            print(json.dumps({size: entry}), flush=True)
    table = render(results)
    print(table)
    RESULTS.write_text(json.dumps({**results, "table": table}, indent=2) + "\n")


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"{cfg['num_requests']} concurrent greedy requests x {cfg['max_tokens']} new tokens, one CPU thread, "
        f"median of {cfg['rounds']} rounds, tokens/s:",
        "",
        "| model | stock vLLM `LLM.generate` | VllmEngine in process (views, F.linear) | ratio | "
        "router + vLLM main worker (shadow standing by) | ratio | router + built-in engine slot | "
        "built-in / stock vLLM | outputs equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size, e in sorted(results["sizes"].items(), key=lambda item: item[1]["parameters"]):
        s, v, b = (
            e[k]["median_tokens_per_s"] for k in ("stock_vllm", "belayer_vllm_slot", "belayer_engine_slot")
        )
        equal = (
            e["belayer_vllm_slot"]["outputs_equal_stock"] and e["belayer_engine_slot"]["outputs_equal_stock"]
        )
        d = e.get("vllm_engine_direct", {}).get("median_tokens_per_s")
        direct_cells = "- | -" if d is None else f"{d:,.0f} | {d / s:.2f}"
        lines.append(
            f"| {size} ({e['parameters'] / 1e6:.1f} M params) | {s:,.0f} | {direct_cells} | {v:,.0f} | "
            f"{v / s:.2f} | {b:,.0f} | {b / s:.2f} | {equal} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stock", type=Path, help=argparse.SUPPRESS)  # internal: the stock-vLLM child
    parser.add_argument("--direct", type=Path, help=argparse.SUPPRESS)  # internal: the VllmEngine child
    parser.add_argument(
        "--direct-only",
        action="store_true",
        help="only add VllmEngine stepped in process (no router) to the saved results of --sizes",
    )
    args = parser.parse_args()
    if args.stock is not None:
        print(json.dumps(stock(args.stock, args.num_requests, args.max_tokens, args.rounds)))
        return
    if args.direct is not None:
        print(json.dumps(direct(args.direct, args.num_requests, args.max_tokens, args.rounds)))
        return
    if args.direct_only:
        add_direct(args)
        return
    logging.getLogger("uvicorn.error").addFilter(lambda record: "lifespan" not in record.getMessage())
    results = run(args)
    table = render(results)
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**results, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
