"""``belayer-policy compare``: compare checkpoint policies on simulated rollout batches.

``belayer-policy simulate``, its former name, still works and says it is deprecated.

The CLI keeps the contract of the root README: one ``belayer-policy: error: ...`` line on stderr
for the package's own errors (a traceback only with ``--debug`` or ``BELAYER_DEBUG=1``), the named
exit codes of :class:`ExitCode`, ``--json`` for one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import signal
import sys
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version
from types import FrameType

from belayer_policy._errors import BelayerPolicyError, PolicyArgumentError
from belayer_policy._hazard import FixedStepProbability
from belayer_policy._report import compare_policies, format_table
from belayer_policy._simulator import SimulationConfig
from belayer_policy._spec import PolicySpec, SharedEstimators
from belayer_policy._trace import load_trace
from belayer_policy._workload import Workload

__all__ = ["ExitCode", "main"]


class ExitCode(enum.IntEnum):
    """Exit codes shared by every Belayer command (root README, "One CLI contract")."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNHEALTHY = 3
    INTERRUPTED = 130


DEFAULT_POLICIES = ("adaptive", "paper", "always", "every:3", "never")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer-policy", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('belayer-policy')}")
    parser.add_argument(
        "--debug", action="store_true", help="print tracebacks of errors (also: BELAYER_DEBUG=1)"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser(
        "compare",
        help="compare policies on simulated rollout batches (formerly `simulate`)",
        description="Simulate rollout batches under each policy and print a comparison table.",
    )
    sim.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="adaptive|paper|always|never|every:K",
        help=f"a policy to compare; repeat for several (default: {' '.join(DEFAULT_POLICIES)})",
    )
    sim.add_argument("--fail-prob", type=float, default=0.01, help="failure probability per step")
    sim.add_argument("--trajectories", type=int, default=None, help="trajectories per batch (default 64)")
    sim.add_argument("--steps", type=int, default=None, help="steps per trajectory (default 20)")
    sim.add_argument("--trace", default=None, help="JSONL trace of trajectories instead of drawn ones")
    sim.add_argument("--seed", type=int, default=0, help="seed of the first run")
    sim.add_argument("--runs", type=int, default=20, help="seeded batches per policy")
    sim.add_argument(
        "--restore-s",
        "--restore-seconds",
        dest="restore_s",
        type=float,
        default=2.0,
        help="seconds one restore costs",
    )
    sim.add_argument(
        "--known-fail-prob",
        action="store_true",
        help="the policies know --fail-prob (as in fault-injection runs) instead of learning the hazard",
    )
    sim.add_argument(
        "--carry-estimators",
        action="store_true",
        help="keep each policy's estimators over the runs, as a training run does",
    )
    sim.add_argument("--json", action="store_true", help="print a JSON list, one object per policy")
    return parser


def _simulate(args: argparse.Namespace) -> str:
    specs = [PolicySpec.parse(p) for p in (args.policies or DEFAULT_POLICIES)]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise PolicyArgumentError(f"--policy names a policy twice: {names}; give each once")
    config = SimulationConfig(fail_prob=args.fail_prob, restore_s=args.restore_s)
    p = config.fail_prob
    common = {
        "config": config,
        "runs": args.runs,
        "seed": args.seed,
        "carry_estimators": args.carry_estimators,
        "estimators": (lambda: SharedEstimators(failure_model=FixedStepProbability(p)))
        if args.known_fail_prob
        else SharedEstimators,
    }
    if args.trace is not None:
        if args.trajectories is not None or args.steps is not None:
            raise PolicyArgumentError("--trace gives the trajectories: drop --trajectories and --steps")
        summaries = compare_policies(specs, trace=load_trace(args.trace), **common)
    else:
        workload = Workload(num_steps=20 if args.steps is None else args.steps)
        summaries = compare_policies(
            specs,
            workload=workload,
            num_trajectories=64 if args.trajectories is None else args.trajectories,
            **common,
        )
    if args.json:
        return json.dumps([s.to_dict() for s in summaries], indent=2)
    return format_table(summaries)


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM stops the command like Ctrl-C does (the main thread only)."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _renamed_command(argv: Sequence[str], old: str, new: str, prog: str) -> list[str]:
    """`argv` with the deprecated command name `old` replaced by `new` (and a warning on stderr)."""
    args = list(argv)
    for index, arg in enumerate(args):
        if not arg.startswith("-"):  # the command: global options come before it and take no value
            if arg == old:
                print(
                    f"{prog}: warning: `{prog} {old}` is deprecated; use `{prog} {new}` (same flags)",
                    file=sys.stderr,
                )
                args[index] = new
            break
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``belayer-policy`` command; returns an :class:`ExitCode`."""
    argv = _renamed_command(sys.argv[1:] if argv is None else argv, "simulate", "compare", "belayer-policy")
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("BELAYER_DEBUG") == "1"
    try:
        with _sigterm_interrupts():
            output = _simulate(args)
    except KeyboardInterrupt:
        print("belayer-policy: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BelayerPolicyError as err:
        if debug:
            traceback.print_exc()
        print(f"belayer-policy: error: {err}", file=sys.stderr)
        return ExitCode.USAGE if isinstance(err, PolicyArgumentError) else ExitCode.FAILED
    print(output)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
