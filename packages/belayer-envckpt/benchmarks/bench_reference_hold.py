"""How long a reference checkpoint holds a sandbox's actions (``timings_ms["hold_ms"]``).

One BusyBox sandbox with one file written, one fresh-runtime checkpoint, then ``--reps``
checkpoints with nothing changed (each a reference); prints the median, min and max hold and the
load average.  Run it once with this tree's sources and once with another tree's (PYTHONPATH) to
compare two versions under the same load.

    python benchmarks/bench_reference_hold.py [--reps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from belayer_envckpt import CheckpointStore, Engine, Sandbox, SandboxConfig, checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args()
    engine = Engine.connect()
    sandbox = Sandbox.create(
        engine,
        SandboxConfig(image="belayer/busybox:latest", labels={"belayer.bench": "hold"}),
        trajectory="h",
    )
    try:
        with tempfile.TemporaryDirectory() as folder:
            store = CheckpointStore(Path(folder) / "store")
            sandbox.exec("echo one > /a")
            checkpoint(sandbox, "h", store=store)
            holds = []
            for _ in range(args.reps):
                taken = checkpoint(sandbox, "h", store=store)
                assert taken.kind == "reference", taken.kind
                holds.append(taken.timings_ms["hold_ms"])
        print(
            f"load {os.getloadavg()[0]:.1f}: reference hold ms median {statistics.median(holds):.2f} "
            f"min {min(holds):.2f} max {max(holds):.2f} ({args.reps} checkpoints)"
        )
    finally:
        sandbox.remove()
        engine.close()


if __name__ == "__main__":
    main()
