"""Regenerate the scale simulation's measured inputs from the siblings' committed results files.

The simulation (`belayer-cluster scale`, `benchmarks/simulate_scale.py`) reads its measured
recovery times only from its own committed file, `src/belayer_cluster/measured_inputs.json`; this
script is the one place that knows where its siblings keep theirs. Run it from the repository root
or from packages/belayer-cluster after a sibling re-runs one of those benchmarks:

    python packages/belayer-cluster/benchmarks/update_measured_inputs.py          # rewrite the file
    python packages/belayer-cluster/benchmarks/update_measured_inputs.py --check  # exit 1 if stale

then re-run `benchmarks/simulate_scale.py` so the committed tables follow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from belayer_cluster import ClusterConfigError
from belayer_cluster.simulate import INPUT_SOURCES, MEASURED_INPUTS

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
SHADOW_VLLM = "packages/belayer-shadow/benchmarks/results/bench_handover_vllm.json"
ENVCKPT = "packages/belayer-envckpt/benchmarks/results/bench_checkpoint.json"
NODE_LOSS = "packages/belayer-cluster/benchmarks/results/bench_node_loss.json"


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ClusterConfigError(f"cannot read the committed results file {path}: {exc}") from exc


def read_results(repo_root: Path) -> dict[str, float]:
    """The measured recovery times in the results files of the checkout at `repo_root`.

    Each of the three files must be there and hold its keys (`ClusterConfigError` naming the file
    and key otherwise): a measured input is never silently left at an older value.
    """
    found: dict[str, float] = {}
    shadow = _load(repo_root / SHADOW_VLLM)
    try:
        found["detection_s"] = float(shadow["conventional"]["detection_s"])
        found["worker_restart_s"] = float(shadow["conventional"]["all_resumed_s"])
        found["shadow_handover_s"] = float(
            statistics.median(float(t["all_resumed_s"]) for t in shadow["shadow"])
        )
    except (KeyError, TypeError, ValueError, statistics.StatisticsError) as exc:
        raise ClusterConfigError(f"{SHADOW_VLLM} lacks a key the simulation reads ({exc!r})") from exc
    rows = _load(repo_root / ENVCKPT)
    try:
        restore_s = max(float(row["restore_total_ms"]) for row in rows) / 1000.0
    except (KeyError, TypeError, ValueError) as exc:
        raise ClusterConfigError(f"{ENVCKPT} lacks restore_total_ms ({exc!r})") from exc
    found["sandbox_restore_s"] = found["sandbox_restart_s"] = restore_s
    node_loss = _load(repo_root / NODE_LOSS)
    try:
        found["node_loss_resume_s"] = float(node_loss["summary"]["node_loss_recovery_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ClusterConfigError(f"{NODE_LOSS} lacks summary.node_loss_recovery_s ({exc!r})") from exc
    return found


def document(values: dict[str, float]) -> str:
    """The measured-inputs file for `values`: each with the results file and key it came from."""
    inputs = {
        name: {"value": values[name], "unit": INPUT_SOURCES[name].unit, "source": INPUT_SOURCES[name].source}
        for name in sorted(values)
    }
    doc = {
        "written_by": "python packages/belayer-cluster/benchmarks/update_measured_inputs.py",
        "inputs": inputs,
    }
    return json.dumps(doc, indent=1) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to read (default: this one)")
    parser.add_argument("--out", type=Path, default=MEASURED_INPUTS, help="the file to write")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out is stale")
    args = parser.parse_args(argv)
    try:
        text = document(read_results(args.repo))
    except ClusterConfigError as exc:
        print(f"update_measured_inputs: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        if current != text:
            print(f"{args.out} is stale: run {Path(__file__).name} without --check", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
