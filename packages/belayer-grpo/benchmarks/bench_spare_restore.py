"""A sandbox failure's restore in the agentic pool, with and without the run's spare containers.

The path of the main job (`belayer-grpo train`'s default tool-use workload): a `SandboxPool`
lease of its build image (``belayer/busybox`` with ``/bin/mk``) in its working directory, an action, `SandboxPool.take_checkpoint` (``fresh-runtime``:
only the stateless init runs), the sandbox killed (what sandbox chaos does), then the timed
`SandboxPool.restore` of the checkpoint, as the agent loop calls it.  Two pools on the same engine,
``spares=0`` (a new container created, the layer installed, started) and ``spares=1`` (the
checkpoint's layer written into the run's started spare), interleaved rep by rep; before each
restore into a spare the pool's refill is waited for (in a run it happens in the background
between failures).  Two states: the tool-use task's (a value in a file) and a 10 MB layer.
Medians and 90th percentiles of ``--reps``; the load average before and after is saved.

With ``--cluster isolated`` (or ``local``) the same path on a cluster run's pool: a
`ClusterSandboxPool` whose sandboxes live on the sandbox host of one Ray node (an
`IsolatedRayCluster` node with root, else a `LocalRayCluster` one), ``spares=0`` against
``spares=1`` (the node's own spare, `SandboxCluster.keep_spares`), two `SandboxCluster`s on the
same node, interleaved the same way; the times include the call to the node's host.

    python benchmarks/bench_spare_restore.py [--reps 9] [--out benchmarks/results/bench_spare_restore.json]
    python benchmarks/bench_spare_restore.py --cluster isolated [--out benchmarks/results/bench_spare_restore_cluster.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio

from belayer_envckpt import CheckpointStore, Engine
from belayer_grpo._agentic import SandboxPool
from belayer_grpo._agentic.tooluse import TOOLUSE_WORKDIR, ensure_build_image

RESULTS = Path(__file__).parent / "results" / "bench_spare_restore.json"
CLUSTER_RESULTS = Path(__file__).parent / "results" / "bench_spare_restore_cluster.json"
WORKDIR = TOOLUSE_WORKDIR
STATES = {
    "tool-use task (a value in a file)": "echo 417 > a",
    "10 MB layer": "dd if=/dev/urandom of=blob bs=1M count=10 2>/dev/null",
}


async def one_restore(pool: SandboxPool, image: str, name: str, action: str) -> dict[str, Any]:
    """Lease, act, checkpoint, kill, restore (timed); the lease cleans up."""
    async with pool.lease(name, image, WORKDIR) as lease:
        sandbox = lease.sandbox
        assert (await anyio.to_thread.run_sync(lambda: sandbox.exec(action))).ok
        record = await anyio.to_thread.run_sync(
            lambda: pool.take_checkpoint(
                sandbox, trajectory=name, prefix=1, turn=1, workdir=WORKDIR, context_hash="bench"
            )
        )
        assert record.checkpoint is not None
        assert record.kind == "fresh-runtime", record.kind
        await anyio.to_thread.run_sync(sandbox.kill)
        if pool.spares:
            await pool.warm_spares(image, WORKDIR)
        checkpoint = record.checkpoint
        started = time.perf_counter()
        restored = await anyio.to_thread.run_sync(lambda: pool.restore(checkpoint, sandbox))
        wall_ms = (time.perf_counter() - started) * 1000.0
        await lease.replace(restored)
        assert restored.probe(f"ls {WORKDIR}").exit_code == 0
        return {"wall_ms": wall_ms, **restored.restore_timings_ms}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    walls = sorted(r["wall_ms"] for r in rows)
    return {
        "median_ms": round(statistics.median(walls), 1),
        "p90_ms": round(walls[min(len(walls) - 1, int(0.9 * len(walls)))], 1),
        "into_spare": sum("spare_ms" in r for r in rows),
        "reps": len(rows),
    }


@contextmanager
def cluster_pools(
    kind: str, engine: Engine, root: Path, labels: dict[str, str]
) -> Iterator[dict[int, SandboxPool]]:
    """Two `ClusterSandboxPool`s (spares 0 and 1) on one Ray node's sandbox hosts."""
    from belayer_cluster import IsolatedRayCluster, LocalClusterConfig, LocalRayCluster, SandboxCluster
    from belayer_grpo._agentic.cluster_pool import ClusterSandboxPool

    config = LocalClusterConfig(num_nodes=1)
    ray_cluster: Any = (
        IsolatedRayCluster(config, shared_dir=root / "shared")
        if kind == "isolated"
        else LocalRayCluster(config)
    )
    with ray_cluster:
        hosts = {spares: SandboxCluster(root / "shared" / f"s{spares}") for spares in (0, 1)}
        try:
            for cluster in hosts.values():
                cluster.start()
            yield {
                spares: ClusterSandboxPool(
                    engine,
                    CheckpointStore(hosts[spares].store_dir),
                    capacity=1,
                    labels=labels,
                    spares=spares,
                    hosts=hosts[spares],
                )
                for spares in (0, 1)
            }
        finally:
            for cluster in hosts.values():
                cluster.stop()


@contextmanager
def local_pools(engine: Engine, root: Path, labels: dict[str, str]) -> Iterator[dict[int, SandboxPool]]:
    """Two `SandboxPool`s (spares 0 and 1) on this machine's engine."""
    yield {
        spares: SandboxPool(
            engine, CheckpointStore(root / f"s{spares}"), capacity=1, labels=labels, spares=spares
        )
        for spares in (0, 1)
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine.connect()
    engine.require_checkpoint_support()
    image = ensure_build_image(engine)
    load_before = os.getloadavg()
    results: dict[str, Any] = {}
    labels = {"belayer.bench": "spare-restore"}
    with (
        tempfile.TemporaryDirectory() as root,
        (
            cluster_pools(args.cluster, engine, Path(root), labels)
            if args.cluster
            else local_pools(engine, Path(root), labels)
        ) as pools,
    ):
        try:
            for state, action in STATES.items():
                rows: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
                for rep in range(args.reps):
                    order = (0, 1) if rep % 2 == 0 else (1, 0)
                    for spares in order:
                        rows[spares].append(
                            await one_restore(pools[spares], image, f"bench-{spares}-{rep}", action)
                        )
                results[state] = {
                    "no spares (spare_sandboxes = 0)": summary(rows[0]),
                    "a spare (spare_sandboxes = 1)": summary(rows[1]),
                }
        finally:
            for pool in pools.values():
                await pool.aclose()
            engine.close()
    return {
        "benchmark": "bench_spare_restore",
        "pool": f"ClusterSandboxPool on one {args.cluster} Ray node"
        if args.cluster
        else "SandboxPool on this machine",
        "reps": args.reps,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "results": results,
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{report['pool']}: load {report['load_before']} -> {report['load_after']} on {report['cpus']} CPUs"
    )
    print("| state | restore | median ms | p90 ms | into a spare |")
    print("|---|---|---:|---:|---:|")
    for state, ways in report["results"].items():
        for way, row in ways.items():
            print(
                f"| {state} | {way} | {row['median_ms']} | {row['p90_ms']} | {row['into_spare']}/{row['reps']} |"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--cluster", choices=["isolated", "local"], help="on a cluster run's pool (one Ray node)"
    )
    arguments = parser.parse_args()
    arguments.out = arguments.out or (CLUSTER_RESULTS if arguments.cluster else RESULTS)
    report = anyio.run(main, arguments)
    print_table(report)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(report, indent=2) + "\n")
