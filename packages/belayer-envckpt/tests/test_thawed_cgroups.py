"""`_runtime._thawed` on both cgroup layouts, read from fake /proc and /sys/fs/cgroup trees.

This machine (and CI) is cgroup v1: `test_runtime_inspection.py` checks the v1 freezer path for
real (a sandbox paused by the engine); the v2 (unified) path runs for real only on a cgroup v2
host, so here both layouts are parsed from files written to a temp folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from belayer_envckpt._runtime import _thawed

PID = 4242


def _tree(tmp_path: Path, cgroup_lines: str) -> tuple[Path, Path]:
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / str(PID)).mkdir(parents=True)
    (proc / str(PID) / "cgroup").write_text(cgroup_lines)
    root.mkdir()
    return proc, root


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


V1 = "12:pids:/docker/abc\n7:freezer:/docker/abc\n1:name=systemd:/docker/abc\n0::/system.slice/x\n"


@pytest.mark.parametrize(
    ("state", "thawed"), [("THAWED\n", True), ("FROZEN\n", False), ("FREEZING\n", False)]
)
def test_v1_reads_the_freezer_controller_state(tmp_path, state, thawed):
    proc, root = _tree(tmp_path, V1)
    _write(root / "freezer/docker/abc/freezer.state", state)
    # a hybrid host's unified line is not consulted when a freezer line exists
    _write(root / "system.slice/x/cgroup.freeze", "1\n" if thawed else "0\n")
    assert _thawed(PID, proc=proc, cgroup_root=root) is thawed


V2 = "0::/system.slice/docker-abc.scope\n"


@pytest.mark.parametrize(("freeze", "thawed"), [("0\n", True), ("1\n", False)])
def test_v2_reads_cgroup_freeze_of_the_unified_path(tmp_path, freeze, thawed):
    proc, root = _tree(tmp_path, V2)
    folder = root / "system.slice/docker-abc.scope"
    _write(folder / "cgroup.freeze", freeze)
    _write(folder / "cgroup.events", "populated 1\nfrozen 1\n")  # cgroup.freeze wins when present
    assert _thawed(PID, proc=proc, cgroup_root=root) is thawed


@pytest.mark.parametrize(
    ("events", "thawed"), [("populated 1\nfrozen 0\n", True), ("populated 1\nfrozen 1\n", False)]
)
def test_v2_without_cgroup_freeze_reads_cgroup_events(tmp_path, events, thawed):
    proc, root = _tree(tmp_path, "0::/\n")  # the root cgroup has no cgroup.freeze
    _write(root / "cgroup.events", events)
    assert _thawed(PID, proc=proc, cgroup_root=root) is thawed


@pytest.mark.parametrize(
    "lines",
    [
        "",  # no line at all
        "5:cpu,cpuacct:/docker/abc\n",  # v1 without a freezer controller
        "not a cgroup line\n",
        "0::/gone\n",  # the unified folder is missing
    ],
)
def test_unreadable_or_unknown_layouts_are_not_called_thawed(tmp_path, lines):
    proc, root = _tree(tmp_path, lines)
    assert _thawed(PID, proc=proc, cgroup_root=root) is False


def test_a_missing_process_is_not_called_thawed(tmp_path):
    proc, root = _tree(tmp_path, V2)
    assert _thawed(PID + 1, proc=proc, cgroup_root=root) is False
