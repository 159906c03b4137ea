"""`belayer-shadow serve | worker | shadow | slot | reap`: a whole rollout service on one machine,
the workers, the slot supervisor, the reaper.

The CLI contract of the root README: one error line `belayer-shadow: error: ...` on stderr (a
traceback only with `--debug` or `BELAYER_DEBUG=1`), named exit codes (`ExitCode`), `--json` on
the commands that report something (`slot`, `reap`), `python -m belayer_shadow`.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

__all__ = ["ExitCode", "main"]


class ExitCode(enum.IntEnum):
    """The exit codes every Belayer command shares (root README, "One CLI contract")."""

    OK = 0
    FAILED = 1  # the command ran and failed
    USAGE = 2  # bad arguments or configuration: nothing was started
    UNHEALTHY = 3  # a check found a problem (a failed handover: the slot is unhealthy)
    INTERRUPTED = 130  # SIGINT or SIGTERM: stopped cleanly


def _worker_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--slot", required=True, help="the engine slot this worker serves")
    parser.add_argument("--router", required=True, help="the router's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--admin-token",
        default=os.environ.get("BELAYER_ROUTER_ADMIN_TOKEN"),
        help="the router's admin token (default: $BELAYER_ROUTER_ADMIN_TOKEN)",
    )
    parser.add_argument("--weights-socket", type=Path, required=True, help="the weight server's socket")
    parser.add_argument("--kv-socket", type=Path, required=True, help="the KV server's socket")
    parser.add_argument("--heartbeat", type=Path, required=True, help="the slot's heartbeat file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument(
        "--model", type=Path, help="model config.json (or HF folder); default: the built-in model"
    )
    parser.add_argument("--epoch", type=int, help="epoch to register (default: the slot's highest + 1)")
    parser.add_argument("--event-log", type=Path, help="JSON-lines event log to append to")
    parser.add_argument("--state-file", type=Path, help="where to publish standby/handover/serving/failed")
    parser.add_argument("--resume-mode", choices=("continue", "regenerate"), default="continue")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--engine", choices=("belayer", "vllm"), default="belayer", help="vllm: needs belayer-shadow[vllm]"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="belayer-shadow", description=__doc__)
    parser.add_argument(
        "--debug",
        action="store_true",
        default=os.environ.get("BELAYER_DEBUG") == "1",
        help="print tracebacks of errors (also BELAYER_DEBUG=1)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    worker = commands.add_parser("worker", help="serve the engine as the slot's main worker")
    _worker_flags(worker)
    shadow = commands.add_parser("shadow", help="stand by beside the main worker, take over when it fails")
    _worker_flags(shadow)
    shadow.add_argument(
        "--handover-flag", type=Path, required=True, help="file whose creation means: take over"
    )
    shadow.add_argument("--poll-s", type=float, default=0.05, help="heartbeat / flag poll interval")
    shadow.add_argument("--stale-s", type=float, default=0.5, help="heartbeat age that counts as a hang")
    shadow.add_argument("--scratch-bytes", type=int, default=16 * 1024 * 1024)
    shadow.add_argument(
        "--alive-file", type=Path, help="touched at every standby poll (the supervisor watches it)"
    )
    slot = commands.add_parser("slot", help="run one slot: memory servers, main worker, shadow, recovery")
    slot.add_argument("--slot", required=True)
    slot.add_argument("--router", required=True)
    slot.add_argument("--admin-token", default=os.environ.get("BELAYER_ROUTER_ADMIN_TOKEN"))
    slot.add_argument("--run-dir", type=Path, required=True, help="sockets, heartbeat, logs and events.jsonl")
    slot.add_argument("--model", type=Path, help="model config.json; default: the built-in model")
    slot.add_argument("--weights", type=Path, help="safetensors checkpoint; default: a seeded init")
    slot.add_argument("--seed", type=int, default=0, help="seed of the init when --weights is not given")
    slot.add_argument(
        "--recovery",
        choices=("shadow", "conventional", "restart"),
        default="shadow",
        help="shadow: handover; conventional / restart: the restart baselines (README)",
    )
    slot.add_argument(
        "--backend", choices=("host", "cuda"), default="host", help="where the memory servers allocate"
    )
    slot.add_argument("--device", type=int, default=0, help="CUDA device of the cuda backend")
    slot.add_argument(
        "--engine", choices=("belayer", "vllm"), default="belayer", help="vllm: needs belayer-shadow[vllm]"
    )
    slot.add_argument("--num-kv-blocks", type=int, default=512)
    slot.add_argument("--block-size", type=int, default=16)
    slot.add_argument("--failure-window-s", type=float, default=60.0)
    slot.add_argument("--health-interval-s", type=float, default=10.0, help="conventional: probe interval")
    slot.add_argument("--health-misses", type=int, default=3, help="conventional: misses before a restart")
    slot.add_argument("--json", action="store_true", help="report the serving slot as one JSON document")
    slot.add_argument(
        "--keep-running",
        action="store_true",
        help="run the supervisor in a child process and start it again when it dies (SIGKILL, a "
        "crash): the new one reaps what is left, restarts the slot from scratch, registers at epoch + 1",
    )
    slot.add_argument("--max-restarts", type=int, default=5, help="--keep-running: restarts per 300 s")
    _serve_parser(commands)
    reap = commands.add_parser("reap", help="kill what an earlier killed slot left in a run folder")
    reap.add_argument("--run-dir", type=Path, required=True, help="the slot's run folder (processes.json)")
    reap.add_argument("--json", action="store_true", help="report as one JSON document")
    return parser


def _serve_parser(commands: Any) -> None:
    from belayer_router import add_keeper_flags
    from belayer_shadow._serve._flags import add_serve_flags

    serve = commands.add_parser(
        "serve",
        help="serve a model folder on this machine: the router and N slots, until Ctrl-C / SIGTERM",
    )
    add_serve_flags(serve)
    serve.add_argument("--run-dir", type=Path, help="sockets, logs and events (default: a temporary one)")
    serve.add_argument("--backend", choices=("host", "cuda"), default="host", help="cuda: slot i on GPU i")
    serve.add_argument(
        "--journal", type=Path, help="the router's journal: a router started again on it resumes cut requests"
    )
    serve.add_argument(
        "--keep-running",
        action="store_true",
        help="start the service again when it dies or hangs (a keeper holds the socket; needs no flag else)",
    )
    add_keeper_flags(serve)
    # Set by the keeper for its children: its socket, and the weights the previous child kept.
    serve.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--adopt-kept-weights", action="store_true", help=argparse.SUPPRESS)


def _run_serve(args: argparse.Namespace, raw: list[str]) -> int:
    import anyio

    from belayer_shadow._serve._flags import serve_config_from_flags

    if args.keep_running:
        from belayer_shadow._serve._keep import keep_serve

        return keep_serve(args, raw)
    config = serve_config_from_flags(
        args,
        run_dir=args.run_dir,
        backend=args.backend,
        journal=args.journal,
        adopt_kept_weights=args.adopt_kept_weights,
    )
    return anyio.run(_serve, args, config)


async def _serve(args: argparse.Namespace, config: object) -> int:
    import anyio

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            await _serve_until_signal(args, config, signals)
        except BaseExceptionGroup as group:  # one failure inside the task group: raise it as such
            errors = group.exceptions
            while len(errors) == 1 and isinstance(errors[0], BaseExceptionGroup):
                errors = errors[0].exceptions
            if len(errors) == 1:
                raise errors[0] from None
            raise
    return ExitCode.INTERRUPTED


async def _serve_until_signal(args: argparse.Namespace, config: Any, signals: Any) -> None:
    import anyio

    from belayer_shadow._serve._service import RolloutService

    async def stop_on_signal(scope: anyio.CancelScope) -> None:
        async for _ in signals:
            scope.cancel()
            return

    async with anyio.create_task_group() as group:
        group.start_soon(stop_on_signal, group.cancel_scope)
        # Cancelled at a signal (also while starting); the service stops every slot shielded.
        # A child of `serve --keep-running`: the router serves on the keeper's socket.
        sock = None if args.listen_fd is None else socket.socket(fileno=args.listen_fd)
        async with RolloutService.start(config, sock=sock) as service:
            document = {
                "url": service.url,
                "openai_base_url": service.openai_base_url,
                "model": config.model_name,
                "slots": [s.config.slot for s in service.slots],
                "run_dir": str(service.run_dir),
                "pid": os.getpid(),
            }
            _report(args, document, f"belayer-shadow serving {config.model_name} at {service.url}")
            await anyio.sleep_forever()


def _report(args: argparse.Namespace, document: dict[str, Any], line: str) -> None:
    print(json.dumps(document) if args.json else line, flush=True)


def _worker_config(args: argparse.Namespace) -> object:
    from belayer_shadow._workers._worker import WorkerConfig

    return WorkerConfig(
        slot=args.slot,
        router_url=args.router,
        admin_token=args.admin_token,
        weights_socket=args.weights_socket,
        kv_socket=args.kv_socket,
        heartbeat=args.heartbeat,
        host=args.host,
        port=args.port,
        model=args.model,
        epoch=args.epoch,
        event_log=args.event_log,
        state_file=args.state_file,
        resume_mode=args.resume_mode,
        max_num_seqs=args.max_num_seqs,
        num_threads=args.num_threads,
        engine=args.engine,
    )


def _keep_slot(args: argparse.Namespace, raw: list[str]) -> int:
    """`slot --keep-running`: the supervisor in a child, started again (belayer-router's
    `keep_running`) each time it dies; the dead one's guardian finishes its reap first."""
    from belayer_router import keep_running, keeper_child_argv
    from belayer_shadow._workers._processes import PROCESSES_FILE

    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    table = Path(args.run_dir) / PROCESSES_FILE

    def after_the_guardian() -> None:
        # The dead supervisor's guardian reaps its children, then removes processes.json; the new
        # supervisor must not start before that (the removal would take its own table).
        deadline = time.monotonic() + 10.0
        while table.exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    argv = [sys.executable, "-m", "belayer_shadow", *keeper_child_argv(raw)]
    return keep_running(
        argv, name="belayer-shadow", max_restarts=args.max_restarts, before_restart=after_the_guardian
    )


