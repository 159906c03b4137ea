"""``belayer-router``: run a router from the command line (also ``python -m belayer_router``).

It keeps the root README's CLI contract: errors are one line ``belayer-router: error: ...`` on
stderr (a traceback only with ``--debug`` or ``BELAYER_DEBUG=1``), exit codes are `ExitCode`,
``--json`` prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import os
import socket
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import anyio

from belayer_router._core._config import api_keys_from
from belayer_router._core._tokenizer import load_tokenizer
from belayer_router._errors import BelayerRouterError, ServerConfigError
from belayer_router._keeper import (
    add_keeper_flags,
    check_keeper_flags,
    health_check,
    keep_running,
    keeper_child_argv,
)
from belayer_router._server._app import RouterApp, RouterConfig
from belayer_router._server._serve import SERVERS, bind_socket, serve_asgi

__all__ = ["ExitCode", "main"]


class ExitCode(enum.IntEnum):
    """Exit codes shared by every Belayer command (root README, "One CLI contract")."""

    OK = 0
    FAILED = 1
    USAGE = 2
    UNHEALTHY = 3
    INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # argparse's is NoReturn too
        self.print_usage(sys.stderr)
        print(f"belayer-router: error: {message}", file=sys.stderr)
        sys.exit(ExitCode.USAGE)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="belayer-router", description="The token-level resume router of Belayer.")
    parser.add_argument("--debug", action="store_true", help="tracebacks for errors (or BELAYER_DEBUG=1)")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = commands.add_parser("serve", help="serve the router over HTTP until Ctrl-C / SIGTERM")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--admin-token",
        default=os.environ.get("BELAYER_ROUTER_ADMIN_TOKEN"),
        help="bearer token for the admin API (default: $BELAYER_ROUTER_ADMIN_TOKEN; none = open)",
    )
    serve.add_argument("--journal", type=Path, help="append-only journal file (persists prefixes)")
    serve.add_argument("--prefix-interval", type=int, default=256, help="tokens between preserved prefixes")
    serve.add_argument(
        "--resume-wait-s",
        "--resume-wait",
        dest="resume_wait_s",
        type=float,
        default=5.0,
        help="seconds a broken request waits for its slot's replacement",
    )
    serve.add_argument("--fsync", action="store_true", help="the same as --durability fsync")
    serve.add_argument(
        "--durability",
        choices=["none", "group", "fsync"],
        default="none",
        help="journal: flush per record (none), group commit every 10 ms (group), fsync per record",
    )
    serve.add_argument(
        "--tokenizer",
        help="'bytes', a tokenizer.json, or a tokenizer folder (with a chat template: chat API)",
    )
    serve.add_argument("--model-name", default="belayer", help="the model id /v1/models lists")
    serve.add_argument(
        "--api-key",
        nargs="+",
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $VLLM_API_KEY); "
        "the slots' admin token is accepted too",
    )
    serve.add_argument(
        "--seed", type=int, help="seed of requests that name none: same seed + same request, same tokens"
    )
    serve.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="413 past this")
    serve.add_argument("--max-prompt-tokens", type=int, default=131_072, help="400 past this")
    serve.add_argument("--log-level", default="warning")
    serve.add_argument(
        "--server",
        choices=list(SERVERS),
        default=os.environ.get("BELAYER_ROUTER_SERVER") or "uvicorn",
        help="HTTP server: uvicorn, or the router's own (belayer: streams with no per-token task "
        "switch); default $BELAYER_ROUTER_SERVER or uvicorn",
    )
    serve.add_argument(
        "--json", action="store_true", help='print {"url": ..., "pid": ...} once listening (each start)'
    )
    serve.add_argument(
        "--keep-running",
        action="store_true",
        help="run the router in a child process and start it again on its journal when it dies "
        "(SIGKILL, a crash); needs --journal. The listening socket stays open meanwhile",
    )
    add_keeper_flags(serve)
    serve.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # the keeper's socket
    serve.add_argument(
        "--loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="event loop: uvloop when installed (auto), or the standard asyncio loop",
    )
    return parser


def _use_uvloop(choice: str) -> bool:
    if choice == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401  (optional: pip install belayer-router[fast])
    except ImportError as error:
        if choice == "uvloop":
            raise _UsageError("--loop uvloop needs uvloop: pip install uvloop") from error
        return False
    return True


def _tune_gc() -> None:
    """Keep the cyclic garbage collector from pausing every stream of a busy router.

    With 1 024 streams the router holds tens of thousands of live objects, and the containers
    alive across an await at each young collection (a step's entries, pending writes) were
    promoted to the oldest generation many times a second: full collections ran about once a
    second, each pausing every stream for up to 100 ms (7 in a 7 s run; with this tuning one, of
    36 ms: session 9, measured with ``gc.callbacks`` on a loaded machine).
    So, for the ``serve`` process only: what start-up allocated (modules, the app) is frozen out
    of the collections, and the youngest generation is collected after 50 000 net container
    allocations instead of 700 (cycles are still collected, later; memory stays bounded).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 10)


