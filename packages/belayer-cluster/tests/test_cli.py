"""The CLI contract without a cluster: usage errors are one line and exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "belayer_cluster", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_address_where_no_cluster_answers_is_a_usage_error() -> None:
    done = _run("status", "--address", f"127.0.0.1:{_free_port()}", "--connect-timeout-s", "5")
    assert done.returncode == 2
    assert done.stderr.startswith("belayer-cluster: error: no Ray cluster answers at 127.0.0.1:")
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""


def test_a_malformed_address_and_a_missing_flag_are_usage_errors() -> None:
    done = _run("status", "--address", "nohostport")
    assert done.returncode == 2
    assert (
        done.stderr.strip() == "belayer-cluster: error: the Ray address must be HOST:PORT (got 'nohostport')"
    )
    missing = _run("status")
    assert missing.returncode == 2
    assert missing.stderr.startswith(
        "belayer-cluster: error: the following arguments are required: --address"
    )


def test_debug_keeps_the_traceback() -> None:
    done = _run("--debug", "status", "--address", "nohostport")
    assert done.returncode != 0
    assert "Traceback" in done.stderr
    assert "ClusterConfigError" in done.stderr
