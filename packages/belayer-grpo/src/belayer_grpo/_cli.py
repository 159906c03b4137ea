"""``belayer-grpo``: train with GRPO on the Belayer system, or print the effective configuration.

    belayer-grpo [--debug] train [--json] [--config FILE] [section.key=value ...]
    belayer-grpo [--debug] train [--json] --resume RUN_DIR [section.key=value ...]
    belayer-grpo [--debug] config [--json] [--config FILE] [section.key=value ...]
    belayer-grpo [--debug] bench [--json] [--config FILE] [--scale small|full] [--experiment NAME]
                                 [--quick] [--out DIR]

The root README's CLI contract: errors are one line, ``belayer-grpo: error: ...`` (a traceback
only with ``--debug`` or ``BELAYER_DEBUG=1``), exit codes are `ExitCode`'s, and ``--json`` prints
exactly one JSON document on stdout (the run's report, the configuration, the bench results).
``--resume RUN_DIR`` continues a run that died (even by SIGKILL) with its saved ``config.json``,
from its latest checkpoint and the samples its interrupted step had already finished.
Ctrl-C (SIGINT) or SIGTERM stops training cleanly: every worker, memory server and socket of the
run is removed before the command exits (`ExitCode.INTERRUPTED`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import traceback
from importlib.metadata import version
from pathlib import Path
from typing import Any

import anyio

from belayer_grpo._config import Config, load_config, load_run_config
from belayer_grpo._errors import BelayerGrpoError, ExitCode, GrpoConfigError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer-grpo", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors (or BELAYER_DEBUG=1)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version('belayer-grpo')}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("train", "run GRPO training"),
        ("config", "print the effective configuration as JSON"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--json", action="store_true", help="print one JSON document on stdout")
        command.add_argument("--config", help="a TOML or YAML file with sections (default: the embedded one)")
        command.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. algorithm.steps=10")
        if name == "train":
            command.add_argument(
                "--resume", metavar="RUN_DIR",
                help="continue the run in RUN_DIR with its config.json (overrides still apply)",
            )  # fmt: skip
    bench = commands.add_parser("bench", help="run the benchmark experiments and write a report")
    bench.add_argument("--config", help="a benchmark TOML layered over the scale's configuration")
    bench.add_argument("--scale", choices=("small", "full"), default=None, help="default: small (CPU)")
    bench.add_argument(
        "--experiment",
        action="append",
        help="overhead, worker-failure, env-failures, checkpoint-cost, build-recovery",
    )
    bench.add_argument("--quick", action="store_true", help="fewer repeats and steps (a few minutes)")
    bench.add_argument("--out", help="results folder (default: the configuration's results_dir)")
    bench.add_argument("--json", action="store_true", help="print the results as one JSON document")
    return parser


def _error(error: BaseException, debug: bool) -> None:
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    print(f"belayer-grpo: error: {error}", file=sys.stderr, flush=True)


def _bench(args: argparse.Namespace, argv: list[str], debug: bool) -> int:
    from belayer_grpo._bench import EXPERIMENTS, load_bench_config, quick_config, run_bench

    try:
        bench = load_bench_config(args.config, scale=args.scale)
        bench = quick_config(bench) if args.quick else bench
        out = Path(args.out or bench.results_dir)
        command = " ".join(["belayer-grpo", *argv])
        report = anyio.run(lambda: run_bench(bench, args.experiment or EXPERIMENTS, out, command=command,
                                             stream=sys.stderr))  # fmt: skip
    except GrpoConfigError as error:
        _error(error, debug)
        return ExitCode.USAGE
    except BelayerGrpoError as error:
        _error(error, debug)
        return ExitCode.FAILED
    if args.json:
        print((report.parent / "results.json").read_text())
    else:
        print(report)
    return ExitCode.OK


async def _train_until_signalled(config: Config) -> tuple[dict[str, Any] | None, bool]:
    from belayer_grpo._run import run_training

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
    """Entry point of the ``belayer-grpo`` command; returns an `ExitCode`."""
    args = _parser().parse_args(argv)
    debug = bool(args.debug or os.environ.get("BELAYER_DEBUG") == "1")
    logging.getLogger("uvicorn.error").addFilter(_QuietLifespanCancel())
    if args.command == "bench":
        return _bench(args, sys.argv[1:] if argv is None else argv, debug)
    try:
        if getattr(args, "resume", None):
            if args.config:
                raise GrpoConfigError(
                    "--config", "--resume uses the run's config.json; pass key=value instead"
                )
            config = load_run_config(args.resume, args.overrides)
        else:
            config = load_config(args.config, args.overrides)
    except BelayerGrpoError as error:
        _error(error, debug)
        return ExitCode.USAGE
    if args.command == "config":
        print(json.dumps(config.to_dict(), indent=None if args.json else 2))
        return ExitCode.OK
    try:
        result, interrupted = anyio.run(_train_until_signalled, config)
    except (BelayerGrpoError, BaseExceptionGroup) as error:
        ours = _our_errors(error)
        if not ours:
            raise
        for each in ours:
            _error(each, debug)
        return ExitCode.FAILED
    if args.json and result is not None:
        print(json.dumps(result, default=str))
    if interrupted:
        return ExitCode.INTERRUPTED
    return ExitCode.OK if result is not None and result.get("status") == "completed" else ExitCode.FAILED
