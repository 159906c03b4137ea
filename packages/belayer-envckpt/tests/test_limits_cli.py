"""Limits through the command line: `create` flags, `doctor`'s report, and a CLI restore keeping them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import BUSYBOX, TEST_LABEL, TEST_SESSION
from test_limits import HOST_FIELDS, in_force

from belayer_envckpt import Sandbox, SandboxLimits


def cli(*args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-m", "belayer_envckpt", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_doctor_reports_the_limits_in_force_and_what_cannot_apply():
    out = cli("doctor")
    assert out["limits"] == SandboxLimits().to_dict()
    warnings = "\n".join(out["warnings"])  # type: ignore[arg-type]
    assert "disk cap (2048 MB)" in warnings  # overlay2 here has no quota: the cap is measured
    cap_sys_resource = any(
        line.startswith("CapEff:") and int(line.split()[1], 16) >> 24 & 1
        for line in Path("/proc/self/status").read_text().splitlines()
    )
    assert ("CAP_SYS_RESOURCE" in warnings) != cap_sys_resource


def test_create_flags_and_a_cli_restore_keep_every_limit(engine, tmp_path):
    flags = ["--pids", "40", "--memory-mb", "64", "--cpus", "0.25", "--disk-mb", "8", "--cap", "CHOWN"]
    made = cli("create", BUSYBOX, "--trajectory", "clilim", "--label", f"{TEST_LABEL}={TEST_SESSION}", *flags)
    ids = [str(made["container_id"])]
    try:
        wanted = SandboxLimits(pids=40, memory_mb=64, cpus=0.25, disk_mb=8, capabilities=["CHOWN"])
        assert made["limits"] == wanted.to_dict()
        assert made["enforced"] == wanted.engine_view()
        original = Sandbox.attach(engine, ids[0])
        assert original.config.limits == wanted
        before = in_force(original)
        assert before["pids.max"] == "40"
        assert before["caps"] == ("0000000000000001",) * 2  # CHOWN only
        store = str(tmp_path / "store")
        cli("checkpoint", ids[0], "--store", store, "--trajectory", "clilim", "--prefix", "0")
        restored_id = str(cli("restore", "--store", store, "--trajectory", "clilim")["container_id"])
        ids.append(restored_id)
        restored = Sandbox.attach(engine, restored_id)
        assert restored.config.limits == wanted
        after = in_force(restored)
        assert after == before
        assert {f: after["host"][f] for f in HOST_FIELDS} == {f: before["host"][f] for f in HOST_FIELDS}  # type: ignore[index]
    finally:
        for container_id in ids:
            engine.remove(container_id)
