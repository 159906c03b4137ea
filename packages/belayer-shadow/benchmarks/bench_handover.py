"""Handover benchmark: SIGKILL of the main worker -> first resumed token, shadow vs two restart baselines.

    python benchmarks/bench_handover.py                      # conventional at its defaults (10 s x 3)
    python benchmarks/bench_handover.py --health-interval-s 1  # a quicker conventional baseline

One router on loopback, the default model on CPU. A slot with a shadow worker serves several
concurrent greedy requests; once every stream has tokens, the main worker is SIGKILLed. The time
to the first resumed token is split with the slot's event log into detection, fence + health check
+ flush, remap, warm-up, registration and resume (the KV refill by prefill, up to the first new
token). Two baselines run the same workload in the same run, behind the same supervisor: the
paper's conventional recovery (remote health checks, restart from scratch, regeneration) and the
strongest restart baseline (the supervisor's instant `waitpid` detection, restart from scratch,
token-level resume through the router: nothing regenerated). Every output must equal the
failure-free output; the shadow and the instant restart must regenerate no token. Last, the throughput of the main worker with and without an
idle shadow beside it (32 concurrent requests, phases interleaved). Prints a markdown table and
saves JSON to benchmarks/results/bench_handover.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from belayer_router import RouterClient, RouterConfig, TokenEvent, running_router
from belayer_shadow import SlotConfig, SlotSupervisor

RESULTS = Path(__file__).parent / "results" / "bench_handover.json"
TOKEN = "bench-admin-token"


class Streams:
    """Concurrent greedy streams that record every token's arrival time."""

    def __init__(self, url: str, prompts: list[list[int]], max_tokens: int) -> None:
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.arrivals: list[list[float]] = [[] for _ in prompts]

    async def run(self) -> None:
        async with RouterClient(self.url, timeout=600) as client, anyio.create_task_group() as group:
            for i in range(len(self.prompts)):
                group.start_soon(self._one, client, i)

    async def _one(self, client: RouterClient, i: int) -> None:
        async for event in client.generate_stream(self.prompts[i], self.max_tokens, temperature=0.0, seed=i):
            if isinstance(event, TokenEvent):
                self.tokens[i].append(event.token_id)
                self.arrivals[i].append(time.time())

    async def wait_tokens(self, count: int) -> None:
        with anyio.fail_after(120):
            while min(len(t) for t in self.tokens) < count:  # noqa: ASYNC110
                await anyio.sleep(0.002)

    def first_after(self, moment: float) -> list[float]:
        """Per stream, the arrival of its first token after `moment`."""
        return [next(t for t in times if t > moment) for times in self.arrivals]


def _event(events: list[dict[str, Any]], name: str, after: float) -> dict[str, Any]:
    return next(e for e in events if e["event"] == name and e["time"] >= after)


