"""The root README's "One CLI contract", checked on every package's real command.

Each command runs as a subprocess (`python -m belayer_x`), the way a user runs it:

- a typed error is one line on stderr, ``belayer-x: error: <what to do>``, with no traceback, and
  the named exit code (`USAGE` for bad input that started nothing, `UNHEALTHY` for a failed probe);
- argparse's own usage errors exit with `USAGE` too;
- ``--json`` prints exactly one JSON document on stdout;
- a traceback comes only with ``--debug`` or ``BELAYER_DEBUG=1`` (exactly ``"1"``: ``0``, empty or
  any other value keep the one-line error), and the error line and exit code stay the same;
- a server stopped by SIGTERM exits `INTERRUPTED` (130).

Run from the repository root: ``nox -s cli_contract`` (or ``pytest tests`` with every package
installed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

OK, FAILED, USAGE, UNHEALTHY, INTERRUPTED = 0, 1, 2, 3, 130
PACKAGES = ("policy", "envckpt", "gpumem", "router", "shadow", "cluster", "grpo")
TIMEOUT_S = 120


def _run(
    package: str, argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "BELAYER_DEBUG"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", f"belayer_{package}", *argv],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def _error_lines(package: str, stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"belayer-{package}: error: ")]


@dataclass(frozen=True)
class Case:
    """A command of one package that fails with one of its typed errors."""

    package: str
    argv: Callable[[Path], list[str]]
    code: int
    says: str  # a piece of the error line
    debug_argv: Callable[[Path], list[str]] = field(default=lambda _: [])  # argv with --debug


def _shadow_bad_model(tmp: Path) -> list[str]:
    return [
        "worker",
        "--slot",
        "s0",
        "--router",
        "http://127.0.0.1:9",
        "--weights-socket",
        str(tmp / "w.sock"),
        "--kv-socket",
        str(tmp / "kv.sock"),
        "--heartbeat",
        str(tmp / "heartbeat"),
        "--model",
        str(tmp / "missing-config.json"),
    ]


ERRORS = [
    Case(
        "policy",
        lambda _: ["compare", "--policy", "adaptive", "--policy", "adaptive"],
        USAGE,
        "names a policy twice",
        lambda _: ["--debug", "compare", "--policy", "adaptive", "--policy", "adaptive"],
    ),
    Case(
        "envckpt",
        lambda t: ["verify", "--store", str(t / "store"), "--trajectory", "../up"],
        USAGE,
        "is unsafe",
        lambda t: ["verify", "--debug", "--store", str(t / "store"), "--trajectory", "../up"],
    ),
    Case(
        "gpumem",
        lambda t: ["ping", "--socket", str(t / "none.sock")],
        UNHEALTHY,
        "no memory server listens",
        lambda t: ["--debug", "ping", "--socket", str(t / "none.sock")],
    ),
    Case(
        "router",
        lambda _: ["serve", "--prefix-interval", "0"],
        USAGE,
        "prefix_interval",
        lambda _: ["--debug", "serve", "--prefix-interval", "0"],
    ),
    Case(
        "shadow",
        _shadow_bad_model,
        USAGE,
        "cannot read model configuration",
        lambda t: ["--debug", *_shadow_bad_model(t)],
    ),
    Case(
        "cluster",
        lambda _: ["status", "--address", "no-port"],
        USAGE,
        "HOST:PORT",
        lambda _: ["--debug", "status", "--address", "no-port"],
    ),
    Case(
        "grpo",
        lambda _: ["config", "algorithm.no_such_key=1"],
        USAGE,
        "unknown key",
        lambda _: ["--debug", "config", "algorithm.no_such_key=1"],
    ),
]


def test_every_package_is_checked() -> None:
    packages = sorted(
        p.name.removeprefix("belayer-") for p in (Path(__file__).parents[1] / "packages").glob("belayer-*")
    )
    assert sorted(PACKAGES) == packages
    assert sorted(c.package for c in ERRORS) == packages


@pytest.mark.parametrize("case", ERRORS, ids=[c.package for c in ERRORS])
@pytest.mark.parametrize("debug_env", [None, "0", "yes"])
def test_a_typed_error_is_one_line_and_a_named_exit_code(
    case: Case, debug_env: str | None, tmp_path: Path
) -> None:
    env = None if debug_env is None else {"BELAYER_DEBUG": debug_env}
    done = _run(case.package, case.argv(tmp_path), tmp_path, env)
    assert done.returncode == case.code, done.stderr
    lines = _error_lines(case.package, done.stderr)
    assert len(lines) == 1, done.stderr
    assert case.says in lines[0]
    assert done.stderr.strip().splitlines()[-1] == lines[0]  # the error line is the last word
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("case", ERRORS, ids=[c.package for c in ERRORS])
@pytest.mark.parametrize("how", ["BELAYER_DEBUG=1", "--debug"])
def test_debug_adds_the_traceback_and_keeps_line_and_code(case: Case, how: str, tmp_path: Path) -> None:
    if how == "--debug":
        done = _run(case.package, case.debug_argv(tmp_path), tmp_path)
    else:
        done = _run(case.package, case.argv(tmp_path), tmp_path, {"BELAYER_DEBUG": "1"})
    assert done.returncode == case.code, done.stderr
    assert "Traceback (most recent call last)" in done.stderr
    lines = _error_lines(case.package, done.stderr)
    assert len(lines) == 1, done.stderr
    assert case.says in lines[0]
    assert done.stderr.strip().splitlines()[-1] == lines[0]


@pytest.mark.parametrize("package", PACKAGES)
def test_a_usage_error_of_argparse_exits_usage(package: str, tmp_path: Path) -> None:
    done = _run(package, ["--no-such-flag"], tmp_path)
    assert done.returncode == USAGE
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"belayer-{package}"), done.stderr
    assert ": error: " in last
    assert "Traceback" not in done.stderr


JSON_COMMANDS: dict[str, Callable[[Path], list[str]]] = {
    "policy": lambda _: ["compare", "--runs", "1", "--trajectories", "2", "--steps", "3", "--json"],
    "envckpt": lambda t: ["ls", "--store", str(t / "store"), "--json"],
    "shadow": lambda t: ["reap", "--run-dir", str(t / "run"), "--json"],
    "cluster": lambda _: ["scale", "--gpus", "1024", "--days", "1", "--reps", "1", "--json"],
    "grpo": lambda _: ["config", "--json"],
}


@pytest.mark.parametrize("package", sorted(JSON_COMMANDS))
def test_json_prints_exactly_one_document(package: str, tmp_path: Path) -> None:
    done = _run(package, JSON_COMMANDS[package](tmp_path), tmp_path)
    assert done.returncode == OK, done.stderr
    document = json.loads(done.stdout)  # one document, nothing else on stdout
    assert isinstance(document, dict | list)
    assert document


def test_envckpt_json_error_is_one_document_too(tmp_path: Path) -> None:
    done = _run("envckpt", [*ERRORS[1].argv(tmp_path), "--json"], tmp_path)
    assert done.returncode == USAGE
    assert json.loads(done.stdout)["error"] == "InvalidIdError"


@contextmanager
def _server(package: str, argv: list[str], cwd: Path) -> Iterator[subprocess.Popen[str]]:
    environ = {k: v for k, v in os.environ.items() if k != "BELAYER_DEBUG"}
    process = subprocess.Popen(
        [sys.executable, "-m", f"belayer_{package}", *argv],
        cwd=cwd,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=TIMEOUT_S)


def _wait_for(ready: Callable[[], bool], process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ready():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.1)


def test_gpumem_json_replies_and_sigterm_exits_interrupted(tmp_path: Path) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"tensors": [{"name": "w", "dtype": "float32", "shape": [4, 4]}]}))
    sock, ready = tmp_path / "run" / "weights.sock", tmp_path / "ready"
    argv = [
        "serve",
        "--kind",
        "weights",
        "--socket",
        str(sock),
        "--layout",
        str(layout),
        "--ready-file",
        str(ready),
    ]
    with _server("gpumem", argv, tmp_path) as server:
        _wait_for(ready.exists, server)
        for command in ("ping", "describe"):
            done = _run("gpumem", [command, "--socket", str(sock), "--json"], tmp_path)
            assert done.returncode == OK, done.stderr
            assert json.loads(done.stdout)["ok"] is True
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=TIMEOUT_S) == INTERRUPTED
    assert not sock.exists()


def test_router_json_url_and_sigterm_exits_interrupted(tmp_path: Path) -> None:
    with _server("router", ["serve", "--port", "0", "--json"], tmp_path) as server:
        assert server.stdout is not None
        url = json.loads(server.stdout.readline())["url"]  # the one document, once listening

        def answers() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    return bool(reply.status == 200)
            except OSError:
                return False

        _wait_for(answers, server)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=TIMEOUT_S) == INTERRUPTED
        assert server.stdout.read() == ""  # nothing but the one document
