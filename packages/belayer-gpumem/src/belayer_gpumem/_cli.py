"""`belayer-gpumem serve | ping | describe`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from belayer_gpumem.backends import BACKENDS
from belayer_gpumem.config import ServerConfig
from belayer_gpumem.errors import BelayerGpumemError
from belayer_gpumem.layout import DTYPE_SIZES, KVLayout

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer-gpumem", description="Weight and KV-cache memory servers.")
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
    serve.add_argument("--ready-file", help="written (atomically) once the server accepts connections")
    serve.add_argument("--pid-file", help="written at start, removed at shutdown")
    for name in ("ping", "describe"):
        command = commands.add_parser(name, help=f"{name} a running server and print its JSON reply")
        command.add_argument("--socket", required=True)
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
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad arguments or a failed start)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            from belayer_gpumem.server import run_server

            run_server(_config(args))
            return 0
        from belayer_gpumem.connection import Connection

        conn = Connection.connect(args.socket, timeout_s=10.0)
        try:
            reply, _ = conn.request(args.command)
        finally:
            conn.close()
        print(json.dumps(reply, indent=2))
        return 0
    except BelayerGpumemError as exc:
        print(f"belayer-gpumem: {exc}", file=sys.stderr)
        return 2
