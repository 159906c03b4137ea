"""``belayer-policy compare``: in-process and as the installed console script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

import belayer_policy
from belayer_policy import ExitCode, Trajectory, save_trace
from belayer_policy._cli import main

REQUIRED_KEYS = {
    "policy",
    "rollout_s_mean",
    "failure_free_s_mean",
    "lost_s_mean",
    "visible_checkpoint_s_mean",
    "checkpoints_mean",
}


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    assert main(["compare", *argv, "--json"]) == 0
    result: list[dict[str, Any]] = json.loads(capsys.readouterr().out)
    return result


def test_json_has_one_object_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    result = _json(
        capsys,
        *("--policy", "adaptive", "--policy", "never", "--policy", "every:2"),
        *("--fail-prob", "0.05", "--trajectories", "4", "--steps", "5", "--runs", "3", "--seed", "3"),
    )
    assert [r["policy"] for r in result] == ["adaptive", "never", "every:2"]
    for record in result:
        assert set(record) >= REQUIRED_KEYS
        assert record["runs"] == 3
    assert result[1]["checkpoints_mean"] == 0.0


def test_default_compares_the_four_policies_as_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--trajectories", "2", "--steps", "3", "--runs", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| policy |")
    assert [line.split("|")[1].strip() for line in table[2:]] == [
        "adaptive",
        "paper",
        "always",
        "every:3",
        "never",
    ]


def test_trace_drives_the_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    save_trace(trace, [Trajectory([10.0, 10.0], [1.0, 1.0], [0.5, 0.5]), Trajectory([5.0], [1.0], [0.5])])
    (record,) = _json(capsys, "--trace", str(trace), "--policy", "always", "--fail-prob", "0", "--runs", "2")
    assert record["failure_free_s_mean"] == 22.0
    assert record["rollout_s_mean"] == 22.0
    assert record["checkpoints_mean"] == 1.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fail-prob", "1.5"], "fail_prob"),
        (["--policy", "sometimes"], "policy"),
        (["--runs", "0"], "runs"),
        (["--trajectories", "0"], "num_trajectories"),
        (["--steps", "0"], "num_steps"),
        (["--policy", "never", "--policy", "never"], "twice"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot be read"),
        (["--trace", "x.jsonl", "--steps", "3"], "--trace"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", *argv]) == 2
    assert message in capsys.readouterr().err


def test_console_script_runs_as_a_process() -> None:
    script = shutil.which("belayer-policy", path=str(Path(sys.executable).parent))
    assert script is not None, "the package's console script is not installed next to this Python"
    done = subprocess.run(
        [script, "compare", "--trajectories", "2", "--steps", "3", "--runs", "1", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert {r["policy"] for r in json.loads(done.stdout)} == {
        "adaptive",
        "paper",
        "always",
        "every:3",
        "never",
    }


def test_python_m_runs_the_command_and_errors_are_one_line() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "belayer_policy", "compare", "--trajectories", "1", "--steps", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == ExitCode.OK, ok.stderr
    assert len(json.loads(ok.stdout)) == 5
    bad = subprocess.run(
        [sys.executable, "-m", "belayer_policy", "compare", "--fail-prob", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == ExitCode.USAGE
    assert bad.stderr.splitlines() == [bad.stderr.strip()]
    assert bad.stderr.startswith("belayer-policy: error: fail_prob")


def test_debug_prints_the_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--debug", "compare", "--fail-prob", "2"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "Traceback" in err
    assert err.rstrip().splitlines()[-1].startswith("belayer-policy: error: fail_prob")


def test_exit_codes_and_version_follow_the_contract() -> None:
    assert [(c.name, int(c)) for c in ExitCode] == [
        ("OK", 0),
        ("FAILED", 1),
        ("USAGE", 2),
        ("UNHEALTHY", 3),
        ("INTERRUPTED", 130),
    ]
    assert belayer_policy.__version__ == version("belayer-policy")


def test_known_probability_and_carried_estimators(capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        "--policy",
        "adaptive",
        "--fail-prob",
        "0.1",
        "--trajectories",
        "3",
        "--steps",
        "4",
        "--runs",
        "2",
    )
    (learned,) = _json(capsys, *argv)
    (known,) = _json(capsys, *argv, "--known-fail-prob", "--carry-estimators")
    assert learned["failure_free_s_mean"] == known["failure_free_s_mean"]
    assert known["checkpoints_mean"] >= learned["checkpoints_mean"]


def test_the_former_command_name_still_works_and_says_it_is_deprecated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--trajectories", "2", "--steps", "3", "--runs", "1", "--json"]
    assert main(["simulate", *argv]) == ExitCode.OK
    old = capsys.readouterr()
    assert "`belayer-policy simulate` is deprecated; use `belayer-policy compare`" in old.err
    assert main(["compare", *argv]) == ExitCode.OK
    new = capsys.readouterr()
    assert json.loads(old.out) == json.loads(new.out)
    assert "deprecated" not in new.err
