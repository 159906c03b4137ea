"""The rollout host's lease: a guardian and a resuming trainer never both win it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from belayer_grpo._lease import (
    REAPED,
    adopted_by,
    claim_for_reap,
    host_dir,
    host_info,
    pid_alive,
    set_lease,
    take_lease,
)
from belayer_grpo._rollout_host import prespawn, stop_prespawned


@pytest.fixture
def live_pids() -> Iterator[list[int]]:
    """Two live processes (a stand-in rollout host and a stand-in trainer), killed after."""
    processes = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _host(run_dir: Path, pid: int) -> None:
    host_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (host_dir(run_dir) / "host.json").write_text(json.dumps({"pid": pid}))


def test_a_trainer_adopts_a_live_host_and_the_dead_trainers_guardian_then_reaps_nothing(
    tmp_path: Path, live_pids: list[int]
) -> None:
    host, new_trainer = live_pids
    dead_trainer = _dead_pid()
    assert not take_lease(tmp_path, new_trainer)  # no host: nothing to adopt
    _host(tmp_path, host)
    set_lease(tmp_path, dead_trainer)
    assert host_info(tmp_path) == {"pid": host}
    assert adopted_by(tmp_path, dead_trainer) is None  # the dead trainer still holds it
    assert take_lease(tmp_path, new_trainer)
    assert adopted_by(tmp_path, dead_trainer) == new_trainer
    assert not claim_for_reap(tmp_path, dead_trainer)  # the guardian leaves it to the new trainer
    assert (host_dir(tmp_path) / "lease").read_text() == str(new_trainer)


def test_once_a_guardian_claims_the_lease_no_trainer_adopts(tmp_path: Path, live_pids: list[int]) -> None:
    host, new_trainer = live_pids
    dead_trainer = _dead_pid()
    _host(tmp_path, host)
    set_lease(tmp_path, dead_trainer)
    assert claim_for_reap(tmp_path, dead_trainer)  # grace over, nobody came
    assert (host_dir(tmp_path) / "lease").read_text() == REAPED
    assert not take_lease(tmp_path, new_trainer)  # too late: the run starts its rollout side afresh
    set_lease(tmp_path, new_trainer)  # a new host's trainer owns the lease again
    assert adopted_by(tmp_path, dead_trainer) == new_trainer


def test_a_host_whose_process_died_is_not_there(tmp_path: Path) -> None:
    _host(tmp_path, _dead_pid())
    assert host_info(tmp_path) is None
    assert not pid_alive(_dead_pid())


_PRESPAWNING_TRAINER = """
import sys
from pathlib import Path
from belayer_grpo._rollout_host import prespawn
print(prespawn(Path(sys.argv[1])).pid, flush=True)
"""


def _wait_gone(pid: int, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"the prespawned rollout host {pid} is still there"
        time.sleep(0.1)


def test_a_prespawned_host_leaves_when_its_trainer_dies_before_sending_the_spec(tmp_path: Path) -> None:
    """The rollout host starts while the trainer prepares (`prespawn`) and waits for its spec; a
    trainer that dies before sending it (here: one that just exits) leaves no host behind."""
    run_dir = tmp_path / "run"
    trainer = subprocess.run(
        [sys.executable, "-c", _PRESPAWNING_TRAINER, str(run_dir)], capture_output=True, text=True, check=True
    )
    host = int(trainer.stdout)
    try:
        _wait_gone(host)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(host, signal.SIGKILL)
    assert "the trainer is gone before it sent the spec" in (host_dir(run_dir) / "host.log").read_text()
    assert host_info(run_dir) is None


def test_a_prespawned_host_that_never_got_its_spec_stops(tmp_path: Path) -> None:
    """A run that ends before its rollout host serves (`stop_prespawned`): the waiting host stops."""
    run_dir = tmp_path / "run"
    (host_dir(run_dir)).mkdir(parents=True)
    (host_dir(run_dir) / "spec.json").write_text("an earlier run's")  # removed: the host waits
    process = prespawn(run_dir)
    try:
        time.sleep(1.0)
        assert process.poll() is None
        assert not (host_dir(run_dir) / "spec.json").exists()
        assert int((host_dir(run_dir) / "lease").read_text()) == os.getpid()
        stop_prespawned(process)
        assert process.returncode == -signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert host_info(run_dir) is None
