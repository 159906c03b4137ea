"""Nothing orphaned: `reap_run` and the guardian process, with real processes and files."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from belayer_grpo._guardian import RUN_ENV, find_run_processes, reap_run, run_marker


def _leftovers(run_dir: Path) -> subprocess.Popen[bytes]:
    """What a SIGKILLed trainer leaves: a marked process, a socket, memory and sandbox folders."""
    (run_dir / "slots" / "slot0" / "mem").mkdir(parents=True)
    (run_dir / "slots" / "slot0" / "weights.sock").write_text("")
    (run_dir / "env-checkpoints" / "t1").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step_000001.pt").write_bytes(b"complete")
    (run_dir / "checkpoints" / ".step_000002.pt.tmp").write_bytes(b"torn")
    marker = run_marker(run_dir)
    stray = subprocess.Popen(["sleep", "600"], env={**os.environ, RUN_ENV: marker})
    return stray


def test_reap_run_kills_marked_processes_and_removes_sockets_and_folders(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = tmp_path / "other"
    other.mkdir()
    stray = _leftovers(run_dir)
    bystander = subprocess.Popen(["sleep", "600"], env={**os.environ, RUN_ENV: run_marker(other)})
    try:
        deadline = time.monotonic() + 30
        while stray.pid not in find_run_processes(run_marker(run_dir)):
            assert time.monotonic() < deadline, "the marked process never showed its environment"
            time.sleep(0.05)
        report = reap_run(run_dir)
        assert stray.wait(timeout=30) == -signal.SIGKILL
        assert stray.pid in report.pids
        assert bystander.poll() is None  # another run folder's process is not touched
        assert not list(run_dir.rglob("*.sock"))
        assert not (run_dir / "slots" / "slot0" / "mem").exists()
        assert not (run_dir / "env-checkpoints").exists()
        assert not (run_dir / "checkpoints" / ".step_000002.pt.tmp").exists()
        assert (run_dir / "checkpoints" / "step_000001.pt").read_bytes() == b"complete"
        assert reap_run(run_dir).empty
    finally:
        for process in (stray, bystander):
            process.kill()
            process.wait()


_TRAINER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from belayer_grpo._guardian import Guardian, run_processes_marked

    run_dir = Path(sys.argv[1])
    with run_processes_marked(run_dir), Guardian(run_dir):
        child = subprocess.Popen(["sleep", "600"])
        (run_dir / "slots" / "slot0").mkdir(parents=True)
        (run_dir / "slots" / "slot0" / "kv.sock").write_text("")
        print(child.pid, flush=True)
        time.sleep(600)
    """
)


def test_the_guardian_reaps_within_seconds_of_a_sigkilled_trainer(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(run_dir)], stdout=subprocess.PIPE)
    child = 0
    try:
        assert trainer.stdout is not None
        child = int(trainer.stdout.readline())
        assert child in find_run_processes(run_marker(run_dir))
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 30
        while find_run_processes(run_marker(run_dir)) or any(run_dir.rglob("*.sock")):
            assert time.monotonic() < deadline, (run_dir / "guardian.log").read_text()
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while "trainer" not in (run_dir / "guardian.log").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert f"trainer {trainer.pid} died" in (run_dir / "guardian.log").read_text()
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_cleanly_stopped_trainer_leaves_the_guardian_nothing_to_do(tmp_path: Path) -> None:
    script = (
        "import sys; from pathlib import Path; from belayer_grpo._guardian import Guardian\n"
        "with Guardian(Path(sys.argv[1])): pass\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=120)
    assert "died" not in (tmp_path / "guardian.log").read_text()


@pytest.mark.docker
def test_the_guardian_removes_sandboxes_of_a_folder_removed_during_the_grace_period(tmp_path: Path) -> None:
    """The guardian reads the run's workload when the trainer dies: its sandboxes go even if
    ``config.json`` is gone by the time the grace period ends (the folder was removed)."""
    from belayer_grpo._guardian import RUN_LABEL

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    label = f"{RUN_LABEL}={run_marker(run_dir)}"
    started = subprocess.run(
        ["docker", "run", "-d", "--label", label, "belayer/busybox:latest", "sleep", "300"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    container = started.stdout.strip()
    try:
        assert reap_run(run_dir).containers == ()  # no configuration, no workload known: untouched
        report = reap_run(run_dir, workload="tooluse")
        assert report.containers == (container,)
        listed = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True
        )
        assert listed.stdout.split() == []
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True)
