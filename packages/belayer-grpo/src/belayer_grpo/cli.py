"""``belayer-grpo``: train with GRPO on the Belayer system, or print the effective configuration.

    belayer-grpo train [--config FILE] [section.key=value ...]
    belayer-grpo config [--config FILE] [section.key=value ...]
    belayer-grpo bench [--config FILE] [--scale small|full] [--experiment NAME] [--quick] [--out DIR]

Ctrl-C (SIGINT) or SIGTERM stops training cleanly: every worker, memory server and socket of the
run is removed before the command exits (with status 130).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from belayer_grpo.config import Config, load_config
from belayer_grpo.errors import BelayerGrpoError

__all__ = ["main"]

EXIT_INTERRUPTED = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer-grpo", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "run GRPO training"),
        ("config", "print the effective configuration as JSON"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--config", help="a TOML or YAML file with sections (default: the embedded one)")
        command.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. algorithm.steps=10")
    bench = commands.add_parser("bench", help="run the benchmark experiments and write a report")
    bench.add_argument("--config", help="a benchmark TOML layered over the scale's configuration")
    bench.add_argument("--scale", choices=("small", "full"), default=None, help="default: small (CPU)")
    bench.add_argument(
        "--experiment", action="append", help="overhead, worker-failure, env-failures, checkpoint-cost"
    )
    bench.add_argument("--quick", action="store_true", help="fewer repeats and steps (a few minutes)")
    bench.add_argument("--out", help="results folder (default: the configuration's results_dir)")
    return parser


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from belayer_grpo.bench import EXPERIMENTS, load_bench_config, quick_config, run_bench

    try:
        bench = load_bench_config(args.config, scale=args.scale)
        bench = quick_config(bench) if args.quick else bench
        out = Path(args.out or bench.results_dir)
        command = " ".join(["belayer-grpo", *argv])
        report = anyio.run(lambda: run_bench(bench, args.experiment or EXPERIMENTS, out, command=command,
                                             stream=sys.stderr))  # fmt: skip
    except BelayerGrpoError as error:
        print(f"belayer-grpo: {error}", file=sys.stderr)
        return 2
    print(report)
    return 0


async def _train_until_signalled(config: Config) -> tuple[dict[str, Any] | None, bool]:
    from belayer_grpo.run import run_training

    interrupted = False
    result: dict[str, Any] | None = None
    async with anyio.create_task_group() as group:

        async def watch_signals() -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    interrupted = True
                    print(
                        f"\nbelayer-grpo: {signal.Signals(signum).name}: shutting down",
                        file=sys.stderr,
                        flush=True,
                    )
                    group.cancel_scope.cancel()
                    return

        async def train() -> None:
            nonlocal result
            result = await run_training(config, stream=sys.stderr)
            group.cancel_scope.cancel()

        group.start_soon(watch_signals)
        group.start_soon(train)
    return result, interrupted


def _our_errors(error: BaseException) -> list[BelayerGrpoError]:
    if isinstance(error, BelayerGrpoError):
        return [error]
    if isinstance(error, BaseExceptionGroup):
        found = [e for inner in error.exceptions for e in _our_errors(inner)]
        return found if len(found) == len(error.exceptions) else []
    return []


class _QuietLifespanCancel(logging.Filter):
    """uvicorn logs the in-process router's lifespan task being cancelled at shutdown as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.exc_info[0] if record.exc_info else None
        cancelled = kind is not None and kind.__name__ == "CancelledError"
        return not (cancelled and "lifespan" in record.getMessage())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``belayer-grpo`` command."""
    args = _parser().parse_args(argv)
    logging.getLogger("uvicorn.error").addFilter(_QuietLifespanCancel())
    if args.command == "bench":
        return _bench(args, sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(args.config, args.overrides)
    except BelayerGrpoError as error:
        print(f"belayer-grpo: {error}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    try:
        result, interrupted = anyio.run(_train_until_signalled, config)
    except (BelayerGrpoError, BaseExceptionGroup) as error:
        ours = _our_errors(error)
        if not ours:
            raise
        for each in ours:
            print(f"belayer-grpo: {each}", file=sys.stderr)
        return 1
    if interrupted:
        return EXIT_INTERRUPTED
    return 0 if result is not None and result.get("status") == "completed" else 1
