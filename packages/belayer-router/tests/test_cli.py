"""The command line keeps the root README's CLI contract."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

import belayer_router
from belayer_router import ExitCode, ServerConfigError, add_keeper_flags, check_keeper_flags


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "belayer_router", *args], capture_output=True, text=True, timeout=120
    )


def test_version_comes_from_the_package_metadata() -> None:
    assert belayer_router.__version__ == version("belayer-router")


def test_a_bad_flag_is_a_usage_error_on_one_line() -> None:
    result = run_cli("serve", "--port", "not-a-port")
    assert result.returncode == ExitCode.USAGE
    assert "belayer-router: error: argument --port" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_missing_tokenizer_is_a_usage_error_that_says_what_to_give(tmp_path: object) -> None:
    result = run_cli("serve", "--port", "0", "--tokenizer", "/nonexistent/tokenizer")
    assert result.returncode == ExitCode.USAGE
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("belayer-router: error: tokenizer '/nonexistent/tokenizer'")
    assert "tokenizer folder" in last
    assert "Traceback" not in result.stderr


def test_keeper_flags_out_of_range_are_a_typed_error_and_a_usage_error(tmp_path: object) -> None:
    # Typed: belayer-shadow's `serve --keep-running` checks the same flags across the package edge.
    parser = argparse.ArgumentParser()
    add_keeper_flags(parser)
    with pytest.raises(ServerConfigError, match="--hang-misses 1 or more"):
        check_keeper_flags(parser.parse_args(["--hang-misses", "0"]))
    check_keeper_flags(parser.parse_args([]))  # the defaults pass
    result = run_cli(
        "serve", "--port", "0", "--keep-running", "--journal", f"{tmp_path}/j", "--max-restarts", "-1"
    )
    assert result.returncode == ExitCode.USAGE
    assert "belayer-router: error: --max-restarts" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_adds_the_traceback() -> None:
    result = run_cli("--debug", "serve", "--port", "0", "--prefix-interval", "0")
    assert result.returncode == ExitCode.USAGE
    assert "Traceback" in result.stderr
    assert "belayer-router: error:" in result.stderr


def test_serve_tunes_the_garbage_collector_of_its_own_process_only() -> None:
    # In a child process: `_tune_gc` freezes what start-up allocated and raises the youngest
    # generation's threshold (a full collection paused every stream of a 1 024-stream router).
    code = (
        "import gc\n"
        "from belayer_router import _cli\n"
        "before = gc.get_threshold()\n"
        "_cli._tune_gc()\n"
        "print(before[0], gc.get_threshold()[0], gc.get_freeze_count() > 1000)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    default, tuned, frozen = result.stdout.split()
    assert int(default) < int(tuned) == 50_000
    assert frozen == "True"
