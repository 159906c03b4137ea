"""`belayer-shadow serve --keep-running`: the whole one-machine service started again when it dies.

`belayer-shadow serve` is one process (the router and the slot supervisors), so nothing of it can
restart it after a SIGKILL or find it hung. With `--keep-running` the command becomes a small
keeper (belayer-router's `keep_running`, the same as `belayer-router serve --keep-running` and
`belayer-shadow slot --keep-running`) that:

- binds the router's socket once and hands it to every `serve` child (`--listen-fd`): clients that
  connect while no child runs wait in its backlog instead of being refused;
- gives every child the same run folder and router journal, so a new router knows the workers,
  their epochs and the tokens already streamed, and resumes every request cut by the death;
- before starting a new child, waits until the dead one's guardians have reaped its slots
  (no `slots/*/processes.json` left); the new child restarts every slot from scratch on the
  weights the dead one kept after its last `/update_weights` (`adopt_kept_weights`), at their
  version, and its mains register at epoch + 1;
- finds a hung child (SIGSTOP, a stuck event loop) by `GET /health` on the kept socket, SIGKILLs
  it and starts a new one.

A run folder the keeper made (no `--run-dir`) is removed when it ends.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from belayer_shadow._serve._model_folder import ModelFolder

__all__ = ["keep_serve"]

_REAP_WAIT_S = 15.0
_START_TIMEOUT_S = 300.0


def keep_serve(args: argparse.Namespace, raw: Sequence[str]) -> int:
    """Run `serve` (the flags `raw`, less `--keep-running`) in a child, started again each time
    it dies or hangs; returns the last child's exit code. Raises belayer-router's
    `ServerConfigError` for bad keeper flags, a `ModelConfigError` for a bad model folder and
    `OSError` when the address cannot be bound."""
    from belayer_router import (
        bind_socket,
        check_keeper_flags,
        health_check,
        keep_running,
        keeper_child_argv,
    )

    check_keeper_flags(args)
    ModelFolder.inspect(args.model_dir)  # a bad folder: one typed error, nothing started
    temporary = args.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="belayer-serve-")) if temporary else Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Weights kept by an earlier service in this folder are not this one's to adopt.
    for stale in run_dir.glob("slots/*/kept-weights*"):
        shutil.rmtree(stale, ignore_errors=True)
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    child = keeper_child_argv(raw)
    child += ["--listen-fd", str(sock.fileno()), "--adopt-kept-weights"]
    if temporary:
        child += ["--run-dir", str(run_dir)]
    if args.journal is None:
        child += ["--journal", str(run_dir / "router.journal")]

    if not args.json:
        print(f"belayer-shadow keeping a service on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        with sock:
            return keep_running(
                [sys.executable, "-m", "belayer_shadow", *child],
                name="belayer-shadow serve",
                pass_fds=[sock.fileno()],
                max_restarts=args.max_restarts,
                before_restart=lambda: _wait_for_reaps(run_dir),
                check=health_check((host, port), args.hang_check_s) if args.hang_check_s > 0 else None,
                check_interval_s=args.hang_check_s or 5.0,
                check_misses=args.hang_misses,
                # The router answers /health as soon as it runs, before the slots; a child that
                # never does is counted as hung only after this (imports on a busy machine).
                start_timeout_s=_START_TIMEOUT_S,
            )
    finally:
        if temporary:
            _wait_for_reaps(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)


def _wait_for_reaps(run_dir: Path) -> None:
    """Wait until a dead service's guardians have reaped every slot (each removes its slot's
    `processes.json` last); a new one must not start beside its leftovers."""
    deadline = time.monotonic() + _REAP_WAIT_S
    while any(run_dir.glob("slots/*/processes.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
