"""Router overhead and resume latency, against calling the worker directly, in the same run.

    python benchmarks/bench_router.py [--streams 1 256] [--tokens 200] [--step-ms 30]
        [--frame-tokens 1] [--worker-events token tokens] [--loop auto|asyncio|uvloop]

Processes: a paced worker (``--frame-tokens`` tokens per stream every ``--step-ms``, like a
continuously batched engine), the router (``belayer-router serve``) and this client (which asks
the router for ``tokens`` frames).  The worker sends a step's tokens as ``token`` lines (one per
token) or as one ``tokens`` frame; ``--worker-events token tokens`` measures both, each with a
fresh worker and router, in one run.  For each concurrency
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
import orjson

from belayer_router import (
    RouterClient,
    RouterFleet,
    TokenEvent,
    bind_socket,
    owner_index,
    serve_asgi,
    serving,
)
from belayer_router.worker import LINK_PATH, LinkSubmit, encode_step, read_link_frames

RESULTS = Path(__file__).parent / "results"


class PacedWorker:
    """The engine stand-in: deterministic tokens, one per ``step`` s per stream; can break/hang."""

    def __init__(
        self,
        epoch: int,
        step: float,
        break_at: int | None = None,
        hang: bool = False,
        frame: int = 1,
        events: str = "token",
    ) -> None:
        self.epoch, self.step, self.break_at, self.hang, self.frame = epoch, step, break_at, hang, frame
        self.events = events  # "token": one line per token; "tokens": one frame per step; "link"
        self.broken = anyio.Event()
        self.break_time = 0.0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] == LINK_PATH:
            await self._link(receive, send)
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
        end = start + request["max_tokens"]
        for index in range(start, end, self.frame):
            if self.break_at is not None and index <= self.break_at < index + self.frame:
                self.break_time = time.monotonic()
                self.broken.set()
                if self.hang:
                    await anyio.sleep_forever()
                raise ConnectionAbortedError("worker died (benchmark)")
            seed = request["seed"]
            if self.events == "token":
                line = b"".join(
                    f'{{"type":"token","epoch":{self.epoch},"index":{i},"token_id":{(seed * 7919 + i * 104729) % 32000},"logprob":-1.0}}\n'.encode()
                    for i in range(index, min(index + self.frame, end))
                )
            else:
                count = min(self.frame, end - index)
                tokens = [(seed * 7919 + i * 104729) % 32000 for i in range(index, index + count)]
                frame = {"type": "tokens", "epoch": self.epoch, "index": index, "token_ids": tokens}
                line = orjson.dumps(frame | {"logprobs": [-1.0] * count}, option=orjson.OPT_APPEND_NEWLINE)
            await send({"type": "http.response.body", "body": line, "more_body": True})
            if self.step:
                await anyio.sleep(self.step)
        final = f'{{"type":"finish","epoch":{self.epoch},"finish_reason":"length"}}\n'.encode()
        await send({"type": "http.response.body", "body": final, "more_body": False})

    async def _link(self, receive: Any, send: Any) -> None:
        """The multiplexed link: every ``step`` s ONE frame with a token for every running request."""
        await send({"type": "http.response.start", "status": 200, "headers": []})
        active: dict[int, list[int]] = {}  # handle -> [seed, next index, end]

        async def stepper() -> None:
            while True:
                if active:
                    entries, finished = [], []
                    for handle, state in list(active.items()):
                        seed, index, end = state
                        entries.append((handle, index, [(seed * 7919 + index * 104729) % 32000], [-1.0]))
                        state[1] = index + 1
                        if index + 1 >= end:
                            finished.append((handle, "length"))
                            del active[handle]
                    body = encode_step(self.epoch, entries, finished)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                await anyio.sleep(self.step)

        async with anyio.create_task_group() as group:
            group.start_soon(stepper)
            async for message in read_link_frames(receive):
                if isinstance(message, LinkSubmit):
                    request = message.body
                    start = len(request["generated_token_ids"])
                    active[message.handle] = [request["seed"], start, start + request["max_tokens"]]
                else:
                    active.pop(message.handle, None)
            group.cancel_scope.cancel()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def stream_one(http: httpx.AsyncClient, url: str, body: dict[str, Any], gaps: list[float]) -> int:
    """Stream one request; ``gaps`` gets the time between token arrivals (0 within one frame)."""
    count = 0
    last = time.monotonic()
    async with http.stream("POST", url, json=body) as response:
        pending = b""
        async for chunk in response.aiter_raw():
            *lines, pending = (pending + chunk).split(b"\n")
            now = time.monotonic()
            for line in lines:
                if line.startswith(b'{"type":"token'):
                    event = orjson.loads(line)
                    size = len(event["token_ids"]) if event["type"] == "tokens" else 1
                    if count:
                        gaps.append(now - last)
                    gaps.extend([0.0] * (size - 1))
                    last, count = now, count + size
    return count


async def throughput(
    url: str | list[str], streams: int, tokens: int, via_router: bool, tag: str = ""
) -> dict[str, float]:
    """Stream ``streams`` requests at once; with several router URLs each goes to its owner."""
    urls = [url] if isinstance(url, str) else url
    gaps: list[float] = []
    counts: list[int] = []
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def one(i: int) -> None:
            body: dict[str, Any] = {"prompt_token_ids": [1, 2, 3], "max_tokens": tokens, "seed": i}
            body["frames"] = True
            request_id = f"{tag}{i}"
            if not via_router:
                body |= {"generated_token_ids": [], "temperature": 1.0, "top_p": 1.0}
                body |= {"stop_token_ids": [], "epoch": 1, "request_id": request_id}
            elif tag:
                body["request_id"] = request_id
            owner = urls[owner_index(urls, request_id)] if tag else urls[0]
            counts.append(await stream_one(http, f"{owner}/generate", body, gaps))

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
    """Start a server process that prints its URL as the first stdout line (``--json`` or plain)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert process.stdout is not None
    line = process.stdout.readline().decode()
    return process, json.loads(line)["url"] if line.startswith("{") else line.split()[-1]