def _run_slot(args: argparse.Namespace) -> int:
    from belayer_shadow._workers._slot import SlotConfig, SlotSupervisor

    config = SlotConfig(
        slot=args.slot,
        router_url=args.router,
        run_dir=args.run_dir,
        admin_token=args.admin_token,
        model=args.model,
        weights=args.weights,
        seed=args.seed,
        recovery=args.recovery,
        backend=args.backend,
        device=args.device,
        engine=args.engine,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        failure_window_s=args.failure_window_s,
        health_interval_s=args.health_interval_s,
        health_misses=args.health_misses,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor = SlotSupervisor(config)
    supervisor.start()
    report = {"slot": config.slot, "url": supervisor.main_url, "epoch": supervisor.epoch, "pid": os.getpid()}
    report |= {"run_dir": str(config.run_dir), "recovery": config.recovery}
    _report(args, report, f"belayer-shadow slot {config.slot} serving at {supervisor.main_url}")
    try:
        stop.wait()
    finally:
        supervisor.stop()
    return ExitCode.INTERRUPTED


def _run_reap(args: argparse.Namespace) -> int:
    from belayer_shadow._workers._processes import reap_stale_processes

    killed = reap_stale_processes(args.run_dir)
    _report(
        args, {"run_dir": str(args.run_dir), "killed": killed}, f"killed {len(killed)} processes {killed}"
    )
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `belayer-shadow` command."""
    raw = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(raw)
    from belayer_gpumem import BelayerGpumemError
    from belayer_router import BelayerRouterError
    from belayer_shadow._errors import BelayerShadowError, HandoverError, SupervisorError, WorkerError

    try:
        if args.command == "slot" and args.keep_running:
            return _keep_slot(args, raw)
        if args.command == "slot":
            return _run_slot(args)
        if args.command == "serve":
            return _run_serve(args, raw)
        if args.command == "reap":
            return _run_reap(args)
        if getattr(args, "engine", None) == "vllm":  # before transformers is imported (`_media`)
            from belayer_shadow._vllm._media import set_aside_unloadable_media

            set_aside_unloadable_media()
        from belayer_shadow._workers._shadow import ShadowConfig, run_shadow
        from belayer_shadow._workers._worker import WorkerConfig, run_worker

        worker = _worker_config(args)
        assert isinstance(worker, WorkerConfig)
        if args.command == "worker":
            run_worker(worker)
            return ExitCode.INTERRUPTED  # it serves until SIGTERM / SIGINT
        shadow = ShadowConfig(
            worker=worker,
            handover_flag=args.handover_flag,
            poll_s=args.poll_s,
            stale_s=args.stale_s,
            scratch_bytes=args.scratch_bytes,
            alive_file=args.alive_file,
        )
        return run_shadow(shadow)
    except (BelayerShadowError, BelayerGpumemError, BelayerRouterError, ValueError, OSError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"belayer-shadow: error: {exc}", file=sys.stderr)
        # A worker that started and then failed (registration, supervision, handover) ran; the
        # rest is bad input found before anything was started: a config, a model, a socket path.
        return (
            ExitCode.FAILED
            if isinstance(exc, (WorkerError, SupervisorError, HandoverError))
            else ExitCode.USAGE
        )


if __name__ == "__main__":
    sys.exit(main())
