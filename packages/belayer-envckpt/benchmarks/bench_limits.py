"""What the limit watch costs per action, against the same action without it (same run, same sandbox).

For writable layers of 0, 1,000 and 10,000 files it measures, over ``--reps`` actions each:
- the latency of a trivial action (``true``): bare exec (no watch, as before limits existed), the
  watch with only the cgroup counters (``disk_mb=0``), and the full watch (counters + disk poll);
- the host CPU the caller's process spends during a 1 s action (``sleep 1``): that is the disk
  poll walking the layer every ``disk_poll_s``;
- one walk of the layer (`layer_size_bytes`).

    python benchmarks/bench_limits.py --reps 20   # writes benchmarks/results/bench_limits.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import attrs

from belayer_envckpt import Engine, Sandbox, SandboxConfig, SandboxLimits
from belayer_envckpt._limit_guard import layer_size_bytes

RESULTS = Path(__file__).parent / "results" / "bench_limits.json"


def _ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000.0, 2)


def _latency(sandbox: Sandbox, reps: int, *, bare: bool) -> list[float]:
    samples = []
    for _ in range(reps):
        started = time.perf_counter()
        if bare:
            sandbox._run("true", 60.0, None)  # the exec itself, no watch
        else:
            sandbox.exec("true")
        samples.append(time.perf_counter() - started)
    return samples


def _cpu_during(sandbox: Sandbox, reps: int, *, bare: bool) -> list[float]:
    samples = []
    for _ in range(max(3, reps // 5)):
        started = time.process_time()
        if bare:
            sandbox._run("sleep 1", 60.0, None)
        else:
            sandbox.exec("sleep 1")
        samples.append(time.process_time() - started)
    return samples


def measure(engine: Engine, num_files: int, reps: int) -> dict[str, Any]:
    """One row: a BusyBox sandbox whose layer holds ``num_files`` small files."""
    limits = SandboxLimits()
    sandbox = Sandbox.create(engine, SandboxConfig(image="belayer/busybox:latest", limits=limits))
    try:
        if num_files:
            sandbox.exec(f"mkdir -p /data && cd /data && seq {num_files} | xargs touch", timeout_s=600)
        upper = engine.upper_dir(sandbox._container)
        walks = []
        for _ in range(reps):
            started = time.perf_counter()
            layer_size_bytes(upper)
            walks.append(time.perf_counter() - started)
        full = sandbox.config
        counters_only = attrs.evolve(full, limits=attrs.evolve(limits, disk_mb=0))
        row: dict[str, Any] = {"files": num_files, "layer_walk_ms": _ms(walks)}
        row["bare_ms"] = _ms(_latency(sandbox, reps, bare=True))
        sandbox.config = counters_only
        row["counters_ms"] = _ms(_latency(sandbox, reps, bare=False))
        sandbox.config = full
        row["full_watch_ms"] = _ms(_latency(sandbox, reps, bare=False))
        row["cpu_per_1s_action_bare_ms"] = _ms(_cpu_during(sandbox, reps, bare=True))
        row["cpu_per_1s_action_watch_ms"] = _ms(_cpu_during(sandbox, reps, bare=False))
        return row
    finally:
        sandbox.remove()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--files", type=int, nargs="*", default=[0, 1000, 10000])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with Engine.connect() as engine:
        rows = [measure(engine, n, args.reps) for n in args.files]
    load = [round(load_before, 1), round(os.getloadavg()[0], 1)]
    header = list(rows[0])
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(row[k]) for k in header))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"reps": args.reps, "load_average_1min_start_end": load, "rows": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
