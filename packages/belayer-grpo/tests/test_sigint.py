"""Ctrl-C (SIGINT to `belayer-grpo train`) leaves no process, socket or memory segment behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def _tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries ``BELAYER_TEST_TAG=tag`` (every descendant inherits it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if f"BELAYER_TEST_TAG={tag}".encode() in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _memfd_holders(tag: str) -> list[int]:
    holders = []
    for pid in _tagged_pids(tag):
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        if any(link.startswith("/memfd:") for link in links):
            holders.append(pid)
    return holders


# resume_grace_s > 0: the router and slots run in a rollout host process in a session of its own,
# which the Ctrl-C does not reach; the trainer must stop it itself.
@pytest.mark.parametrize("grace", ["0", "60"], ids=["in-process", "rollout-host"])
def test_sigint_during_training_leaves_nothing_behind(tmp_path: Path, grace: str) -> None:
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    env = {**os.environ, "BELAYER_TEST_TAG": tag}
    argv = [
        sys.executable,
        "-m",
        "belayer_grpo",
        "train",
        "data.workload=math",
        f"system.run_dir={str(run_dir)!r}",
    ]
    argv += ["algorithm.steps=200", "chaos.kill_worker_at_steps=[]", "logging.progress=false"]
    argv += [f"system.resume_grace_s={grace}"]
    with log.open("w") as output:
        train = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 300
            # Wait until training is under way: slots up (workers and memory servers alive), steps running.
            while "step   2/" not in log.read_text():
                assert train.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            assert len(_tagged_pids(tag)) >= 5  # trainer, 2 memory servers, main worker, shadow
            assert _memfd_holders(tag)
            assert list(run_dir.rglob("*.sock"))
            train.send_signal(signal.SIGINT)
            assert train.wait(timeout=120) == 130, log.read_text()
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
    text = log.read_text()
    assert "SIGINT: shutting down" in text
    assert "status: interrupted" in text
    deadline = time.monotonic() + 10
    while _tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _tagged_pids(tag) == []
    assert not list(run_dir.rglob("*.sock"))
    assert not (run_dir / "slots" / "slot0" / "mem").exists()


def test_sigkill_mid_rollout_is_reaped_and_the_folder_starts_cleanly_again(tmp_path: Path) -> None:
    from belayer_grpo._guardian import RUN_ENV, run_marker

    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    env = {**os.environ, "BELAYER_TEST_TAG": tag}
    argv = [
        sys.executable,
        "-m",
        "belayer_grpo",
        "train",
        "data.workload=math",
        f"system.run_dir={str(run_dir)!r}",
    ]
    argv += ["chaos.kill_worker_at_steps=[]", "logging.progress=false", "logging.tensorboard=false"]
    argv += ["model.warmup_steps=0", "system.checkpoint_every=0"]
    with log.open("w") as output:
        train = subprocess.Popen(
            [*argv, "algorithm.steps=200"], stdout=output, stderr=subprocess.STDOUT, env=env
        )
        try:
            deadline = time.monotonic() + 300
            while "step   1/" not in log.read_text():  # the second rollout is under way
                assert train.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert len(_tagged_pids(tag)) >= 6  # trainer, guardian, 2 memory servers, main, shadow
            assert _memfd_holders(tag)
            train.send_signal(signal.SIGKILL)
            assert train.wait(timeout=60) == -signal.SIGKILL
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
    # Within seconds (polled; generous for a loaded machine) the guardian has reaped the run.
    deadline = time.monotonic() + 30
    while _tagged_pids(tag) or any(run_dir.rglob("*.sock")) or (run_dir / "slots" / "slot0" / "mem").exists():
        assert time.monotonic() < deadline, (run_dir / "guardian.log").read_text()
        time.sleep(0.1)
    assert _memfd_holders(tag) == []
    assert "died; reaped" in (run_dir / "guardian.log").read_text()
    # A leftover the guardian could not have known about (say it was killed too) is reaped at start.
    stray = subprocess.Popen(["sleep", "600"], env={**env, RUN_ENV: run_marker(run_dir)})
    try:
        again = subprocess.run(
            [*argv, "algorithm.steps=1"], capture_output=True, text=True, timeout=600, env=env
        )
        assert again.returncode == 0, again.stdout + again.stderr
        assert stray.wait(timeout=30) == -signal.SIGKILL
        assert "reaped what an earlier run left" in again.stderr
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
    deadline = time.monotonic() + 30
    while _tagged_pids(tag):
        assert time.monotonic() < deadline
        time.sleep(0.1)
