"""Weight sync: time to deliver an update to 1, 2 and 4 simulated nodes, against a plain copy.

Every simulated node is a Ray node on this machine with its `WeightAgent` and a belayer-gpumem
weight server (host memory, double buffered); `WeightSync.update` packs the version, sends it over
each node's gloo group into the server's inactive slot, and every node commits it with its
checksum. The baseline is the limit on one machine: a plain memcpy of the same bytes, once per
node (every byte lands in each node's memory through this machine's memory bus). Then a node is
lost mid-update (the update time with the loss, for the others) and a node rejoins through a fresh
rendezvous with the current version in full (the only group formation a loss costs here).

    python benchmarks/bench_weightsync.py                       # 100 MB and 1 GB, 1/2/4 nodes
    python benchmarks/bench_weightsync.py --sizes-mb 100 --nodes 1 2

Writes benchmarks/results/bench_weightsync.json and .md. Memory: 4 nodes x 1 GB x 2 slots = 8 GB
plus the trainer's two 1 GB pack buffers; everything is freed between configurations.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from belayer_cluster import LocalClusterConfig, LocalRayCluster, WeightSync
from belayer_gpumem import WeightLayout

RESULTS = Path(__file__).parent / "results"
TENSOR_FLOATS = 4 << 20  # 16 MiB float32 tensors


def layout_of(size_mb: int) -> WeightLayout:
    count = max(1, (size_mb << 20) // (TENSOR_FLOATS * 4))
    return WeightLayout.pack((f"layer.{i}.weight", "float32", (TENSOR_FLOATS,)) for i in range(count))


def weights(layout: WeightLayout, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {spec.name: torch.randn(spec.shape, generator=generator) for spec in layout.tensors}


def memcpy_s(nbytes: int, repeats: int) -> float:
    """The median time of one plain copy of `nbytes` (torch copy_, this machine's threads)."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8)
    target.copy_(source)  # touch the pages first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def start_sync(layout: WeightLayout, nodes: list[str], work: Path) -> WeightSync:
    sync = WeightSync(timeout_s=300.0, layout=layout)
    for node in nodes:
        sync.add_node(node, serve_dir=work / node[:12])
    return sync


def measure(
    cluster: LocalRayCluster, size_mb: int, num_nodes: int, repeats: int, work: Path
) -> dict[str, Any]:
    layout = layout_of(size_mb)
    sync = start_sync(layout, cluster.node_ids[:num_nodes], work)
    try:
        tensors = weights(layout, 0)
        sync.update(tensors)  # warm-up: first touch of every page
        times, pack = [], []
        for step in range(repeats):
            tensors[layout.tensors[0].name].add_(1.0)  # a new version each time
            result = sync.update(tensors)
            assert not result.dropped
            assert {r.checksum for r in result.nodes} == {result.checksum}
            times.append(result.elapsed_s)
            pack.append(result.pack_s)
            print(
                f"  {size_mb} MB -> {num_nodes} nodes, update {step + 1}: {result.elapsed_s:.2f} s",
                flush=True,
            )
        assert {v for values in sync.verify().values() for v in values} == {sync.checksum}
    finally:
        sync.close()
    nbytes = layout.slot_bytes
    copy_s = memcpy_s(nbytes, repeats)
    update_s = statistics.median(times)
    return {
        "size_mb": size_mb,
        "nbytes": nbytes,
        "num_nodes": num_nodes,
        "update_s": times,
        "update_median_s": update_s,
        "pack_and_checksum_median_s": statistics.median(pack),
        "memcpy_once_s": copy_s,
        "memcpy_per_node_s": copy_s * num_nodes,
        "ratio_to_memcpy": update_s / (copy_s * num_nodes),
        "delivered_gb_per_s": nbytes * num_nodes / update_s / 1e9,
    }


def node_loss(cluster: LocalRayCluster, size_mb: int, work: Path) -> dict[str, Any]:
    """4 nodes; the last one is removed after the first chunk of an update; then one rejoins."""
    layout = layout_of(size_mb)
    nodes = cluster.node_ids[:4]
    sync = start_sync(layout, nodes, work)
    try:
        tensors = weights(layout, 1)
        baseline = sync.update(tensors).elapsed_s
        lost = nodes[-1]
        removed_at: list[float] = []

        def lose(node_id: str, index: int) -> None:
            if node_id == lost and index == 0:
                removed_at.append(time.monotonic())
                cluster.remove_node(lost)

        tensors[layout.tensors[0].name].add_(1.0)
        result = sync.update(tensors, after_chunk=lose)
        assert result.dropped == (lost,), result.reasons
        done_after_loss_s = time.monotonic() - removed_at[0]
        rejoining = nodes[0]
        sync.drop_node(rejoining, "benchmark: a node that restarts")
        start = time.monotonic()
        joined = sync.add_node(rejoining, serve_dir=work / f"{rejoining[:12]}-rejoin")
        rejoin_s = time.monotonic() - start
        assert joined.checksum == sync.checksum
        parts = dict(sync.last_join)
    finally:
        sync.close()
    return {
        "size_mb": size_mb,
        "num_nodes": 4,
        "update_without_loss_s": baseline,
        "update_with_loss_s": result.elapsed_s,
        "loss_to_update_done_s": done_after_loss_s,
        "survivor_regroup_s": 0.0,
        "rejoin_with_full_version_s": rejoin_s,
        "rejoin_parts_s": {k: v for k, v in parts.items() if k != "node_id"},
        "reason": result.reasons[lost],
    }


def markdown(rows: list[dict[str, Any]], loss: dict[str, Any] | None, load: tuple[float, ...]) -> str:
    lines = [
        "| update | nodes | WeightSync.update (median) | of it: pack + checksum | plain memcpy x nodes | ratio | delivered GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['size_mb']} MB | {row['num_nodes']} | {row['update_median_s']:.2f} s | "
            f"{row['pack_and_checksum_median_s']:.2f} s | "
            f"{row['memcpy_per_node_s']:.3f} s | {row['ratio_to_memcpy']:.1f}x | {row['delivered_gb_per_s']:.2f} |"
        )
    if loss is not None:
        lines += [
            "",
            f"Node lost mid-update ({loss['size_mb']} MB, 4 nodes): update without a loss "
            f"{loss['update_without_loss_s']:.2f} s, with the loss {loss['update_with_loss_s']:.2f} s "
            f"(done {loss['loss_to_update_done_s']:.2f} s after the node was removed; the 3 others "
            f"re-form nothing: 0 s); a node rejoining through a fresh rendezvous with the current "
            f"version in full: {loss['rejoin_with_full_version_s']:.2f} s (agent start "
            f"{loss['rejoin_parts_s']['agent_start_s']:.2f} s, rendezvous {loss['rejoin_parts_s']['rendezvous_s']:.2f} s, "
            f"transfer {loss['rejoin_parts_s']['transfer_s']:.2f} s).",
        ]
    lines += [
        "",
        f"Load average during the run: {', '.join(f'{x:.1f}' for x in load)} (shared 2-core machine).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1024])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loss-size-mb", type=int, default=100)
    parser.add_argument(
        "--loss-only", action="store_true", help="rerun only the node-loss part; keep the committed rows"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="bench-weightsync-") as folder,
        LocalRayCluster(LocalClusterConfig(num_nodes=max(4, *args.nodes), cpus_per_node=1)) as cluster,
    ):
        work = Path(folder)
        for size_mb in [] if args.loss_only else args.sizes_mb:
            for num_nodes in args.nodes:
                rows.append(
                    measure(cluster, size_mb, num_nodes, args.repeats, work / f"{size_mb}-{num_nodes}")
                )
                gc.collect()
        loss = node_loss(cluster, args.loss_size_mb, work / "loss")
    load = (*load_before, *os.getloadavg())
    command = "python benchmarks/bench_weightsync.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()
        if k != "loss_only"
    )
    if args.loss_only:
        previous = json.loads((RESULTS / "bench_weightsync.json").read_text())
        previous["node_loss"] = loss
        previous["node_loss_command"] = command + " --loss-only"
        previous["node_loss_load_average_before_after"] = load
        (RESULTS / "bench_weightsync.json").write_text(json.dumps(previous, indent=2) + "\n")
        table = markdown(previous["rows"], loss, tuple(previous["load_average_before_after"]))
        (RESULTS / "bench_weightsync.md").write_text(table)
        print(table)
        return
    document = {
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, shared and loaded",
        "load_average_before_after": load,
        "transport": "torch.distributed ProcessGroupGloo over loopback TCP, one group per node",
        "rows": rows,
        "node_loss": loss,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_weightsync.json").write_text(json.dumps(document, indent=2) + "\n")
    table = markdown(rows, loss, load)
    (RESULTS / "bench_weightsync.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
