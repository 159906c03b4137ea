"""Router overhead and resume latency, against calling the workers directly, in the same run.

    python benchmarks/bench_router.py [--streams 1 256] [--tokens 200] [--step-ms 30]
        [--frame-tokens 1] [--worker-events token tokens link] [--router-server uvicorn belayer]
        [--clients 2] [--workers 1] [--rounds 1] [--loop auto|asyncio|uvloop] [--no-floor]
        [--client-link [--streams-per-link 0]]

Processes: ``--workers`` paced workers (``--frame-tokens`` tokens per stream every ``--step-ms``,
like a continuously batched engine; ``--step-ms 0``: unpaced), one router per
``--router-server`` (``belayer-router serve --server X``) and ``--clients`` client processes
(`loadgen.ClientPool`: raw HTTP/1.1 with httptools, the streams split between them, results
merged), which ask for ``tokens`` frames.  The worker sends a step's tokens as ``token`` lines (one
per token), one ``tokens`` frame per request, or over the worker link (one binary ``STEP`` frame
per step for all requests); each ``--worker-events`` kind gets fresh workers and routers.  For
each concurrency the same requests are streamed straight from the workers (the "direct" column:
the generator's ceiling when unpaced) and through each router, interleaved (direct, then the
routers in an order rotated every round, ``--rounds`` times).  The "floor" pass (unless
``--no-floor``) streams the same router requests from `loadgen.serve_floor`: a bare process that
writes each stream the router's event bytes, one write per stream per step, paced the same; its
CPU per token is the least one write per token per client connection costs here, the floor under
the router's.  With ``--client-link`` each router of this tree is also measured with link
clients (``SERVER+link`` rows: ``POST /client-link``, each client process's streams on one link,
or ``--streams-per-link`` each), against the floor's client link (``floor+link``, the floor
column of those rows) and the workers' own links read straight by the clients (``direct+link``:
the generator's ceiling on the link path), in the same interleaved rounds; the loss column of a
``+link`` row is still against ``direct`` (a connection per stream to the workers).  Reported:
throughput, inter-token latency, the router's and the floor's CPU time per token (user and system
apart) and per second of the pass, the clients' and workers' CPU per second, the load average.
Then the time from a broken stream to the first resumed token on a ready replacement.  Prints
markdown tables and saves JSON to ``benchmarks/results/bench_router.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
from loadgen import ClientPool, PacedWorker, cpu_split

from belayer_router import RouterClient, RouterFleet, TokenEvent, owner_index, serving
from belayer_router._wire._frames import CLIENT_LINK_PATH  # the benchmark is the package's own
from belayer_router.worker import LINK_PATH

RESULTS = Path(__file__).parent / "results"
LOADGEN = Path(__file__).parent / "loadgen.py"


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


START_TIMEOUT_S = 120.0


def start_process(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server process that prints its URL as the first stdout line (``--json`` or plain).

    One that exits first, or prints nothing within `START_TIMEOUT_S`, is reaped (killed if still
    running) and raises."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
    line = process.stdout.readline().decode() if ready else ""
    if not line:
        if process.poll() is None:
            process.kill()
        code = process.wait(timeout=60)
        why = f"exited with {code}" if ready else f"printed no URL within {START_TIMEOUT_S:g} s (killed)"
        raise RuntimeError(f"{argv[2:4]} {why} before listening (its error is above)")
    return process, json.loads(line)["url"] if line.startswith("{") else line.split()[-1]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every process, wait for each (60 s), kill one that does not end."""
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def server_flag_supported() -> bool:
    """Whether this router's ``serve`` has ``--server`` (older ones serve uvicorn only)."""
    argv = [sys.executable, "-m", "belayer_router._cli", "serve", "--help"]
    return "--server" in subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def router_argv(loop: str, server: str, pass_server: bool) -> list[str]:
    argv = [sys.executable, "-m", "belayer_router._cli", "serve", "--port", "0", "--admin-token", "bench"]
    return [*argv, "--json", "--loop", loop, *(["--server", server] if pass_server else [])]