def _worker_regenerated(url: str | None) -> int:
    if url is None:
        return -1
    text = httpx.get(f"{url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("belayer_shadow_tokens_regenerated_total"))
    return int(line.split()[1])


async def _reference(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    streams = Streams(url, prompts, max_tokens)
    await streams.run()
    return streams.tokens


async def _kill_during(slot: SlotSupervisor, streams: Streams, after_tokens: int) -> float:
    async with anyio.create_task_group() as group:
        group.start_soon(streams.run)
        await streams.wait_tokens(after_tokens)
        killed = slot.kill_main()
    return killed


async def shadow_trial(
    slot: SlotSupervisor, url: str, args: argparse.Namespace, reference: list[list[int]]
) -> dict[str, Any]:
    await anyio.to_thread.run_sync(slot.wait_protected)
    done = slot.num_handovers
    streams = Streams(url, args.prompts, args.max_tokens)
    killed = await _kill_during(slot, streams, args.kill_after)
    await anyio.to_thread.run_sync(slot.wait_handovers, done + 1)
    events = slot.events()
    step = {
        name: _event(events, f"handover.{name}", killed)
        for name in ("detect", "fence", "health_check", "flush", "remap", "warmup", "register")
    }
    registered = step["register"]["time"]
    first = streams.first_after(registered)
    return {
        "detection_s": step["detect"]["time"] - killed,
        "reaped_s": _event(events, "handover.flag", killed)["time"] - killed,
        "health_flush_s": sum(step[n]["duration_s"] for n in ("fence", "health_check", "flush")),
        "remap_s": step["remap"]["duration_s"],
        "scratch_bytes": step["remap"]["nbytes"],
        "warmup_s": step["warmup"]["duration_s"],
        "registration_s": registered - step["warmup"]["time"],
        "resume_s": min(first) - registered,
        "first_resumed_token_s": min(first) - killed,
        "all_resumed_s": max(first) - killed,
        "outputs_equal": streams.tokens == reference,
        "tokens_regenerated": _worker_regenerated(slot.main_url),
    }


async def restart_trial(
    slot: SlotSupervisor, url: str, args: argparse.Namespace, reference: list[list[int]]
) -> dict[str, Any]:
    """One SIGKILL under a restart baseline (`slot.config.recovery`: conventional or restart)."""
    cause = slot.config.recovery
    done = slot.num_handovers
    streams = Streams(url, args.prompts, args.max_tokens)
    killed = await _kill_during(slot, streams, args.kill_after)
    await anyio.to_thread.run_sync(lambda: slot.wait_handovers(done + 1, 600.0))
    events = slot.events()
    detect = _event(events, f"{cause}.detect", killed)
    restart = _event(events, f"{cause}.restart", killed)
    first = streams.first_after(restart["time"])
    return {
        "detection_s": detect["time"] - killed,
        "restart_s": restart["duration_s"],
        "reallocate_s": _event(events, f"{cause}.reallocate", killed)["duration_s"],
        "resume_s": min(first) - restart["time"],
        "first_resumed_token_s": min(first) - killed,
        "all_resumed_s": max(first) - killed,
        "outputs_equal": streams.tokens == reference,
        "tokens_regenerated": _worker_regenerated(slot.main_url),
    }


async def throughput(url: str, num_requests: int, max_tokens: int) -> float:
    prompts = [[(7 * i + j) % 256 for j in range(16)] for i in range(num_requests)]
    streams = Streams(url, prompts, max_tokens)
    start = time.monotonic()
    await streams.run()
    return sum(len(t) for t in streams.tokens) / (time.monotonic() - start)


def _slot_config(url: str, run_dir: Path, slot: str, **options: Any) -> SlotConfig:
    return SlotConfig(slot=slot, router_url=url, run_dir=run_dir, admin_token=TOKEN, **options)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "prompts"}}
    config = RouterConfig(admin_token=TOKEN, resume_wait_s=300)
    with tempfile.TemporaryDirectory(prefix="bench-handover-") as tmp:
        root = Path(tmp)
        async with running_router(config) as (url, _app):
            slot = SlotSupervisor(_slot_config(url, root / "shadow", "shadow", failure_window_s=0))
            await anyio.to_thread.run_sync(slot.start)
            try:
                reference = await _reference(url, args.prompts, args.max_tokens)
                results["shadow"] = [
                    await shadow_trial(slot, url, args, reference) for _ in range(args.trials)
                ]
            finally:
                await anyio.to_thread.run_sync(slot.stop)
        async with running_router(config) as (url, _app):
            options = {
                "recovery": "conventional",
                "health_interval_s": args.health_interval_s,
                "health_misses": args.health_misses,
            }
            slot = SlotSupervisor(_slot_config(url, root / "conventional", "conventional", **options))
            await anyio.to_thread.run_sync(slot.start)
            try:
                results["conventional"] = await restart_trial(slot, url, args, reference)
            finally:
                await anyio.to_thread.run_sync(slot.stop)
        async with running_router(config) as (url, _app):
            options = {"recovery": "restart", "failure_window_s": 0}
            slot = SlotSupervisor(_slot_config(url, root / "restart", "restart", **options))
            await anyio.to_thread.run_sync(slot.start)
            try:
                await anyio.to_thread.run_sync(slot.wait_protected)
                results["restart"] = [
                    await restart_trial(slot, url, args, reference) for _ in range(args.trials)
                ]
            finally:
                await anyio.to_thread.run_sync(slot.stop)
        results["throughput"] = await throughput_phases(root, args)
    return results


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput_phases(root: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Tokens/s of one main worker, alone (no shadow) and with an idle shadow, phases interleaved.

    Also the CPU seconds the idle shadow used during its phases, against the main worker's.
    """
    measured: dict[str, list[float]] = {"alone": [], "with_shadow": [], "shadow_cpu_s": [], "main_cpu_s": []}
    for round_index in range(args.throughput_rounds):
        for name, recovery in (("alone", "conventional"), ("with_shadow", "shadow")):
            async with running_router(RouterConfig(admin_token=TOKEN)) as (url, _app):
                run_dir = root / f"tp-{name}-{round_index}"
                slot = SlotSupervisor(
                    _slot_config(url, run_dir, "tp", recovery=recovery, health_interval_s=3600)
                )
                await anyio.to_thread.run_sync(slot.start)
                try:
                    await anyio.to_thread.run_sync(slot.wait_protected)
                    await throughput(url, 8, 16)  # warm the router and worker connections
                    assert slot.main is not None
                    pids = [slot.main.pid, *([] if slot.shadow is None else [slot.shadow.pid])]
                    before = [_cpu_seconds(pid) for pid in pids]
                    measured[name].append(await throughput(url, 32, args.throughput_tokens))
                    used = [_cpu_seconds(pid) - start for pid, start in zip(pids, before, strict=True)]
                    if slot.shadow is not None:
                        measured["main_cpu_s"].append(used[0])
                        measured["shadow_cpu_s"].append(used[1])
                finally:
                    await anyio.to_thread.run_sync(slot.stop)
    return measured


def _medians(trials: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(t[k] for t in trials) for k in trials[0] if k.endswith("_s")}


def render(results: dict[str, Any]) -> str:
    shadow, conv, restart = results["shadow"], results["conventional"], results["restart"]
    med, rst = _medians(shadow), _medians(restart)
    ms = lambda s: f"{s * 1000:.0f} ms"  # noqa: E731
    cfg = results["config"]
    first = conv["first_resumed_token_s"]
    lines = [
        f"Failure -> first resumed token (shadow and instant restart: median of {len(shadow)} SIGKILLs each; "
        f"conventional: 1; {cfg['num_requests']} concurrent greedy requests, default model, CPU):",
        "",
        "| step | shadow worker | instant restart + token-level resume | conventional (paper) |",
        "|---|---|---|---|",
        f"| detection | {ms(med['detection_s'])} (reaped in {ms(med['reaped_s'])}) | {ms(rst['detection_s'])} (waitpid) | {conv['detection_s']:.1f} s (health checks {cfg['health_interval_s']:g} s x {cfg['health_misses']}) |",
        f"| fence + health check + flush | {ms(med['health_flush_s'])} | - | - |",
        f"| remap (scratch buffer {shadow[0]['scratch_bytes'] >> 20} MiB) / reallocate + reload weights | {ms(med['remap_s'])} | {ms(rst['reallocate_s'])} | {ms(conv['reallocate_s'])} |",
        f"| warm-up | {ms(med['warmup_s'])} | whole restart (reallocate, new process, attach, warm-up, register): {rst['restart_s']:.2f} s | whole restart: {conv['restart_s']:.2f} s |",
        f"| registration (epoch + 1) | {ms(med['registration_s'])} | (in the restart) | (in the restart) |",
        f"| resume -> first token | {ms(med['resume_s'])} (KV refill by prefill) | {ms(rst['resume_s'])} (prefill of prompt + streamed tokens) | {ms(conv['resume_s'])} (regenerates from the start) |",
        f"| **failure -> first resumed token** | **{ms(med['first_resumed_token_s'])}** | **{rst['first_resumed_token_s']:.2f} s** | **{first:.1f} s** |",
        f"| failure -> every request resumed | {ms(med['all_resumed_s'])} | {rst['all_resumed_s']:.2f} s | {conv['all_resumed_s']:.1f} s |",
        f"| speed-up of the shadow | 1x | {rst['first_resumed_token_s'] / med['first_resumed_token_s']:.1f}x | {first / med['first_resumed_token_s']:.0f}x |",
        f"| outputs equal the failure-free run | {all(t['outputs_equal'] for t in shadow)} | {all(t['outputs_equal'] for t in restart)} | {conv['outputs_equal']} |",
        f"| tokens regenerated | {sum(t['tokens_regenerated'] for t in shadow)} | {sum(t['tokens_regenerated'] for t in restart)} | {conv['tokens_regenerated']} |",
    ]
    tp = results["throughput"]
    alone, with_shadow = statistics.median(tp["alone"]), statistics.median(tp["with_shadow"])
    lines += [
        "",
        f"Throughput through the router, 32 concurrent requests x {cfg['throughput_tokens']} tokens (median of {len(tp['alone'])} interleaved rounds):",
        "",
        "| main worker | tokens/s |",
        "|---|---|",
        f"| alone | {alone:.0f} |",
        f"| with an idle shadow beside it | {with_shadow:.0f} ({(with_shadow / alone - 1) * 100:+.1f}%) |",
        "",
        f"CPU the idle shadow used during those phases: {sum(tp['shadow_cpu_s']) * 1000:.0f} ms, against "
        f"{sum(tp['main_cpu_s']):.2f} s of the main worker ({sum(tp['shadow_cpu_s']) / sum(tp['main_cpu_s']) * 100:.2f}%).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--trials", type=int, default=3, help="SIGKILLs of the shadow and instant-restart slots"
    )
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--kill-after", type=int, default=16, help="tokens every stream has before the kill")
    parser.add_argument("--health-interval-s", type=float, default=10.0, help="conventional probe interval")
    parser.add_argument("--health-misses", type=int, default=3, help="conventional misses before restart")
    parser.add_argument("--throughput-rounds", type=int, default=5)
    parser.add_argument("--throughput-tokens", type=int, default=64)
    args = parser.parse_args()
    # Routers stopped between phases log their cancelled lifespan task; that is not a result.
    logging.getLogger("uvicorn.error").addFilter(lambda record: "lifespan" not in record.getMessage())
    args.prompts = [[(13 * i + 5 * j) % 256 for j in range(24)] for i in range(args.num_requests)]
    results = anyio.run(run, args)
    table = render(results)
    print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({**results, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
