"""The `belayer-envckpt` command line, run as a real subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

from conftest import TEST_LABEL, TEST_SESSION

from belayer_envckpt import ExitCode, __version__
from belayer_envckpt._restore_engine import restore_engine_line


def cli(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "belayer_envckpt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_version_comes_from_the_package_metadata():
    assert __version__ == importlib.metadata.version("belayer-envckpt")
    assert cli("--version").stdout.split() == ["belayer-envckpt", __version__]


def test_doctor_reports_ready():
    out = json.loads(cli("doctor", "--json").stdout)
    assert out["ready"] is True
    assert {"engine", "experimental", "criu"} <= set(out["checks"])


def test_doctor_says_what_is_missing():
    proc = cli("doctor", "--image", "belayer/absent:1", check=False)
    assert proc.returncode == ExitCode.UNHEALTHY
    assert "scripts/setup-system" in proc.stdout


def test_checkpoint_ls_restore_gc(make_sandbox, engine, tmp_path):
    sandbox = make_sandbox(trajectory="cli")
    sandbox.exec("echo cli > /work/c")
    store = str(tmp_path / "store")
    made = json.loads(
        cli(
            "checkpoint",
            sandbox.id,
            "--store",
            store,
            "--trajectory",
            "cli",
            "--prefix",
            "1",
            "--context-ref",
            "ctx/1",
            "--json",
        ).stdout
    )
    assert made["checkpoint_id"].startswith("k00001-")
    assert made["kind"] == "fresh-runtime"  # only the keep-alive init runs: no CRIU
    assert made["freeze_ms"] == 0 < made["total_ms"]
    args = ("--store", store, "--trajectory", "cli", "--prefix")
    same = json.loads(cli("checkpoint", sandbox.id, *args, "2", "--json").stdout)
    assert (same["kind"], same["artifacts_of"]) == ("reference", made["checkpoint_id"])
    full = json.loads(cli("checkpoint", sandbox.id, *args, "3", "--full", "--json").stdout)
    assert full["kind"] == "full"
    assert 0 < full["freeze_ms"] <= full["total_ms"]
    listed = json.loads(cli("ls", "--store", store, "--json").stdout)
    assert [(c["checkpoint_id"], c["kind"]) for c in listed["checkpoints"]] == [
        (made["checkpoint_id"], "fresh-runtime"),
        (same["checkpoint_id"], "reference"),
        (full["checkpoint_id"], "full"),
    ]
    table = cli("ls", "--store", store).stdout.splitlines()
    assert [line.split("\t")[3] for line in table] == [
        "fresh-runtime",
        f"reference of {made['checkpoint_id']}",
        "full",
    ]
    for prefix in ("1", "2", "3"):
        verified = cli("verify", *args, prefix, "--json")
        assert json.loads(verified.stdout)["ok"]
    full_path = listed["checkpoints"][2]["path"]
    cli("gc", "--store", store, "--trajectory", "cli", "--keep", "1")  # only the full one stays
    assert [c["path"] for c in json.loads(cli("ls", "--store", store, "--json").stdout)["checkpoints"]] == [
        full_path
    ]
    assert json.loads(cli("verify", "--store", store, "--trajectory", "cli", "--json").stdout)["ok"]

    restored = json.loads(cli("restore", "--store", store, "--trajectory", "cli", "--json").stdout)
    assert restored["checkpoint_id"] == full["checkpoint_id"]
    new = engine._client.containers.get(restored["container_id"])
    try:
        assert new.labels.get(TEST_LABEL) == TEST_SESSION
        assert new.exec_run("cat /work/c").output == b"cli\n"
        assert (restored["prefix"], restored["context_ref"]) == (3, "")
    finally:
        new.remove(force=True)
    removed = json.loads(cli("gc", "--store", store, "--trajectory", "cli", "--json").stdout)["removed"]
    assert len(removed) == 1
    assert json.loads(cli("ls", "--store", store, "--json").stdout)["checkpoints"] == []


def test_errors_are_one_line_with_named_exit_codes(tmp_path):
    proc = cli(
        "checkpoint",
        "no-such-ctr",
        "--store",
        str(tmp_path),
        "--trajectory",
        "t",
        "--prefix",
        "0",
        "--json",
        check=False,
    )
    assert proc.returncode == ExitCode.USAGE
    assert json.loads(proc.stdout)["error"] == "ContainerNotFoundError"
    proc = cli("restore", "--store", str(tmp_path), "--trajectory", "../x", check=False)
    assert proc.returncode == ExitCode.USAGE
    [line] = proc.stderr.splitlines()
    assert line.startswith("belayer-envckpt: error: ")
    assert "InvalidIdError" in line
    proc = cli("restore", "--store", str(tmp_path), "--trajectory", "none", "--debug", check=False)
    assert proc.returncode == ExitCode.USAGE
    assert "Traceback" in proc.stderr
    assert "CheckpointNotFoundError" in proc.stderr.splitlines()[-1]


def test_demo_runs_end_to_end(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    out = json.loads(cli("demo", "--json", env={"TMPDIR": str(temp)}).stdout)
    assert out["state_matches_prefix"] is True
    assert out["process_resumed"] is True
    assert list(temp.iterdir()) == []  # its temporary store is gone


def test_doctor_names_the_restore_engine_and_why():
    detail = json.loads(cli("doctor", "--json").stdout)["checks"]["restore engine"]["detail"]
    assert detail.startswith("docker ")
    assert ("podman is not installed" in detail) == (shutil.which("podman") is None)
    assert "page images read in place from the checkpoint store where containerd sees it" in detail


def test_restore_engine_line_names_a_podman_it_does_not_use(tmp_path, monkeypatch):
    podman = tmp_path / "podman"  # only its presence on PATH is looked at, it never runs
    podman.write_text("#!/bin/sh\nexit 1\n")
    podman.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    line = restore_engine_line("20.10.24")
    assert line.startswith("docker 20.10.24")
    assert f"podman at {podman} is present but not used" in line
