"""`belayer-cluster status`: the nodes of a Ray cluster, alive or lost; `serve`: a rollout service
with its slots on the cluster's nodes (`_serve_cli.py`); `scale`: the scale simulation.

`belayer-cluster simulate`, the former name of `scale`, still works and says it is deprecated.

The CLI contract of the root README: one error line `belayer-cluster: error: ...` on stderr (a
traceback only with `--debug` or `BELAYER_DEBUG=1`), named exit codes (`ExitCode`), `--json`
prints exactly one JSON document, `python -m belayer_cluster` is the same command.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from belayer_cluster._connect import check_address
from belayer_cluster._errors import BelayerClusterError, ClusterConfigError, ClusterStartError
from belayer_cluster._serve_cli import add_serve_parser, run_serve
from belayer_cluster._simulate_cli import add_simulate_parser, run_simulate

__all__ = ["ExitCode", "main"]

PROG = "belayer-cluster"


class ExitCode(enum.IntEnum):
    """The exit codes every Belayer command shares (root README, "One CLI contract")."""

    OK = 0
    FAILED = 1  # the command ran and failed
    USAGE = 2  # bad arguments: nothing was started
    UNHEALTHY = 3  # a check found a problem (a node of the cluster is dead)
    INTERRUPTED = 130  # SIGINT or SIGTERM


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's usage errors keep the one-line contract
        raise ClusterConfigError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Belayer's rollout slots on Ray.")
    parser.add_argument("--debug", action="store_true", help="tracebacks for errors (also BELAYER_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    status = commands.add_parser("status", help="the nodes of a Ray cluster (exit 3 if one is dead)")
    status.add_argument("--address", required=True, help="the Ray GCS address, HOST:PORT")
    status.add_argument("--connect-timeout-s", type=float, default=10.0)
    status.add_argument("--json", action="store_true", help="print one JSON document")
    add_serve_parser(commands)
    add_simulate_parser(commands)
    return parser


def status(address: str, connect_timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Connect to the Ray cluster at `address` and list its nodes: id, alive, address, CPUs."""
    check_address(address, connect_timeout_s)
    import ray

    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        raise ClusterStartError(f"could not join the Ray cluster at {address}: {exc}") from exc
    try:
        return [
            {
                "node_id": node["NodeID"],
                "alive": bool(node["Alive"]),
                "address": node.get("NodeManagerAddress"),
                "cpus": float(node.get("Resources", {}).get("CPU", 0.0)),
            }
            for node in ray.nodes()  # type: ignore[no-untyped-call]
        ]
    finally:
        ray.shutdown()


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of `belayer-cluster`; returns the exit code."""
    from belayer_shadow import BelayerShadowError, ModelConfigError, WeightsError

    debug = os.environ.get("BELAYER_DEBUG") == "1" or "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        argv = _renamed_command(sys.argv[1:] if argv is None else argv, "simulate", "scale", PROG)
        args = _parser().parse_args(argv)
        if args.command == "scale":
            return run_simulate(args)
        if args.command == "serve":
            return run_serve(args)
        nodes = status(args.address, args.connect_timeout_s)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except (BelayerClusterError, BelayerShadowError) as exc:
        if debug:
            traceback.print_exc()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        # serve: a model folder that cannot be served (UnsupportedModelError is a ModelConfigError)
        # is bad input found before anything started, as a bad flag or address
        usage = isinstance(exc, ClusterConfigError | ModelConfigError | WeightsError)
        return ExitCode.USAGE if usage else ExitCode.FAILED
    dead = [n for n in nodes if not n["alive"]]
    if args.json:
        print(json.dumps({"address": args.address, "nodes": nodes, "num_dead": len(dead)}))
    else:
        for node in nodes:
            state = "alive" if node["alive"] else "DEAD"
            print(f"{node['node_id'][:12]}  {state:5}  {node['address']}  cpus={node['cpus']:g}")
    return ExitCode.UNHEALTHY if dead else ExitCode.OK
