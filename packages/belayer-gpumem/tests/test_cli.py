"""`belayer-gpumem` / `python -m belayer_gpumem` under the CLI contract of the root README."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import belayer_gpumem
from belayer_gpumem import ExitCode, ServerProcess


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "belayer_gpumem", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_version_comes_from_the_package_metadata() -> None:
    assert belayer_gpumem.__version__ == importlib.metadata.version("belayer-gpumem")


def test_ping_json_prints_one_document(weights_server: ServerProcess) -> None:
    done = _cli("ping", "--socket", str(weights_server.config.socket), "--json")
    assert done.returncode == ExitCode.OK, done.stderr
    reply = json.loads(done.stdout)
    assert reply["pid"] == weights_server.pid
    assert reply["kind"] == "weights"


def test_describe_without_json_prints_key_value_lines(weights_server: ServerProcess) -> None:
    done = _cli("describe", "--socket", str(weights_server.config.socket))
    assert done.returncode == ExitCode.OK, done.stderr
    assert "kind: weights" in done.stdout.splitlines()
    assert "version: 1" in done.stdout.splitlines()


def test_ping_of_a_missing_server_is_unhealthy_with_one_error_line(tmp_path: Path) -> None:
    done = _cli("ping", "--socket", str(tmp_path / "nobody.sock"), "--json")
    assert done.returncode == ExitCode.UNHEALTHY
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("belayer-gpumem: error: no memory server listens on")


def test_debug_adds_the_traceback(tmp_path: Path) -> None:
    done = _cli("--debug", "ping", "--socket", str(tmp_path / "nobody.sock"))
    assert done.returncode == ExitCode.UNHEALTHY
    assert "Traceback" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("belayer-gpumem: error:")


def test_a_bad_layout_file_is_a_usage_error(tmp_path: Path) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text("{not json")
    done = _cli(
        "serve", "--kind", "weights", "--socket", str(tmp_path / "run" / "w.sock"), "--layout", str(layout)
    )
    assert done.returncode == ExitCode.USAGE
    assert done.stderr.startswith("belayer-gpumem: error: layout file")
    assert "Traceback" not in done.stderr


def test_bad_arguments_exit_with_usage(tmp_path: Path) -> None:
    done = _cli("serve", "--kind", "nonsense", "--socket", str(tmp_path / "s"))
    assert done.returncode == ExitCode.USAGE


def test_serving_on_an_unavailable_cuda_backend_fails_with_one_typed_line(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        return  # the backend is available here; tests/test_gpu.py covers it
    done = _cli("serve", "--kind", "kv", "--socket", str(tmp_path / "run" / "kv.sock"), "--backend", "cuda",
                "--num-blocks", "4", "--num-layers", "1", "--block-size", "4", "--num-kv-heads", "1",
                "--head-dim", "8")  # fmt: skip
    assert done.returncode == ExitCode.FAILED
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("belayer-gpumem: error: ")
    assert "--backend host" in done.stderr or "pip install 'belayer-gpumem[cuda]'" in done.stderr
