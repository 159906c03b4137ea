"""Checkpoint and restore time per kind, against the full (CRIU) checkpoint in the same run.

1. Per kind, on one sandbox whose only process is the keep-alive init (belayer/busybox) with a
   writable layer of about 10 and 200 MB: `full_checkpoint` (layer + CRIU, frozen), `checkpoint`
   after a one-byte change (`fresh-runtime`: the layer, no CRIU, no freeze) and `checkpoint` again
   with no change (`reference`: hard links to the previous one's artifacts).  For each: how long the
   sandbox's actions were held (`hold`: the freeze window for full), the wall time of the call
   (manifest, fsync and rename included), and `full_restore` of it into a new container.
2. A SWE-like trace (belayer/debian-python: clone-like setup, reads, edits, test runs, a status
   check) replayed twice, a checkpoint after every action: once with `full_checkpoint`, once with
   `checkpoint` (which picks the kind); the checkpoints' total wall time and the kinds taken.

Medians of ``--reps`` repetitions; the load average before and after is saved with the numbers.

    python benchmarks/bench_kinds.py [--reps 5] [--layers 10,200] [--out benchmarks/results/bench_kinds.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from belayer_envckpt import (
    Checkpoint,
    CheckpointStore,
    Engine,
    Sandbox,
    SandboxConfig,
    SparePool,
    checkpoint,
    full_checkpoint,
    full_restore,
)

LABEL = {"belayer.bench": "1"}
# An agent fixing a bug: mostly reads and test runs, some edits.
SWE_TRACE = [
    "mkdir -p /repo/pkg /repo/tests && cd /repo && printf 'def add(a, b):\\n    return a - b\\n' > pkg/calc.py",
    "cd /repo && printf 'from pkg.calc import add\\nassert add(2, 3) == 5\\n' > tests/test_calc.py && touch pkg/__init__.py",
    "cd /repo && ls -R",
    "cd /repo && cat pkg/calc.py",
    "cd /repo && grep -rn 'def add' .",
    "cd /repo && python3 -m tests.test_calc; true",
    "cd /repo && cat tests/test_calc.py",
    "cd /repo && sed -i 's/a - b/a + b/' pkg/calc.py",
    "cd /repo && cat pkg/calc.py",
    "cd /repo && python3 -m tests.test_calc",
    "cd /repo && grep -rn 'return' pkg",
    "cd /repo && wc -l pkg/calc.py tests/test_calc.py",
    "cd /repo && printf 'assert add(-1, 1) == 0\\n' >> tests/test_calc.py",
    "cd /repo && python3 -m tests.test_calc",
    "cd /repo && ls -la pkg",
    "cd /repo && python3 -c 'import pkg.calc; print(pkg.calc.add(1, 2))'",
    "cd /repo && head -n 1 pkg/calc.py",
    "cd /repo && python3 -m tests.test_calc && echo ok",
]


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def _timed(take: Callable[[], Checkpoint]) -> tuple[Checkpoint, float]:
    start = time.perf_counter()
    ckpt = take()
    return ckpt, _ms(start)


def _restore_ms(engine: Engine, ckpt: Checkpoint, spares: SparePool | None = None) -> float:
    if spares is not None:  # a spare ready, and no refill running: as between two rare restores
        spares.warm(SandboxConfig.from_dict(ckpt.config), ckpt.trajectory)
    start = time.perf_counter()
    restored = full_restore(ckpt, engine=engine, remove_failed=False, spares=spares)
    took = _ms(start)
    assert ("spare_ms" in restored.restore_timings_ms) == (spares is not None), restored.restore_timings_ms
    restored.remove()
    if spares is not None:
        spares.wait_idle()
    return took


def measure_kinds(
    engine: Engine, layer_mb: int, reps: int, store: CheckpointStore, spares: SparePool
) -> dict[str, object]:
    config = SandboxConfig(image="belayer/busybox:latest", labels=LABEL)
    sandbox = Sandbox.create(engine, config, trajectory="bench")
    samples: dict[str, list[float]] = collections.defaultdict(list)
    try:
        sandbox.exec(f"mkdir -p /work && head -c {layer_mb * 1024 * 1024} /dev/urandom > /work/blob", 300)
        for rep in range(reps):
            sandbox.exec(f"echo {rep} > /work/rep")
            runs = {
                "full": _timed(lambda: full_checkpoint(sandbox, "bench", store=store)),
                "fresh-runtime": _timed(lambda: checkpoint(sandbox, "bench", store=store)),
                "reference": _timed(lambda: checkpoint(sandbox, "bench", store=store)),
            }
            for kind, (ckpt, wall_ms) in runs.items():
                assert ckpt.kind == kind, (kind, ckpt.kind)
                hold = ckpt.timings_ms["freeze_ms"] if kind == "full" else ckpt.timings_ms["hold_ms"]
                samples[f"{kind}_hold_ms"].append(hold)
                samples[f"{kind}_checkpoint_ms"].append(wall_ms)
                samples[f"{kind}_restore_ms"].append(_restore_ms(engine, ckpt))
                if kind != "full":  # the same checkpoint through a started spare (`SparePool`)
                    samples[f"{kind}_restore_spare_ms"].append(_restore_ms(engine, ckpt, spares))
                samples[f"{kind}_mb"].append(ckpt.total_bytes / 1e6)
            store.gc("bench")
    finally:
        sandbox.remove()
    return {"layer_mb": layer_mb, "reps": reps} | {k: statistics.median(v) for k, v in samples.items()}


def replay_trace(engine: Engine, use_kinds: bool, store: CheckpointStore) -> dict[str, object]:
    config = SandboxConfig(image="belayer/debian-python:latest", labels=LABEL)
    sandbox = Sandbox.create(engine, config, trajectory="swe")
    kinds: collections.Counter[str] = collections.Counter()
    total_ms = hold_ms = 0.0
    try:
        for action in SWE_TRACE:
            sandbox.exec(action, 120)
            take = checkpoint if use_kinds else full_checkpoint
            ckpt, wall_ms = _timed(lambda take=take: take(sandbox, "swe", store=store))  # type: ignore[misc]
            kinds[ckpt.kind] += 1
            total_ms += wall_ms
            hold_ms += ckpt.timings_ms["freeze_ms"] if ckpt.kind == "full" else ckpt.timings_ms["hold_ms"]
        latest = store.latest_ready("swe")
        assert latest is not None
        restored = full_restore(latest, engine=engine, remove_failed=False)
        # The restored sandbox answers as the original does.  Not simply "ok": when the edit of
        # pkg/calc.py lands in the same second as its first compilation (same size), Python keeps
        # the stale bytecode in the original sandbox as well.
        check = "cd /repo && python3 -m tests.test_calc && echo ok; cat pkg/calc.py"
        assert restored.probe(check).stdout == sandbox.probe(check).stdout
        restored.remove()
    finally:
        sandbox.remove()
        store.gc("swe")
    return {"kinds": dict(kinds), "checkpoint_total_ms": total_ms, "hold_total_ms": hold_ms}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", default="10,200", help="writable-layer sizes in MB")
    parser.add_argument("--trace-reps", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_kinds.json"))
    args = parser.parse_args()
    engine = Engine.connect()
    engine.require_checkpoint_support()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as tmp:
        store = CheckpointStore(tmp)
        rows = []
        with SparePool(engine) as spares:
            for layer_mb in [int(x) for x in args.layers.split(",")]:
                rows.append(measure_kinds(engine, layer_mb, args.reps, store, spares))
                print(json.dumps(rows[-1]), flush=True)
        traces = {"full": [], "kinds": []}  # type: dict[str, list[dict[str, object]]]
        for _ in range(args.trace_reps):  # interleaved, so load drifts hit both alike
            traces["full"].append(replay_trace(engine, False, store))
            traces["kinds"].append(replay_trace(engine, True, store))
        trace = {
            name: {
                "kinds": runs[0]["kinds"],
                "checkpoint_total_ms": statistics.median(float(r["checkpoint_total_ms"]) for r in runs),  # type: ignore[arg-type]
                "hold_total_ms": statistics.median(float(r["hold_total_ms"]) for r in runs),  # type: ignore[arg-type]
            }
            for name, runs in traces.items()
        }
        print(json.dumps(trace), flush=True)
    result = {
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "kinds": rows,
        "swe_trace": {"actions": len(SWE_TRACE), "reps": args.trace_reps} | trace,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print()
    print(table(result))


def table(result: dict[str, object]) -> str:
    """The README's tables."""
    lines = [
        "| layer MB | kind | held (freeze for full) ms | checkpoint ms | restore ms | restore into a spare ms "
        "| stored MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["kinds"]:  # type: ignore[attr-defined]
        for kind in ("full", "fresh-runtime", "reference"):
            spare = f"{row[f'{kind}_restore_spare_ms']:.0f}" if f"{kind}_restore_spare_ms" in row else "-"
            lines.append(
                f"| {row['layer_mb']} | {kind} | {row[f'{kind}_hold_ms']:.1f} | {row[f'{kind}_checkpoint_ms']:.1f} "
                f"| {row[f'{kind}_restore_ms']:.0f} | {spare} | {row[f'{kind}_mb']:.1f} |"
            )
    trace = result["swe_trace"]
    lines += [
        "",
        f"| SWE-like trace, {trace['actions']} actions, a checkpoint after each | kinds taken | checkpoints' "  # type: ignore[index]
        "total ms | held ms |",
        "|---|---|---|---|",
    ]
    for name, label in (("full", "`full_checkpoint` every time"), ("kinds", "`checkpoint` (kinds)")):
        t = trace[name]  # type: ignore[index]
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(t["kinds"].items()))
        lines.append(f"| {label} | {kinds} | {t['checkpoint_total_ms']:.0f} | {t['hold_total_ms']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