def serve_worker(port: int, step: float, frame: int, events: str) -> None:
    sock = bind_socket("127.0.0.1", port)
    print(f"worker listening on http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    anyio.run(serve_asgi, PacedWorker(1, step, frame=frame, events=events), sock, "critical")


def router_argv(loop: str) -> list[str]:
    argv = [sys.executable, "-m", "belayer_router._cli", "serve", "--port", "0", "--admin-token", "bench"]
    return [*argv, "--json", "--loop", loop]


async def fleet_rows(args: argparse.Namespace, worker_url: str) -> list[dict[str, Any]]:
    """Tokens/s through 1..N router processes (requests spread by owner hash), against direct."""
    rows = []
    direct = await throughput(worker_url, args.fleet_streams, args.tokens, via_router=False)
    print({"generator_ceiling": direct}, file=sys.stderr, flush=True)
    for count in args.fleet:
        started = [start_process(router_argv(args.loop)) for _ in range(count)]
        try:
            urls = [url for _, url in started]
            async with RouterFleet(urls, admin_token="bench") as fleet:
                await fleet.register("bench", worker_url, 1, link=args.worker_events[0] == "link")
            cpu_before = sum(cpu_seconds(p.pid) for p, _ in started)
            routed = await throughput(
                urls, args.fleet_streams, args.tokens, via_router=True, tag=f"f{count}-"
            )
            cpu = sum(cpu_seconds(p.pid) for p, _ in started) - cpu_before
        finally:
            for process, _ in started:
                process.terminate()
                process.wait()
        rows.append(
            {
                "routers": count,
                "direct_tokens_per_s": direct["tokens_per_s"],
                "router": routed,
                "router_cpu_us_per_token": cpu / (args.fleet_streams * args.tokens) * 1e6,
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    fleet: list[dict[str, Any]] = []
    resume: dict[str, list[float]] = {}
    for number, events in enumerate(args.worker_events):
        first = number == 0  # the fleet and resume rows run once, with the first kind of events
        worker_argv = [sys.executable, __file__, "--serve-worker", "--step-ms", str(args.step_ms)]
        worker_argv += ["--frame-tokens", str(args.frame_tokens), "--worker-events", events]
        worker, worker_url = start_process(worker_argv)
        router, router_url = start_process(router_argv(args.loop))
        try:
            async with RouterClient(router_url, admin_token="bench") as client:
                await client.register("bench", worker_url, 1, link=events == "link")
            for streams in args.streams:
                direct = await throughput(worker_url, streams, args.tokens, via_router=False)
                cpu_before = cpu_seconds(router.pid)
                routed = await throughput(router_url, streams, args.tokens, via_router=True)
                cpu_per_token = (cpu_seconds(router.pid) - cpu_before) / (streams * args.tokens)
                rows.append(
                    {
                        "worker_events": events,
                        "streams": streams,
                        "direct": direct,
                        "router": routed,
                        "router_cpu_us_per_token": cpu_per_token * 1e6,
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
            if first and args.fleet:
                fleet = await fleet_rows(args, worker_url)
            if first and not args.skip_resume:
                step = args.step_ms / 1e3
                resume = {
                    "break_then_register": await resume_latency(router_url, step, args.trials, hang=False),
                    "register_retires_hung_worker": await resume_latency(
                        router_url, step, args.trials, hang=True
                    ),
                }
        finally:
            for process in (worker, router):
                process.terminate()
                process.wait()
    return {
        "config": vars(args),
        "cpus": os.cpu_count(),
        "loadavg_1min_at_end": os.getloadavg()[0],
        "throughput": rows,
        "fleet": fleet,
        "resume_ms": resume,
    }


def _throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| streams | direct tok/s | router tok/s | throughput loss | ITL p50 direct / router (ms) | ITL p99 direct / router (ms) | router CPU per token (us) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        d, r = row["direct"], row["router"]
        loss = 100 * (1 - r["tokens_per_s"] / d["tokens_per_s"])
        lines.append(
            f"| {row['streams']} | {d['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {loss:.1f}% | "
            f"{d['itl_p50_ms']:.1f} / {r['itl_p50_ms']:.1f} | {d['itl_p99_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
            f"{row['router_cpu_us_per_token']:.0f} |"
        )
    return lines


def table(result: dict[str, Any]) -> str:
    lines: list[str] = []
    tokens = result["config"]["frame_tokens"]
    for events in result["config"]["worker_events"]:
        kind = {
            "token": "one `token` line per token",
            "tokens": "one `tokens` frame per request per step",
            "link": "the link: one binary `STEP` frame per step for all requests",
        }[events]
        lines += [f"Worker events: {kind}, {tokens} token(s) per stream per step", ""]
        lines += _throughput_table([row for row in result["throughput"] if row["worker_events"] == events])
        lines.append("")
    lines.pop()
    if result["fleet"]:
        lines += [
            "",
            "| routers | generator alone tok/s | through the routers tok/s | loss | router CPU per token (us) |",
            "|---:|---:|---:|---:|---:|",
        ]
        for row in result["fleet"]:
            d, r = row["direct_tokens_per_s"], row["router"]["tokens_per_s"]
            lines.append(
                f"| {row['routers']} | {d:.0f} | {r:.0f} | {100 * (1 - r / d):.1f}% | "
                f"{row['router_cpu_us_per_token']:.1f} |"
            )
    if not result["resume_ms"]:
        return "\n".join(lines)
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
    parser.add_argument("--frame-tokens", type=int, default=1, help="tokens per worker event and step")
    parser.add_argument(
        "--worker-events",
        nargs="+",
        choices=["token", "tokens", "link"],
        default=["token", "tokens", "link"],
        help="how the worker sends a step's tokens: token lines, a tokens frame per request, or one "
        "link frame for all requests (each measured)",
    )
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    parser.add_argument("--skip-resume", action="store_true", help="only the throughput rows")
    parser.add_argument("--fleet", type=int, nargs="*", default=[], help="router counts to compare")
    parser.add_argument("--fleet-streams", type=int, default=256, help="streams of the fleet rows")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_router.json")
    parser.add_argument("--serve-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_worker:
        serve_worker(0, args.step_ms / 1e3, args.frame_tokens, args.worker_events[0])
        return
    result = anyio.run(run, args)
    text = table(result)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in result["config"].items()}
    args.out.write_text(json.dumps({**result, "config": config, "table": text}, indent=2))


if __name__ == "__main__":
    main()
