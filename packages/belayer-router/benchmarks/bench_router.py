"""Router overhead and resume latency, against calling the worker directly, in the same run.

    python benchmarks/bench_router.py [--streams 1 256] [--tokens 200] [--step-ms 30]

Processes: a paced worker (one token per stream every ``--step-ms``, like a continuously
batched engine), the router (``belayer-router serve``) and this client.  For each concurrency
it streams the same requests straight from the worker and through the router and reports
throughput, inter-token latency and the router's CPU time per token.  Then it measures the
time from a broken stream to the first resumed token on a ready replacement.  Prints a
markdown table and saves JSON to ``benchmarks/results/bench_router.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from belayer_router import RouterClient, TokenEvent, bind_socket, serve_asgi, serving

RESULTS = Path(__file__).parent / "results"


class PacedWorker:
    """The engine stand-in: deterministic tokens, one per ``step`` s per stream; can break/hang."""

    def __init__(self, epoch: int, step: float, break_at: int | None = None, hang: bool = False) -> None:
        self.epoch, self.step, self.break_at, self.hang = epoch, step, break_at, hang
        self.broken = anyio.Event()
        self.break_time = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x-ndjson")]}
        )
        start = len(request["generated_token_ids"])
        for index in range(start, start + request["max_tokens"]):
            if index == self.break_at:
                self.break_time = time.monotonic()
                self.broken.set()
                if self.hang:
                    await anyio.sleep_forever()
                raise ConnectionAbortedError("worker died (benchmark)")
            token = (request["seed"] * 7919 + index * 104729) % 32000
            line = (
                f'{{"type":"token","epoch":{self.epoch},"index":{index},"token_id":{token},"logprob":-1.0}}\n'
            )
            await send({"type": "http.response.body", "body": line.encode(), "more_body": True})
            await anyio.sleep(self.step)
        final = f'{{"type":"finish","epoch":{self.epoch},"finish_reason":"length"}}\n'.encode()
        await send({"type": "http.response.body", "body": final, "more_body": False})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_one(http: httpx.AsyncClient, url: str, body: dict[str, Any], gaps: list[float]) -> int:
    count = 0
    last = time.monotonic()
    async with http.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith('{"type":"token"'):
                now = time.monotonic()
                if count:
                    gaps.append(now - last)
                last, count = now, count + 1
    return count


async def throughput(url: str, streams: int, tokens: int, via_router: bool) -> dict[str, float]:
    gaps: list[float] = []
    counts: list[int] = []
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def one(i: int) -> None:
            body: dict[str, Any] = {"prompt_token_ids": [1, 2, 3], "max_tokens": tokens, "seed": i}
            if not via_router:
                body |= {"generated_token_ids": [], "temperature": 1.0, "top_p": 1.0}
                body |= {"stop_token_ids": [], "epoch": 1, "request_id": str(i)}
            counts.append(await stream_one(http, f"{url}/generate", body, gaps))

        began = time.monotonic()
        async with anyio.create_task_group() as group:
            for i in range(streams):
                group.start_soon(one, i)
        wall = time.monotonic() - began
    assert sum(counts) == streams * tokens, "lost tokens"
    return {
        "tokens_per_s": sum(counts) / wall,
        "itl_p50_ms": statistics.median(gaps) * 1e3,
        "itl_p99_ms": statistics.quantiles(gaps, n=100)[98] * 1e3 if len(gaps) > 100 else max(gaps) * 1e3,
    }


async def resume_latency(router_url: str, step: float, trials: int, hang: bool) -> list[float]:
    """Break (or hang) a stream, hand the slot over to a ready worker, time the first new token."""
    latencies: list[float] = []
    async with RouterClient(router_url, admin_token="bench") as client:
        for trial in range(trials):
            old, new = PacedWorker(1, step, break_at=20, hang=hang), PacedWorker(2, step)
            async with (
                serving(old, log_level="critical") as old_url,
                serving(new, log_level="critical") as new_url,
            ):
                slot = f"resume-{int(hang)}-{trial}"
                await client.register(slot, old_url, 1)
                arrivals: list[float] = []

                async def consume(seed: int, arrivals: list[float]) -> None:
                    async for event in client.generate_stream([1], 40, seed=seed):
                        if isinstance(event, TokenEvent):
                            arrivals.append(time.monotonic())

                async with anyio.create_task_group() as group:
                    group.start_soon(consume, trial, arrivals)
                    await old.broken.wait()
                    if not hang:
                        await client.unregister(slot, 1)
                    await client.register(slot, new_url, 2)  # the shadow's handover step (4)
                latencies.append((arrivals[20] - old.break_time) * 1e3)
                print(f"resume hang={hang}: {latencies[-1]:.1f} ms", file=sys.stderr, flush=True)
                await client.mark_unhealthy(slot)  # keep later trials off this slot
    return latencies


def start_process(argv: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert process.stdout is not None
    return process, process.stdout.readline().decode().split()[-1]


def serve_worker(port: int, step: float) -> None:
    sock = bind_socket("127.0.0.1", port)
    print(f"worker listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    anyio.run(serve_asgi, PacedWorker(1, step), sock, "critical")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    step = args.step_ms / 1e3
    worker, worker_url = start_process(
        [sys.executable, __file__, "--serve-worker", "--step-ms", str(args.step_ms)]
    )
    router_argv = [
        sys.executable,
        "-m",
        "belayer_router._cli",
        "serve",
        "--port",
        "0",
        "--admin-token",
        "bench",
    ]
    router, router_url = start_process(router_argv)
    try:
        async with RouterClient(router_url, admin_token="bench") as client:
            await client.register("bench", worker_url, 1)
        rows = []
        for streams in args.streams:
            direct = await throughput(worker_url, streams, args.tokens, via_router=False)
            cpu_before = cpu_seconds(router.pid)
            routed = await throughput(router_url, streams, args.tokens, via_router=True)
            cpu_per_token = (cpu_seconds(router.pid) - cpu_before) / (streams * args.tokens)
            rows.append(
                {
                    "streams": streams,
                    "direct": direct,
                    "router": routed,
                    "router_cpu_us_per_token": cpu_per_token * 1e6,
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
        resume = {
            "break_then_register": await resume_latency(router_url, step, args.trials, hang=False),
            "register_retires_hung_worker": await resume_latency(router_url, step, args.trials, hang=True),
        }
    finally:
        for process in (worker, router):
            process.terminate()
            process.wait()
    return {"config": vars(args), "cpus": os.cpu_count(), "throughput": rows, "resume_ms": resume}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| streams | direct tok/s | router tok/s | throughput loss | ITL p50 direct / router (ms) | ITL p99 direct / router (ms) | router CPU per token (us) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["throughput"]:
        d, r = row["direct"], row["router"]
        loss = 100 * (1 - r["tokens_per_s"] / d["tokens_per_s"])
        lines.append(
            f"| {row['streams']} | {d['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {loss:.1f}% | "
            f"{d['itl_p50_ms']:.1f} / {r['itl_p50_ms']:.1f} | {d['itl_p99_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
            f"{row['router_cpu_us_per_token']:.0f} |"
        )
    lines += ["", "| resume path | median (ms) | max (ms) |", "|---|---:|---:|"]
    for name, values in result["resume_ms"].items():
        lines.append(f"| {name} | {statistics.median(values):.1f} | {max(values):.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_worker:
        serve_worker(0, args.step_ms / 1e3)
        return
    result = anyio.run(run, args)
    text = table(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_router.json").write_text(json.dumps({**result, "table": text}, indent=2))


if __name__ == "__main__":
    main()
