"""`keep_running` stops for real: a SIGTERM that arrives while a child starts reaches that child,
and a child that does not end after the signal (it ignores SIGTERM) is SIGKILLed after the grace.

Real processes: the keeper runs in this test's main thread (signal handlers need it) and its
children are real Python processes; the signal is a real SIGTERM sent to this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from belayer_router import keep_running

pytestmark = pytest.mark.timeout(120)

# Ignores SIGTERM, says it is ready (a file), then sleeps 20 s and exits 0: without the grace's
# SIGKILL the keeper returns 0 after 20 s, with it 128 + SIGKILL.
_STUBBORN = (
    "import signal, sys, time, pathlib\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "pathlib.Path(sys.argv[1]).write_text('ready')\n"
    "time.sleep(20)\n"
)


def _term_self_when(ready: Path) -> threading.Thread:
    def run() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("with_check", [False, True], ids=["no-check", "check"])
def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path, capfd, with_check):
    ready = tmp_path / "ready"
    thread = _term_self_when(ready)
    code = keep_running(
        [sys.executable, "-c", _STUBBORN, str(ready)],
        name="keeper",
        check=(lambda: True) if with_check else None,
        check_interval_s=0.2,
        stop_grace_s=1.0,
    )
    thread.join()
    assert code == 128 + signal.SIGKILL
    assert "did not end 1 s after SIGTERM; killing it" in capfd.readouterr().err


def test_a_sigterm_while_the_child_starts_reaches_the_new_child(tmp_path, monkeypatch):
    # The SIGTERM lands just before Popen starts the first child (none to pass it on to yet).
    real_popen = subprocess.Popen
    started: list[int] = []

    def popen_after_a_signal(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        os.kill(os.getpid(), signal.SIGTERM)
        child = real_popen(*args, **kwargs)
        started.append(child.pid)
        return child

    monkeypatch.setattr(subprocess, "Popen", popen_after_a_signal)
    code = keep_running(
        [sys.executable, "-c", "import time; time.sleep(20)"],
        name="keeper",
        stop_grace_s=30.0,
    )
    assert len(started) == 1  # not restarted
    assert code == 128 + signal.SIGTERM  # the new child got the SIGTERM (it would exit 0 after 20 s)


def test_a_negative_grace_is_refused():
    with pytest.raises(ValueError, match="stop_grace_s >= 0"):
        keep_running(["true"], name="keeper", stop_grace_s=-1)
