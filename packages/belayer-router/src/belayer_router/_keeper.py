"""`keep_running`: a small parent process that starts a server process again when it dies.

A SIGKILLed process cannot restart itself: another process has to. `keep_running(argv)` is that
process for `belayer-router serve --keep-running` (and belayer-shadow's `slot --keep-running`):

- it starts `argv` as its child, which dies with it (`PR_SET_PDEATHSIG` = SIGKILL), so a killed
  keeper leaves no server behind;
- when the child ends by a signal or with an exit code not in `final_codes` (a crash, a failure),
  it starts it again, up to `max_restarts` times within `window_s`; then it gives up and returns
  the child's code (a child that cannot start is not restarted forever);
- SIGTERM and SIGINT are passed on to the child and end the keeping: the child's exit code is
  returned; one that arrives while a child is being started reaches that new child; a child that
  has not ended `stop_grace_s` after the signal (it ignores it, it is stopped or hung) is SIGKILLed;
- `pass_fds` go to every child: a listening socket the keeper bound once stays open across
  restarts, so a client that connects while no child runs waits in its backlog instead of being
  refused;
- `check` (optional) finds a child that hangs (SIGSTOP, a stuck event loop), which no exit
  reveals: it is called every `check_interval_s` and should return False (or raise) when the child
  does not answer in time; after `check_misses` such calls in a row the child is SIGKILLed and
  started again like any dead one. A child counts misses only once a check has passed (it may be
  starting) or after `start_timeout_s`; until its first pass it is checked every 0.2 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import deque
from collections.abc import Callable, Collection, Sequence
from types import FrameType
from typing import TYPE_CHECKING

from belayer_router._errors import ServerConfigError

if TYPE_CHECKING:
    import argparse

__all__ = ["add_keeper_flags", "check_keeper_flags", "health_check", "keep_running", "keeper_child_argv"]

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)
# 0 OK, 2 USAGE (bad arguments: the same again), 3 UNHEALTHY (a failed device), 130 INTERRUPTED.
_FINAL_CODES = frozenset({0, 2, 3, 130})
_FIRST_CHECK_S = 0.2  # how often a child is checked until it first answers
_POLL_S = 0.5


def _die_with(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the keeper died between fork and prctl
            os._exit(1)

    return preexec


def keep_running(
    argv: Sequence[str],
    *,
    name: str,
    pass_fds: Sequence[int] = (),
    max_restarts: int = 5,
    window_s: float = 300.0,
    final_codes: Collection[int] = _FINAL_CODES,
    before_restart: Callable[[], None] | None = None,
    check: Callable[[], bool] | None = None,
    check_interval_s: float = 5.0,
    check_misses: int = 3,
    start_timeout_s: float = 120.0,
    stop_grace_s: float = 30.0,
) -> int:
    """Run `argv` and start it again each time it dies (see the module); returns its last exit
    code (a signal N as 128 + N). `name` prefixes the one line written to stderr per restart;
    `before_restart` runs before each restart (e.g. to wait for the dead child's leftovers)."""
    if max_restarts < 0 or window_s <= 0 or check_interval_s <= 0 or check_misses < 1 or stop_grace_s < 0:
        raise ValueError(
            "max_restarts must be >= 0, window_s and check_interval_s > 0, check_misses >= 1, "
            f"stop_grace_s >= 0; got {max_restarts}, {window_s}, {check_interval_s}, {check_misses}, "
            f"{stop_grace_s}"
        )
    stopping: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    restarts: deque[float] = deque()
    try:
        while True:
            child = subprocess.Popen(list(argv), pass_fds=tuple(pass_fds), preexec_fn=_die_with(os.getpid()))
            if stopping:  # a signal while it started went to the old child (or none): pass it on
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(stopping[-1])
            code = _wait(
                child, name, check, check_interval_s, check_misses, start_timeout_s, stopping, stop_grace_s
            )
            code = 128 - code if code < 0 else code
            if stopping or code in final_codes:
                return code
            now = time.monotonic()
            while restarts and now - restarts[0] > window_s:
                restarts.popleft()
            if len(restarts) >= max_restarts:
                print(
                    f"{name}: the server (pid {child.pid}) ended with {_describe(code)}; "
                    f"{max_restarts} restarts within {window_s:g} s already, giving up",
                    file=sys.stderr,
                    flush=True,
                )
                return code
            restarts.append(now)
            print(
                f"{name}: the server (pid {child.pid}) ended with {_describe(code)}; starting it "
                f"again ({len(restarts)} of {max_restarts} restarts within {window_s:g} s)",
                file=sys.stderr,
                flush=True,
            )
            if before_restart is not None:
                before_restart()
            if stopping:
                return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(
    child: subprocess.Popen[bytes],
    name: str,
    check: Callable[[], bool] | None,
    interval_s: float,
    misses: int,
    start_timeout_s: float,
    stopping: list[int],
    grace_s: float,
) -> int:
    """Wait for `child` to end; SIGKILL it first if `check` fails `misses` times in a row, or
    when it has not ended `grace_s` after `stopping` got a signal (checks stop then)."""
    started, passed, missed = time.monotonic(), False, 0
    deadline: float | None = None
    while True:
        if stopping and deadline is None:
            deadline = time.monotonic() + grace_s
        # without a check, poll anyway: a signal's handler runs between waits, not inside one
        timeout = interval_s if check is not None else _POLL_S
        if check is not None and not passed:
            # Until a first check passes, misses do not count (the child may be starting): check
            # often then, so that a child which hangs soon after its start (on a loaded machine,
            # before a check every interval_s would have seen it answer) is not given start_timeout_s.
            timeout = min(timeout, _FIRST_CHECK_S)
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline - time.monotonic()))
        try:
            return child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        if deadline is not None:
            if time.monotonic() < deadline:
                continue  # the signal passed on: it is shutting down, not hung
            print(
                f"{name}: the server (pid {child.pid}) did not end {grace_s:g} s after "
                f"{signal.Signals(stopping[-1]).name}; killing it",
                file=sys.stderr,
                flush=True,
            )
            child.kill()
            return child.wait()
        if check is None:
            continue
        try:
            ok = check()
        except Exception:  # the check's own failure (a timeout, a refused connection) is a miss
            ok = False
        if ok:
            passed, missed = True, 0
            continue
        if not passed and time.monotonic() - started < start_timeout_s:
            continue
        missed += 1
        if missed >= misses:
            print(
                f"{name}: the server (pid {child.pid}) did not answer {missed} checks in a row "
                f"({interval_s:g} s apart); killing it",
                file=sys.stderr,
                flush=True,
            )
            child.kill()  # SIGKILL ends a stopped process too


