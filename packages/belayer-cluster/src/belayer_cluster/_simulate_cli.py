"""`belayer-cluster scale`: the scale simulation from the command line.

Every simulation input is a flag (`--rollout-s 600`); Belayer's measured recovery times are read
from the committed results files when the command runs inside a Belayer checkout (or `--repo`),
otherwise the built-in copies of those values are used. `--json` prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import attrs

from belayer_cluster._errors import ClusterConfigError
from belayer_cluster._simulate import Strategy
from belayer_cluster._simulate_inputs import INPUT_SOURCES, MEASURED_INPUTS, SimInputs, load_measured_inputs
from belayer_cluster._simulate_scale import DEFAULT_GPUS, inputs_table, markdown_table, simulate_scale

__all__ = ["add_simulate_parser", "resolve_inputs", "run_simulate"]


def add_simulate_parser(commands: Any) -> None:
    """Add the `scale` subcommand (and a flag per simulation input) to the CLI's subparsers."""
    simulate = commands.add_parser(
        "scale",
        help="effective training time ratio of an RL job at 1,024-16,384 GPUs, per recovery strategy "
        "(formerly `simulate`)",
    )
    simulate.add_argument(
        "--gpus", type=int, nargs="+", default=list(DEFAULT_GPUS), help="GPU counts to simulate"
    )
    simulate.add_argument("--days", type=float, default=30.0, help="simulated wall time per run")
    simulate.add_argument("--reps", type=int, default=10, help="repetitions (failure traces) per scale")
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument(
        "--strategy",
        choices=[s.value for s in Strategy],
        action="append",
        help="only these strategies (repeatable)",
    )
    simulate.add_argument(
        "--inputs",
        type=Path,
        help=f"a measured-inputs file (default: the committed {MEASURED_INPUTS.name}; "
        "benchmarks/update_measured_inputs.py writes one)",
    )
    simulate.add_argument("--repo", type=Path, help=argparse.SUPPRESS)  # removed: a clear error says so
    simulate.add_argument("--json", action="store_true", help="print one JSON document")
    defaults = SimInputs()
    for field in attrs.fields(SimInputs):
        info = INPUT_SOURCES[field.name]
        simulate.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=int if field.type in (int, "int") else float,
            default=None,
            help=f"{info.unit}; default {getattr(defaults, field.name):.6g}: {info.source}",
        )


def resolve_inputs(overrides: dict[str, float], inputs: Path | None) -> tuple[SimInputs, dict[str, str]]:
    """Defaults < the measured-inputs file (`inputs`, else the committed one) < flags; returns the
    inputs and each one's source."""
    sources = {name: info.source for name, info in INPUT_SOURCES.items()}
    values: dict[str, Any] = {}
    for name, (value, source) in load_measured_inputs(inputs).items():
        values[name] = value
        sources[name] = source if inputs is None else f"{inputs}: {source}"
    for name, value in overrides.items():
        values[name] = value
        sources[name] = "command-line flag"
    return SimInputs().replace(**values), sources


def run_simulate(args: argparse.Namespace) -> int:
    """Run the simulation the parsed `scale` arguments ask for, print it; returns exit code 0."""
    overrides = {
        f.name: getattr(args, f.name) for f in attrs.fields(SimInputs) if getattr(args, f.name) is not None
    }
    if args.repo is not None:
        raise ClusterConfigError(
            "--repo is gone: the simulation no longer reads a checkout's results files; it uses its "
            f"committed {MEASURED_INPUTS.name} (regenerate it with "
            "packages/belayer-cluster/benchmarks/update_measured_inputs.py) or --inputs FILE"
        )
    inputs, sources = resolve_inputs(overrides, args.inputs)
    strategies = [Strategy(s) for s in args.strategy] if args.strategy else list(Strategy)
    results = simulate_scale(
        inputs, gpus=args.gpus, days=args.days, repetitions=args.reps, seed=args.seed, strategies=strategies
    )
    if args.json:
        document = {
            "days": args.days,
            "repetitions": args.reps,
            "seed": args.seed,
            "inputs": {
                name: {
                    "value": getattr(inputs, name),
                    "unit": info.unit,
                    "source": sources[name],
                    "note": info.note,
                }
                for name, info in INPUT_SOURCES.items()
            },
            "results": [r.to_json() for r in results],
        }
        print(json.dumps(document))
    else:
        print(
            f"Effective training time ratio (useful / wall), mean ± 95% CI over {args.reps} runs "
            f"of {args.days:g} days, seed {args.seed}:\n"
        )
        print(markdown_table(results))
        print("\nInputs:\n")
        print(inputs_table(inputs, sources))
    return 0
