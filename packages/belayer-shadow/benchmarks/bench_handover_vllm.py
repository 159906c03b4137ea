"""Handover on vLLM: SIGKILL of a vLLM main worker -> first resumed token, shadow vs restarts.

    python benchmarks/bench_handover_vllm.py     # needs belayer-shadow[vllm]

The same workload and measurements as `bench_handover.py` (whose trial functions it reuses), with
`SlotConfig(engine="vllm")`: every worker is a real vLLM engine in process. In the same run: the
shadow worker's handover, the instant restart (waitpid detection, a new vLLM worker from scratch,
token-level resume) and the paper's conventional recovery (health checks 10 s x 3, restart from
scratch, regeneration). Saves JSON to benchmarks/results/bench_handover_vllm.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).parent))

from bench_handover import TOKEN, _reference, restart_trial, shadow_trial

from belayer_router import RouterConfig, running_router
from belayer_shadow import SlotConfig, SlotSupervisor

RESULTS = Path(__file__).parent / "results" / "bench_handover_vllm.json"
START_TIMEOUT_S = 900.0


def _slot(url: str, run_dir: Path, name: str, **options: Any) -> SlotSupervisor:
    config = SlotConfig(
        slot=name,
        router_url=url,
        run_dir=run_dir,
        admin_token=TOKEN,
        engine="vllm",
        num_kv_blocks=256,  # vLLM's KV cache lives in this arena: 31 blocks of 128 positions
        start_timeout_s=START_TIMEOUT_S,
        **options,
    )
    return SlotSupervisor(config)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "prompts"}}
    # The 1-min load average before each recovery is measured (the machine is shared).
    results["load_1min"] = loads = {"start": os.getloadavg()[0]}
    config = RouterConfig(admin_token=TOKEN, resume_wait_s=900)
    with tempfile.TemporaryDirectory(prefix="bench-handover-vllm-") as tmp:
        root = Path(tmp)
        async with running_router(config) as (url, _app):
            slot = _slot(url, root / "shadow", "shadow", failure_window_s=0)
            await anyio.to_thread.run_sync(slot.start)
            try:
                reference = await _reference(url, args.prompts, args.max_tokens)
                results["shadow"] = []
                loads["shadow"] = os.getloadavg()[0]
                for _ in range(args.trials):
                    await anyio.to_thread.run_sync(lambda: slot.wait_protected(START_TIMEOUT_S))
                    results["shadow"].append(await shadow_trial(slot, url, args, reference))
            finally:
                await anyio.to_thread.run_sync(slot.stop)
        async with running_router(config) as (url, _app):
            slot = _slot(url, root / "restart", "restart", recovery="restart", failure_window_s=0)
            await anyio.to_thread.run_sync(slot.start)
            try:
                await anyio.to_thread.run_sync(lambda: slot.wait_protected(START_TIMEOUT_S))
                loads["restart"] = os.getloadavg()[0]
                results["restart"] = [await restart_trial(slot, url, args, reference)]
            finally:
                await anyio.to_thread.run_sync(slot.stop)
        async with running_router(config) as (url, _app):
            options = {
                "recovery": "conventional",
                "health_interval_s": args.health_interval_s,
                "health_misses": args.health_misses,
            }
            slot = _slot(url, root / "conventional", "conventional", **options)
            await anyio.to_thread.run_sync(slot.start)
            try:
                await anyio.to_thread.run_sync(lambda: slot.wait_protected(START_TIMEOUT_S))
                loads["conventional"] = os.getloadavg()[0]
                results["conventional"] = await restart_trial(slot, url, args, reference)
            finally:
                await anyio.to_thread.run_sync(slot.stop)
    return results


def render(results: dict[str, Any]) -> str:
    shadow, restart, conv = results["shadow"], results["restart"][0], results["conventional"]
    med = {k: statistics.median(t[k] for t in shadow) for k in shadow[0] if k.endswith("_s")}
    cfg, loads = results["config"], results["load_1min"]
    ms = lambda s: f"{s * 1000:.0f} ms"  # noqa: E731
    first = med["first_resumed_token_s"]
    return "\n".join(
        [
            f"vLLM workers: failure -> first resumed token (shadow: median of {len(shadow)} SIGKILLs; "
            f"restarts: 1 each; {cfg['num_requests']} concurrent greedy requests, default model, CPU):",
            "",
            "| step | shadow worker (vLLM) | instant restart (vLLM) + token-level resume | conventional (paper) |",
            "|---|---|---|---|",
            f"| detection | {ms(med['detection_s'])} | {ms(restart['detection_s'])} (waitpid) | {conv['detection_s']:.1f} s |",
            f"| fence + health check + flush | {ms(med['health_flush_s'])} | - | - |",
            f"| remap / reallocate + reload | {ms(med['remap_s'])} | {ms(restart['reallocate_s'])} | {ms(conv['reallocate_s'])} |",
            f"| warm-up | {ms(med['warmup_s'])} | whole restart (new vLLM worker): {restart['restart_s']:.1f} s | whole restart: {conv['restart_s']:.1f} s |",
            f"| registration (epoch + 1) | {ms(med['registration_s'])} | (in the restart) | (in the restart) |",
            f"| resume -> first token | {ms(med['resume_s'])} | {ms(restart['resume_s'])} | {ms(conv['resume_s'])} |",
            f"| **failure -> first resumed token** | **{ms(first)}** | **{restart['first_resumed_token_s']:.1f} s** | **{conv['first_resumed_token_s']:.1f} s** |",
            f"| speed-up of the shadow | 1x | {restart['first_resumed_token_s'] / first:.0f}x | {conv['first_resumed_token_s'] / first:.0f}x |",
            f"| outputs equal the failure-free run | {all(t['outputs_equal'] for t in shadow)} | {restart['outputs_equal']} | {conv['outputs_equal']} |",
            f"| tokens regenerated | {sum(t['tokens_regenerated'] for t in shadow)} | {restart['tokens_regenerated']} | {conv['tokens_regenerated']} |",
            f"| 1-min load average before the recovery | {loads['shadow']:.1f} | {loads['restart']:.1f} | {loads['conventional']:.1f} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trials", type=int, default=2, help="SIGKILLs of the shadow slot")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--kill-after", type=int, default=16, help="tokens every stream has before the kill")
    parser.add_argument("--health-interval-s", type=float, default=10.0, help="conventional probe interval")
    parser.add_argument("--health-misses", type=int, default=3, help="conventional misses before restart")
    args = parser.parse_args()
    logging.getLogger("uvicorn.error").addFilter(lambda record: "lifespan" not in record.getMessage())
    args.prompts = [[(13 * i + 5 * j) % 256 for j in range(24)] for i in range(args.num_requests)]
    results = anyio.run(run, args)
    table = render(results)
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**results, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
