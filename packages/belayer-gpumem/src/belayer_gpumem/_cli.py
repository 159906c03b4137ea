"""`belayer-gpumem serve | ping | describe`, under the CLI contract of the root README.

Errors are one line, `belayer-gpumem: error: ...` (a traceback only with `--debug` or
`BELAYER_DEBUG=1`); exit codes are the named `ExitCode`s; `ping` and `describe` print one JSON
document with `--json`.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from belayer_gpumem._backends import BACKENDS
from belayer_gpumem._config import ServerConfig
from belayer_gpumem._errors import BelayerGpumemError, LayoutError, ServerGoneError
from belayer_gpumem._layout import DTYPE_SIZES, KVLayout

__all__ = ["ExitCode", "main"]

_PROG = "belayer-gpumem"


class ExitCode(enum.IntEnum):
    """The exit codes every Belayer command shares (root README, "One CLI contract")."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNHEALTHY = 3
    INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=_PROG, description="Weight and KV-cache memory servers.")
    parser.add_argument("--debug", action="store_true", help="print tracebacks (also BELAYER_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="own one region and serve it on a Unix socket")
    serve.add_argument("--kind", choices=["weights", "kv"], required=True)
    serve.add_argument("--socket", required=True, help="socket path; its directory is made private (0700)")
    serve.add_argument("--backend", choices=BACKENDS, default="host")
    serve.add_argument("--device", type=int, default=0, help="CUDA device ordinal (cuda backend)")
    serve.add_argument("--safetensors", help="weights: load table and values from this file (version 1)")
    serve.add_argument("--layout", help="weights: JSON table {'tensors': [{name, dtype, shape}]} (version 0)")
    for flag in ("--num-blocks", "--num-layers", "--block-size", "--num-kv-heads", "--head-dim"):
        serve.add_argument(flag, type=int, help="kv: arena layout")
    serve.add_argument("--dtype", choices=sorted(DTYPE_SIZES), default="bfloat16", help="kv: element type")
    serve.add_argument(
        "--start-version",
        type=int,
        default=0,
        help="weights with --layout: the version before the first update (that update commits N + 1)",
    )
    serve.add_argument("--ready-file", help="written (atomically) once the server accepts connections")
    serve.add_argument("--pid-file", help="written at start, removed at shutdown")
    for name in ("ping", "describe"):
        command = commands.add_parser(name, help=f"{name} a running server and print its reply")
        command.add_argument("--socket", required=True)
        command.add_argument("--json", action="store_true", help="print the reply as one JSON document")
    return parser


def _config(args: argparse.Namespace) -> ServerConfig:
    kv = None
    if args.kind == "kv":
        kv = KVLayout(
            num_blocks=args.num_blocks,
            num_layers=args.num_layers,
            block_size=args.block_size,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            dtype=args.dtype,
        )
    return ServerConfig(
        kind=args.kind,
        socket=args.socket,
        backend=args.backend,
        device=args.device,
        safetensors=args.safetensors,
        layout_file=args.layout,
        kv_layout=kv,
        ready_file=args.ready_file,
        pid_file=args.pid_file,
        start_version=args.start_version,
    )


def _print_reply(reply: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(reply))
        return
    for key, value in reply.items():
        shown = json.dumps(value) if isinstance(value, dict | list) else value
        print(f"{key}: {shown}")


def _run(args: argparse.Namespace) -> ExitCode:
    if args.command == "serve":
        from belayer_gpumem._server import run_server

        run_server(_config(args))
        return ExitCode.INTERRUPTED  # it serves until SIGTERM / SIGINT, then shuts down cleanly
    from belayer_gpumem._connection import Connection

    conn = Connection.connect(args.socket, timeout_s=10.0)
    try:
        reply, _ = conn.request(args.command)
    finally:
        conn.close()
    _print_reply(reply, as_json=args.json)
    return ExitCode.OK


def _exit_code(exc: BelayerGpumemError, command: str) -> ExitCode:
    if isinstance(exc, LayoutError):
        return ExitCode.USAGE  # a bad layout or weight file: nothing was started
    if isinstance(exc, ServerGoneError) and command != "serve":
        return ExitCode.UNHEALTHY  # the probe found no server
    return ExitCode.FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns an `ExitCode` (argparse's own usage errors exit with USAGE too)."""
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("BELAYER_DEBUG") == "1"
    try:
        return _run(args)
    except BelayerGpumemError as exc:
        if debug:
            traceback.print_exc()
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return _exit_code(exc, args.command)
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