def floor_argv(args: argparse.Namespace) -> list[str]:
    argv = [sys.executable, str(LOADGEN), "floor", "--step-ms", str(args.step_ms)]
    return [*argv, "--frame-tokens", str(args.frame_tokens)]


def worker_argv(args: argparse.Namespace, events: str) -> list[str]:
    argv = [sys.executable, str(LOADGEN), "worker", "--step-ms", str(args.step_ms)]
    return [*argv, "--frame-tokens", str(args.frame_tokens), "--events", events]


def requests(
    urls: list[str], streams: int, tokens: int, via_router: bool, tag: str = "", path: str = "/generate"
) -> list[tuple[str, dict[str, Any]]]:
    """The run's requests: direct ones round robin over the workers; routed ones to ``urls[0]``, or
    (with ``tag``, several routers) each to the owner of its request id.  ``path``: ``/generate``
    (a connection per request), ``/client-link`` (routed, on links) or ``/link`` (direct, on the
    workers' links)."""
    out = []
    for i in range(streams):
        body: dict[str, Any] = {
            "prompt_token_ids": [1, 2, 3],
            "max_tokens": tokens,
            "seed": i,
            "frames": True,
        }
        request_id = f"{tag}{i}"
        if not via_router:
            body |= {"generated_token_ids": [], "temperature": 1.0, "top_p": 1.0}
            body |= {"stop_token_ids": [], "epoch": 1, "request_id": request_id}
            url = urls[i % len(urls)]
        elif tag:
            body["request_id"] = request_id
            url = urls[owner_index(urls, request_id)]
        else:
            url = urls[0]
        out.append((f"{url}{path}", body))
    return out


async def measure(
    pool: ClientPool,
    work: list[tuple[str, dict[str, Any]]],
    groups: dict[str, list[int]],
    streams_per_link: int = 0,
) -> dict[str, Any]:
    """One pass: stream ``work`` with every client at once; CPU-seconds of each process group."""
    load = os.getloadavg()[0]
    before = {name: _split(pids) for name, pids in groups.items()}
    result = await anyio.to_thread.run_sync(pool.run, work, streams_per_link)
    after = {name: _split(pids) for name, pids in groups.items()}
    user = {name: after[name][0] - before[name][0] for name in groups}
    system = {name: after[name][1] - before[name][1] for name in groups}
    cpu = {name: user[name] + system[name] for name in groups}
    expected = sum(body["max_tokens"] for _, body in work)
    if result["tokens"] != expected:
        raise RuntimeError(f"lost tokens: {result['tokens']} of {expected}")
    return result | {
        "cpu_s": cpu,
        "cpu_user_s": user,
        "cpu_sys_s": system,
        "loadavg_1min": [load, os.getloadavg()[0]],
    }


def _split(pids: list[int]) -> tuple[float, float]:
    """User and system CPU-seconds of ``pids`` together."""
    splits = [cpu_split(pid) for pid in pids]
    return sum(u for u, _ in splits), sum(s for _, s in splits)


