"""``belayer-policy simulate``: compare checkpoint policies on simulated rollout batches."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from belayer_policy._errors import BelayerPolicyError
from belayer_policy._report import compare_policies, format_table
from belayer_policy._simulator import SimulationConfig
from belayer_policy._spec import PolicySpec
from belayer_policy._workload import Workload, load_trace

__all__ = ["main"]

DEFAULT_POLICIES = ("adaptive", "always", "every:3", "never")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer-policy", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser(
        "simulate",
        help="compare policies on simulated rollout batches",
        description="Simulate rollout batches under each policy and print a comparison table.",
    )
    sim.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="adaptive|always|never|every:K",
        help=f"a policy to compare; repeat for several (default: {' '.join(DEFAULT_POLICIES)})",
    )
    sim.add_argument("--fail-prob", type=float, default=0.01, help="failure probability per step")
    sim.add_argument("--trajectories", type=int, default=None, help="trajectories per batch (default 64)")
    sim.add_argument("--steps", type=int, default=None, help="steps per trajectory (default 20)")
    sim.add_argument("--trace", default=None, help="JSONL trace of trajectories instead of drawn ones")
    sim.add_argument("--seed", type=int, default=0, help="seed of the first run")
    sim.add_argument("--runs", type=int, default=20, help="seeded batches per policy")
    sim.add_argument("--restore-seconds", type=float, default=2.0, help="cost of one restore")
    sim.add_argument("--json", action="store_true", help="print a JSON list, one object per policy")
    return parser


def _simulate(args: argparse.Namespace) -> str:
    specs = [PolicySpec.parse(p) for p in (args.policies or DEFAULT_POLICIES)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise BelayerPolicyError(f"--policy names a policy twice: {names}")
    config = SimulationConfig(fail_prob=args.fail_prob, restore_seconds=args.restore_seconds)
    if args.trace is not None:
        if args.trajectories is not None or args.steps is not None:
            raise BelayerPolicyError("--trace gives the trajectories: drop --trajectories and --steps")
        summaries = compare_policies(
            specs, config=config, runs=args.runs, seed=args.seed, trace=load_trace(args.trace)
        )
    else:
        workload = Workload(num_steps=20 if args.steps is None else args.steps)
        summaries = compare_policies(
            specs,
            config=config,
            runs=args.runs,
            seed=args.seed,
            workload=workload,
            num_trajectories=64 if args.trajectories is None else args.trajectories,
        )
    if args.json:
        return json.dumps([s.to_dict() for s in summaries], indent=2)
    return format_table(summaries)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``belayer-policy`` command."""
    args = _parser().parse_args(argv)
    try:
        output = _simulate(args)
    except (BelayerPolicyError, ValueError) as err:
        print(f"belayer-policy: error: {err}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