def _describe(code: int) -> str:
    if code > 128:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(code - 128).name}"
    return f"exit code {code}"


def add_keeper_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a command's keeper, the same wherever `--keep-running` is offered:
    `--max-restarts`, `--hang-check-s`, `--hang-misses` (`--keep-running` itself says its own help)."""
    parser.add_argument("--max-restarts", type=int, default=5, help="--keep-running: restarts per 300 s")
    parser.add_argument(
        "--hang-check-s",
        type=float,
        default=5.0,
        help="--keep-running: GET /health this often, each waiting as long (0: no check)",
    )
    parser.add_argument(
        "--hang-misses", type=int, default=3, help="--keep-running: unanswered checks that mean a hang"
    )


def check_keeper_flags(args: argparse.Namespace) -> None:
    """Raise `ServerConfigError` for keeper flags out of range (`add_keeper_flags`)."""
    if args.max_restarts < 0 or args.hang_check_s < 0 or args.hang_misses < 1:
        raise ServerConfigError(
            "--max-restarts and --hang-check-s must be 0 or more and --hang-misses 1 or more, got "
            f"{args.max_restarts}, {args.hang_check_s}, {args.hang_misses}"
        )


def health_check(address: tuple[str, int], timeout_s: float) -> Callable[[], bool]:
    """A `check` for `keep_running`: `GET /health` on the keeper's own socket `address`, answered
    200 within `timeout_s`. A stopped server's socket still accepts (the backlog), so a hang shows
    as no reply in time (an exception, counted as a miss)."""
    host, port = address
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    url = f"http://{f'[{reach}]' if ':' in reach else reach}:{port}/health"

    def answers() -> bool:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return bool(response.status == 200)

    return answers


def keeper_child_argv(raw: Sequence[str], flag: str = "--keep-running") -> list[str]:
    """The command line `raw` less `flag` for a keeper's child, however `flag` was abbreviated:
    argparse takes any unambiguous prefix (`--keep`) as the flag, and a child still given one would
    be a keeper itself, whose child would be one again, without end."""
    return [arg for arg in raw if not (len(arg) > 2 and arg.startswith("--") and flag.startswith(arg))]