def combine(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one configuration: median tokens/s, latency percentiles over all their gaps."""
    gaps = sorted(g for p in passes for g in p["gaps"])
    return {
        "tokens_per_s": statistics.median(p["tokens_per_s"] for p in passes),
        "tokens_per_s_rounds": [round(p["tokens_per_s"], 1) for p in passes],
        "itl_p50_ms": statistics.median(gaps) * 1e3 if gaps else 0.0,
        "itl_p99_ms": gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] * 1e3 if gaps else 0.0,
        "itl_mean_ms": statistics.fmean(gaps) * 1e3 if gaps else 0.0,
        # the ramp: from the pass's start to a stream's first token (median / the last stream's)
        "first_token_p50_ms_rounds": [round(p["first_token_p50_ms"], 1) for p in passes],
        "first_token_max_ms_rounds": [round(p["first_token_max_ms"], 1) for p in passes],
        "wall_s": sum(p["wall_s"] for p in passes),
        "tokens": sum(p["tokens"] for p in passes),
        "cpu_s": {k: sum(p["cpu_s"][k] for p in passes) for k in passes[0]["cpu_s"]},
        "cpu_user_s": {k: sum(p["cpu_user_s"][k] for p in passes) for k in passes[0]["cpu_s"]},
        "cpu_sys_s": {k: sum(p["cpu_sys_s"][k] for p in passes) for k in passes[0]["cpu_s"]},
        "loadavg_1min": [
            min(p["loadavg_1min"][0] for p in passes),
            max(p["loadavg_1min"][1] for p in passes),
        ],
    }


def _per_token_us(result: dict[str, Any], key: str) -> float:
    return float(result[key]["router"] / result["tokens"] * 1e6)


def row(
    events: str,
    server: str,
    streams: int,
    direct: dict[str, Any],
    routed: dict[str, Any],
    floor: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One table row; ``floor``: the floor process's passes (its CPU under the "router" key)."""
    cpu, wall, tokens = routed["cpu_s"], routed["wall_s"], routed["tokens"]
    floor_fields: dict[str, Any] = {}
    if floor is not None:
        floor_fields = {
            "floor": floor,
            "floor_cpu_us_per_token": _per_token_us(floor, "cpu_s"),
            "floor_user_us_per_token": _per_token_us(floor, "cpu_user_s"),
            "floor_sys_us_per_token": _per_token_us(floor, "cpu_sys_s"),
            "floor_cpu_s_per_s": floor["cpu_s"]["router"] / floor["wall_s"],
        }
    return {
        "worker_events": events,
        "server": server,
        "streams": streams,
        "direct": direct,
        "router": routed,
        "router_cpu_us_per_token": cpu["router"] / tokens * 1e6,
        "router_user_us_per_token": _per_token_us(routed, "cpu_user_s"),
        "router_sys_us_per_token": _per_token_us(routed, "cpu_sys_s"),
        "router_cpu_s_per_s": cpu["router"] / wall,
        "router_tokens_per_cpu_s": tokens / cpu["router"] if cpu["router"] else None,
        "clients_cpu_s_per_s": cpu["clients"] / wall,
        "workers_cpu_s_per_s": cpu["workers"] / wall,
        "direct_clients_cpu_s_per_s": direct["cpu_s"]["clients"] / direct["wall_s"],
        "direct_workers_cpu_s_per_s": direct["cpu_s"]["workers"] / direct["wall_s"],
        **floor_fields,
    }


async def fleet_rows(
    args: argparse.Namespace, pool: ClientPool, worker_urls: list[str], worker_pids: list[int]
) -> list[dict[str, Any]]:
    """Tokens/s through 1..N router processes (requests spread by owner hash), against direct."""
    rows = []
    groups = {"workers": worker_pids, "clients": pool.pids()}
    direct_work = requests(worker_urls, args.fleet_streams, args.tokens, via_router=False)
    direct = await measure(pool, direct_work, {**groups, "router": []})
    print({"generator_ceiling": direct["tokens_per_s"]}, file=sys.stderr, flush=True)
    server = args.router_server[0]
    for count in args.fleet:
        started = [start_process(router_argv(args.loop, server, args.pass_server)) for _ in range(count)]
        try:
            urls = [url for _, url in started]
            async with RouterFleet(urls, admin_token="bench") as fleet:
                for w, url in enumerate(worker_urls):
                    await fleet.register(f"bench-{w}", url, 1, link=args.worker_events[0] == "link")
            work = requests(urls, args.fleet_streams, args.tokens, via_router=True, tag=f"f{count}-")
            routed = await measure(pool, work, {**groups, "router": [p.pid for p, _ in started]})
        finally:
            stop([p for p, _ in started])
        rows.append(
            {
                "routers": count,
                "server": server,
                "direct_tokens_per_s": direct["tokens_per_s"],
                "router": {k: v for k, v in routed.items() if k != "gaps"},
                "router_cpu_us_per_token": routed["cpu_s"]["router"] / routed["tokens"] * 1e6,
                "router_cpu_s_per_s": routed["cpu_s"]["router"] / routed["wall_s"],
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


async def throughput_rows(
    args: argparse.Namespace,
    events: str,
    pool: ClientPool,
    workers: list[tuple[Any, str]],
    routers: list[tuple[Any, str]],
    floor: tuple[Any, str] | None = None,
) -> list[dict[str, Any]]:
    """Per concurrency: direct, every router and the floor, interleaved ``--rounds`` times.

    With ``--client-link`` also every router of this tree with link clients (``SERVER+link``), the
    floor's client link (``floor+link``) and the workers' own links read by the clients
    (``direct+link``: the generator's ceiling on the link path)."""
    rows = []
    worker_urls = [url for _, url in workers]
    base = {"workers": [p.pid for p, _ in workers], "clients": pool.pids()}
    paired = zip(args.router_names, routers, strict=True)
    named = [(name, process, url, "/generate") for name, (process, url) in paired]
    if args.client_link:  # only this tree's routers: a --baseline-src router has no client link
        own = zip(args.router_server, routers, strict=False)
        named += [(f"{name}+link", process, url, CLIENT_LINK_PATH) for name, (process, url) in own]
    if floor is not None:
        named.append(("floor", floor[0], floor[1], "/generate"))
        if args.client_link:
            named.append(("floor+link", floor[0], floor[1], CLIENT_LINK_PATH))
    per_link = args.streams_per_link
    for streams in args.streams:
        passes: dict[str, list[dict[str, Any]]] = {"direct": []}
        for r in range(args.rounds):
            order = named[r % len(named) :] + named[: r % len(named)]
            work = requests(worker_urls, streams, args.tokens, via_router=False)
            passes["direct"].append(await measure(pool, work, {**base, "router": []}))
            if args.client_link:
                work = requests(worker_urls, streams, args.tokens, via_router=False, path=LINK_PATH)
                result = await measure(pool, work, {**base, "router": []}, per_link)
                passes.setdefault("direct+link", []).append(result)
                print(
                    f"{events} direct+link {streams} streams round {r}: {result['tokens_per_s']:.0f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
            for name, process, url, path in order:
                work = requests([url], streams, args.tokens, via_router=True, path=path)
                result = await measure(pool, work, {**base, "router": [process.pid]}, per_link)
                passes.setdefault(name, []).append(result)
                print(
                    f"{events} {name} {streams} streams round {r}: "
                    f"direct {passes['direct'][-1]['tokens_per_s']:.0f} tok/s, {name} "
                    f"{result['tokens_per_s']:.0f} tok/s, first token p50/max "
                    f"{result['first_token_p50_ms']:.0f}/{result['first_token_max_ms']:.0f} ms, ITL mean "
                    f"{result['itl_mean_ms']:.1f} ms, {result['cpu_s']['router']:.2f} CPU-s "
                    f"({result['cpu_user_s']['router']:.2f} user, {result['cpu_sys_s']['router']:.2f} sys)",
                    file=sys.stderr,
                    flush=True,
                )
        direct = combine(passes["direct"])
        floors = {name: combine(passes[name]) for name in ("floor", "floor+link") if name in passes}
        for name in args.row_names:
            linked = name.endswith("+link")
            routed = row(
                events, name, streams, direct, combine(passes[name]), floors.get(f"floor{'+link' * linked}")
            )
            if linked:
                routed["direct_link"] = combine(passes["direct+link"])
            rows.append(routed)
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    fleet: list[dict[str, Any]] = []
    resume: dict[str, list[float]] = {}
    pool = ClientPool(args.clients)
    floor = None
    try:
        floor = None if args.no_floor else start_process(floor_argv(args))
        for number, events in enumerate(args.worker_events):
            first = number == 0  # the fleet and resume rows run once, with the first kind of events
            workers: list[tuple[subprocess.Popen[bytes], str]] = []
            routers: list[tuple[subprocess.Popen[bytes], str]] = []
            try:  # whatever started is stopped, also when a later one fails to start
                for _ in range(args.workers):
                    workers.append(start_process(worker_argv(args, events)))
                for s in args.router_server:
                    routers.append(start_process(router_argv(args.loop, s, args.pass_server)))
                if args.baseline_src is not None:  # the same servers, from another source tree
                    env = {**os.environ, "PYTHONPATH": str(args.baseline_src)}
                    for s in args.router_server:
                        routers.append(start_process(router_argv(args.loop, s, args.pass_server), env))
                for _, router_url in routers:
                    async with RouterClient(router_url, admin_token="bench") as client:
                        for w, (_, url) in enumerate(workers):
                            await client.register(f"bench-{w}", url, 1, link=events == "link")
                rows += await throughput_rows(args, events, pool, workers, routers, floor)
                if first and args.fleet:
                    fleet = await fleet_rows(args, pool, [u for _, u in workers], [p.pid for p, _ in workers])
                if first and not args.skip_resume:
                    router_url = routers[0][1]
                    async with RouterClient(router_url, admin_token="bench") as client:
                        for w in range(len(workers)):
                            await client.mark_unhealthy(f"bench-{w}")  # resume requests go to their slots
                    step = args.step_ms / 1e3
                    resume = {
                        "break_then_register": await resume_latency(
                            router_url, step, args.trials, hang=False
                        ),
                        "register_retires_hung_worker": await resume_latency(
                            router_url, step, args.trials, hang=True
                        ),
                    }
            finally:
                stop([p for p, _ in workers + routers])
    finally:
        if floor is not None:
            stop([floor[0]])
        pool.close()
    return {
        "config": vars(args),
        "cpus": os.cpu_count(),
        "loadavg_1min_at_end": os.getloadavg()[0],
        "throughput": rows,
        "fleet": fleet,
        "resume_ms": resume,
    }


def _throughput_table(rows: list[dict[str, Any]]) -> list[str]:
    floor = any("floor" in row for row in rows)
    lines = [
        "| streams | direct tok/s | router tok/s | throughput loss | ITL p50 direct / router (ms) | ITL p99 direct / router (ms) | "
        + ("floor CPU per token (us) | " if floor else "")
        + "router CPU per token (us) |",
        "|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if floor else ""),
    ]
    for row in rows:
        d, r = row["direct"], row["router"]
        loss = 100 * (1 - r["tokens_per_s"] / d["tokens_per_s"])
        floor_cell = (
            f"{row['floor_cpu_us_per_token']:.1f} | " if "floor" in row else ("- | " if floor else "")
        )
        lines.append(
            f"| {row['streams']} | {d['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {loss:.1f}% | "
            f"{d['itl_p50_ms']:.1f} / {r['itl_p50_ms']:.1f} | {d['itl_p99_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
            f"{floor_cell}{row['router_cpu_us_per_token']:.1f} |"
        )
    return lines


def _split_table(rows: list[dict[str, Any]]) -> list[str]:
    """CPU per token, user and system apart: the floor's and the router's, and the router above it."""
    lines = [
        "| events | server | streams | floor tok/s | floor CPU per token user / sys (us) | router CPU per token user / sys (us) | router above the floor (us) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "floor" not in row:
            continue
        above = row["router_cpu_us_per_token"] - row["floor_cpu_us_per_token"]
        lines.append(
            f"| {row['worker_events']} | {row['server']} | {row['streams']} | "
            f"{row['floor']['tokens_per_s']:.0f} | "
            f"{row['floor_user_us_per_token']:.1f} / {row['floor_sys_us_per_token']:.1f} | "
            f"{row['router_user_us_per_token']:.1f} / {row['router_sys_us_per_token']:.1f} | {above:.1f} |"
        )
    return lines if len(lines) > 2 else []


def _cpu_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| events | server | streams | router tok/s | router CPU-s per s | router tok per CPU-s | clients CPU-s per s (direct / router) | workers CPU-s per s (direct / router) | load avg |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        per_cpu = row["router_tokens_per_cpu_s"]
        load = row["router"]["loadavg_1min"]
        lines.append(
            f"| {row['worker_events']} | {row['server']} | {row['streams']} | {row['router']['tokens_per_s']:.0f} | "
            f"{row['router_cpu_s_per_s']:.2f} | {'-' if per_cpu is None else f'{per_cpu:.0f}'} | "
            f"{row['direct_clients_cpu_s_per_s']:.2f} / {row['clients_cpu_s_per_s']:.2f} | "
            f"{row['direct_workers_cpu_s_per_s']:.2f} / {row['workers_cpu_s_per_s']:.2f} | "
            f"{load[0]:.1f}-{load[1]:.1f} |"
        )
    return lines


def _link_ceiling_table(rows: list[dict[str, Any]]) -> list[str]:
    """The link rows against the generator's ceilings: the workers' links read straight by the
    clients (``direct+link``) and the floor's client link, with the clients' CPU."""
    lines = [
        "| events | server | streams | direct tok/s | direct+link tok/s | floor+link tok/s | router+link tok/s | loss vs direct+link | ITL p99 direct+link / router+link (ms) | clients CPU-s per s (direct+link / router+link) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "direct_link" not in row:
            continue
        d, dl, r = row["direct"], row["direct_link"], row["router"]
        floor = f"{row['floor']['tokens_per_s']:.0f}" if "floor" in row else "-"
        clients = dl["cpu_s"]["clients"] / dl["wall_s"]
        lines.append(
            f"| {row['worker_events']} | {row['server']} | {row['streams']} | {d['tokens_per_s']:.0f} | "
            f"{dl['tokens_per_s']:.0f} | {floor} | {r['tokens_per_s']:.0f} | "
            f"{100 * (1 - r['tokens_per_s'] / dl['tokens_per_s']):.1f}% | "
            f"{dl['itl_p99_ms']:.1f} / {r['itl_p99_ms']:.1f} | {clients:.2f} / {row['clients_cpu_s_per_s']:.2f} |"
        )
    return lines if len(lines) > 2 else []


def _ramp_table(rows: list[dict[str, Any]]) -> list[str]:
    """The start of a pass (every stream asks at once) and the mean gap: where throughput goes."""
    lines = [
        "| events | server | streams | last stream's first token direct / floor / router (ms) | ITL mean direct / floor / router (ms) |",
        "|---|---|---:|---:|---:|",
    ]

    def cells(key: str, pick: Any) -> str:
        results = [row["direct"], row.get("floor"), row["router"]]
        return " / ".join("-" if r is None or key not in r else f"{pick(r[key]):.1f}" for r in results)

    for row in rows:
        if "first_token_max_ms_rounds" not in row["router"]:
            continue
        lines.append(
            f"| {row['worker_events']} | {row['server']} | {row['streams']} | "
            f"{cells('first_token_max_ms_rounds', statistics.median)} | {cells('itl_mean_ms', float)} |"
        )
    return lines if len(lines) > 2 else []


def table(result: dict[str, Any]) -> str:
    config = result["config"]
    lines: list[str] = []
    for events in config["worker_events"]:
        kind = {
            "token": "one `token` line per token",
            "tokens": "one `tokens` frame per request per step",
            "link": "the link: one binary `STEP` frame per step for all requests",
        }[events]
        for server in config.get("row_names", config["router_names"]):
            lines += [
                f"Worker events: {kind}, {config['frame_tokens']} token(s) per stream per step; "
                f"router server: {server}",
                "",
            ]
            lines += _throughput_table(
                [r for r in result["throughput"] if r["worker_events"] == events and r["server"] == server]
            )
            lines.append("")
    lines += _cpu_table(result["throughput"])
    ceiling = _link_ceiling_table(result["throughput"])
    if ceiling:
        lines += ["", *ceiling]
    split = _split_table(result["throughput"])
    if split:
        lines += ["", *split]
    ramp = _ramp_table(result["throughput"])
    if ramp:
        lines += ["", *ramp]
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


def router_source() -> str:
    """Where the measured router came from: its module folder and that tree's commit (dirty or not)."""
    import belayer_router

    folder = Path(belayer_router.__file__).parent
    git = ["git", "-C", str(folder)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return f"{folder} (not in a git checkout)"
    dirty = subprocess.run([*git, "status", "--porcelain", "--", "."], capture_output=True, text=True)
    return f"{folder} at {head.stdout.strip()}{' + uncommitted changes' if dirty.stdout.strip() else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 256])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--step-ms", type=float, default=30.0, help="0: unpaced (the generator's ceiling)")
    parser.add_argument("--trials", type=int, default=10, help="resume trials")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved passes per throughput row")
    parser.add_argument("--frame-tokens", type=int, default=1, help="tokens per stream per worker step")
    parser.add_argument(
        "--worker-events",
        nargs="+",
        choices=["token", "tokens", "link"],
        default=["token", "tokens", "link"],
        help="how the worker sends a step's tokens: token lines, a tokens frame per request, or one "
        "link frame for all requests (each measured)",
    )
    parser.add_argument(
        "--router-server",
        nargs="+",
        default=["uvicorn"],
        help="HTTP servers of the router (`belayer-router serve --server X`), each measured",
    )
    parser.add_argument("--clients", type=int, default=2, help="client processes sharing the streams")
    parser.add_argument("--workers", type=int, default=1, help="paced worker processes (one slot each)")
    parser.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    parser.add_argument("--skip-resume", action="store_true", help="only the throughput rows")
    parser.add_argument(
        "--no-floor", action="store_true", help="skip the floor pass (the bare fan-out process)"
    )
    parser.add_argument("--fleet", type=int, nargs="*", default=[], help="router counts to compare")
    parser.add_argument("--fleet-streams", type=int, default=256, help="streams of the fleet rows")
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="also run each --router-server from this source folder (e.g. an older commit's src via "
        "git archive), as SERVER@baseline, interleaved with the rest",
    )
    parser.add_argument(
        "--client-link",
        action="store_true",
        help="also measure each router with link clients (POST /client-link: many streams per "
        "connection) as SERVER+link, the floor's client link and the workers' own links (direct+link)",
    )
    parser.add_argument(
        "--streams-per-link",
        type=int,
        default=0,
        help="streams per client link (0: each client process's whole share on one link)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_router.json")
    args = parser.parse_args()
    if len(set(args.router_server)) != len(args.router_server):
        parser.error("--router-server: name each server once")
    if min(args.clients, args.workers, args.rounds, args.frame_tokens) < 1:
        parser.error("--clients, --workers, --rounds and --frame-tokens must be at least 1")
    # Older routers have no --server: they serve uvicorn, so a uvicorn-only run needs no flag.
    args.pass_server = server_flag_supported()
    if not args.pass_server and args.router_server != ["uvicorn"]:
        parser.error("this belayer-router has no `serve --server`: only --router-server uvicorn works")
    args.router_names = list(args.router_server)
    if args.baseline_src is not None:
        args.router_names += [f"{s}@baseline" for s in args.router_server]
    if args.streams_per_link < 0:
        parser.error("--streams-per-link must be 0 (one link per client process) or more")
    args.row_names = list(args.router_names)
    if args.client_link:
        args.row_names += [f"{s}+link" for s in args.router_server]
    began = time.time()
    result = anyio.run(run, args)
    result["started_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began))
    result["command"] = "python benchmarks/bench_router.py " + " ".join(sys.argv[1:])
    result["router_src"] = router_source()
    text = table(result)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in result["config"].items()}
    args.out.write_text(json.dumps({**result, "config": config, "table": text}, indent=2))


if __name__ == "__main__":
    main()