def _keep(args: argparse.Namespace, raw: Sequence[str]) -> int:
    """`serve --keep-running`: bind once, then run `serve --listen-fd` children, restarted on death."""
    if args.journal is None:
        raise _UsageError(
            "--keep-running needs --journal: a restarted router knows its workers and resumes its "
            "requests only from its journal"
        )
    try:
        check_keeper_flags(args)
    except ServerConfigError as error:
        raise _UsageError(str(error)) from error
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as error:
        raise _UsageError(f"cannot listen on {args.host}:{args.port}: {error}") from error
    child = keeper_child_argv(raw)
    host, port = sock.getsockname()[:2]

    if not args.json:
        print(f"belayer-router keeping a router on http://{host}:{port}", file=sys.stderr, flush=True)
    argv = [sys.executable, "-m", "belayer_router", *child, "--listen-fd", str(sock.fileno())]
    with sock:
        return keep_running(
            argv,
            name="belayer-router",
            pass_fds=[sock.fileno()],
            max_restarts=args.max_restarts,
            check=health_check((host, port), args.hang_check_s) if args.hang_check_s > 0 else None,
            check_interval_s=args.hang_check_s or 5.0,
            check_misses=args.hang_misses,
        )


def _serve(args: argparse.Namespace) -> ExitCode:
    try:
        config = RouterConfig(
            admin_token=args.admin_token,
            journal_path=args.journal,
            prefix_interval=args.prefix_interval,
            resume_wait_s=args.resume_wait_s,
            fsync=args.fsync,
            durability=args.durability,
            tokenizer=None if args.tokenizer is None else load_tokenizer(args.tokenizer),
            model_name=args.model_name,
            max_body_bytes=args.max_body_bytes,
            max_prompt_tokens=args.max_prompt_tokens,
            api_keys=api_keys_from(args.api_key),
            seed=args.seed,
        )
    except ValueError as error:  # attrs validators: a flag out of range
        raise _UsageError(str(error)) from error
    use_uvloop = _use_uvloop(args.loop)
    app = RouterApp(config)
    try:
        if args.listen_fd is not None:  # a child of --keep-running: the keeper's socket
            sock = socket.socket(fileno=args.listen_fd)
        else:
            sock = bind_socket(args.host, args.port)
    except OSError as error:
        raise _UsageError(f"cannot listen on {args.host}:{args.port}: {error}") from error
    host, port = sock.getsockname()[:2]
    if args.json:
        print(json.dumps({"url": f"http://{host}:{port}", "pid": os.getpid()}), flush=True)
    else:
        print(f"belayer-router listening on http://{host}:{port}", file=sys.stderr, flush=True)
    _tune_gc()
    anyio.run(serve_asgi, app, sock, args.log_level, args.server, backend_options={"use_uvloop": use_uvloop})
    return ExitCode.INTERRUPTED  # the server returns only after Ctrl-C / SIGTERM, shut down cleanly


class _UsageError(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``belayer-router`` command; returns an `ExitCode`."""
    raw = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(raw)
    debug = args.debug or os.environ.get("BELAYER_DEBUG") == "1"
    try:
        if args.keep_running:
            return _keep(args, raw)
        return int(_serve(args))
    except (_UsageError, BelayerRouterError) as error:
        if debug:
            traceback.print_exc()
        print(f"belayer-router: error: {error}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
