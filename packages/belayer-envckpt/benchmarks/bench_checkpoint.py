"""Checkpoint and restore latency by step, against two baselines measured in the same run.

For upper layers of about 0, 10 and 100 MB and a Python process of about 10 and 200 MB resident
memory (belayer/debian-python), it measures:
  - full_checkpoint: freeze window (pause -> thaw, the part on the critical path), layer capture,
    CRIU dump through Docker, publish (hash, manifest, fsync, rename), total;
  - full_restore: verify, remove the failed container, create, install layer, start from CRIU, total;
  - baseline "replay": a new container from the image, the actions replayed, the process restarted
    until it holds its state again (in-memory state is rebuilt, not restored);
  - baseline "commit": `docker commit` of the container (file system only, processes lost) and a
    start from the committed image.

    python benchmarks/bench_checkpoint.py [--reps 3] [--out benchmarks/results/bench_checkpoint.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from belayer_envckpt import CheckpointStore, Engine, Sandbox, SandboxConfig, full_checkpoint, full_restore

IMAGE = "belayer/debian-python:latest"
APP = """
import os, time
state = bytearray(os.urandom({rss_mb} * 1024 * 1024))
open('/tmp/ready', 'w').write('1')
n = 0
while True:
    n += 1
    time.sleep(0.05)
"""
LABEL = {"belayer.bench": "1"}


def _verify_ms(row: dict) -> float:
    """A restore's verification on its critical path: the checks before the create and, since
    0.7.2, the wait for the page images' hashing after it."""
    return row["restore_verify_ms"] + row.get("restore_pages_verify_wait_ms", 0.0)


def _wait_ready(sandbox: Sandbox, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sandbox.exec("cat /tmp/ready 2>/dev/null").stdout != "1":
        if time.monotonic() > deadline:
            raise RuntimeError("the benchmark process did not become ready")
        time.sleep(0.02)


def _actions(layer_mb: int) -> list[str]:
    return [
        f"mkdir -p /work && head -c {layer_mb * 1024 * 1024} /dev/urandom > /work/blob",
        "echo done > /work/marker",
    ]


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def measure(engine: Engine, layer_mb: int, rss_mb: int, store: CheckpointStore) -> dict[str, float]:
    config = SandboxConfig(image=IMAGE, command=("python3", "-c", APP.format(rss_mb=rss_mb)), labels=LABEL)
    sandbox = Sandbox.create(engine, config, trajectory="bench")
    restored = None
    try:
        _wait_ready(sandbox)
        for action in _actions(layer_mb):
            sandbox.exec(action)
        ckpt = full_checkpoint(sandbox, "bench", store=store)
        out = {f"ckpt_{k}": v for k, v in ckpt.timings_ms.items()}
        out["ckpt_bytes_mb"] = ckpt.total_bytes / 1e6
        sandbox.kill()
        restored = full_restore(ckpt, engine=engine)
        out |= {f"restore_{k}": v for k, v in restored.restore_timings_ms.items()}

        # Baseline 1: restart from the image and replay the actions; the process restarts.
        start = time.perf_counter()
        replay = Sandbox.create(engine, config, trajectory="bench-replay")
        try:
            for action in _actions(layer_mb):
                replay.exec(action)
            _wait_ready(replay)
            out["replay_total_ms"] = _ms(start)
        finally:
            replay.remove()

        # Baseline 2: docker commit (file system only), then a container from the committed image.
        start = time.perf_counter()
        image = restored._container.commit(repository="belayer/bench-commit", tag="latest")
        out["commit_ms"] = _ms(start)
        start = time.perf_counter()
        from_commit = Sandbox.create(
            engine, SandboxConfig(image="belayer/bench-commit:latest", command=config.command, labels=LABEL)
        )
        out["commit_restart_ms"] = _ms(start)
        from_commit.remove()
        engine._client.images.remove(image.id, force=True)
        return out
    finally:
        sandbox.remove()
        if restored is not None:
            restored.remove()
        store.gc("bench")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", default="0,10,100", help="upper-layer sizes in MB")
    parser.add_argument("--rss", default="10,200", help="process resident sizes in MB")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_checkpoint.json"))
    args = parser.parse_args()
    engine = Engine.connect()
    engine.require_checkpoint_support()
    rows = []
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as tmp:
        store = CheckpointStore(tmp)
        for rss_mb in [int(x) for x in args.rss.split(",")]:
            for layer_mb in [int(x) for x in args.layers.split(",")]:
                runs = [measure(engine, layer_mb, rss_mb, store) for _ in range(args.reps)]
                row = {"layer_mb": layer_mb, "rss_mb": rss_mb, "reps": args.reps}
                row |= {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))


def table(rows: list[dict[str, float]]) -> str:
    head = (
        "| layer MB | RSS MB | freeze | layer | dump | publish | ckpt total | ckpt MB | restore total "
        "(verify / create / layer / start) | replay baseline | docker commit (+ start) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['layer_mb']:.0f} | {r['rss_mb']:.0f} | {r['ckpt_freeze_ms']:.0f} | {r['ckpt_layer_ms']:.0f} "
            f"| {r['ckpt_dump_ms']:.0f} | {r['ckpt_publish_ms']:.0f} | {r['ckpt_total_ms']:.0f} | {r['ckpt_bytes_mb']:.0f} "
            f"| {r['restore_total_ms']:.0f} ({_verify_ms(r):.0f} / {r['restore_create_ms']:.0f} / "
            f"{r['restore_layer_ms']:.0f} / {r['restore_start_ms']:.0f}) | {r['replay_total_ms']:.0f} "
            f"| {r['commit_ms']:.0f} (+ {r['commit_restart_ms']:.0f}) |"
        )
    return "\n".join(lines) + "\n\nAll times in ms, medians over the repetitions."


if __name__ == "__main__":
    main()
