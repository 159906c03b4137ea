"""``belayer-router serve``: run a router from the command line."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import anyio

from belayer_router._app import RouterApp, RouterConfig
from belayer_router._errors import BelayerRouterError
from belayer_router._server import bind_socket, serve_asgi
from belayer_router._tokenizer import load_tokenizer

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer-router", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the router over HTTP")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--admin-token",
        default=os.environ.get("BELAYER_ROUTER_ADMIN_TOKEN"),
        help="bearer token for the admin API (default: $BELAYER_ROUTER_ADMIN_TOKEN; none = open)",
    )
    serve.add_argument("--journal", type=Path, help="append-only journal file (persists prefixes)")
    serve.add_argument("--prefix-interval", type=int, default=256, help="tokens between preserved prefixes")
    serve.add_argument("--resume-wait", type=float, default=5.0, help="seconds to wait for a replacement")
    serve.add_argument("--fsync", action="store_true", help="fsync the journal on every write")
    serve.add_argument("--tokenizer", help="'bytes' or a tokenizer.json path, for text prompts")
    serve.add_argument("--log-level", default="warning")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``belayer-router`` command."""
    args = _parser().parse_args(argv)
    try:
        config = RouterConfig(
            admin_token=args.admin_token,
            journal_path=args.journal,
            prefix_interval=args.prefix_interval,
            resume_wait=args.resume_wait,
            fsync=args.fsync,
            tokenizer=None if args.tokenizer is None else load_tokenizer(args.tokenizer),
        )
        app = RouterApp(config)
        sock = bind_socket(args.host, args.port)
    except (BelayerRouterError, ValueError, OSError) as error:
        print(f"belayer-router: {error}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    print(f"belayer-router listening on http://{host}:{port}", flush=True)
    anyio.run(serve_asgi, app, sock, args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
