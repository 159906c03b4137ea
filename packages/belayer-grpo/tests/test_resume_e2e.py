"""``belayer-grpo train --resume`` after a SIGKILL of the trainer mid-rollout ends like a run never killed.

For each workload (math; the agentic tooluse ``store`` task, which needs Docker): run A trains 3
steps uninterrupted, then its folder is renamed; run B, same configuration, seed and folder path
(the agentic trajectory ids, and so their sampling seeds, start with the folder's tag), is
SIGKILLed while step 2's rollout is under way (a quarter of its samples in its rollout log), then
resumed with ``--resume RUN_DIR``: from the step-0 checkpoint it trains step 1 again from its log
(no generation), takes step 2's finished samples and generates only the others, then runs step 3.
Run A of each workload is run once a session, through a rollout host (`uninterrupted_run`), and
test_resume_reattach's cases compare with it too (its tooluse cases, on one machine and on Ray,
run B in run A's folder: the trajectories' seeds start with its tag).  Where the rollout side runs
changes no sample and no update (measured: the math run A on one slot and on two isolated nodes end
bit-equal), so a run on Ray is compared with the same run A.  The kill-and-adopt cases (a rollout
host that outlives the trainer, ``system.resume_grace_s > 0``, one machine and Ray) are
test_resume_reattach's: it checks on them everything this module's adopt case on Ray (math, 2
isolated nodes; removed after 0.6.10, a CI minute and a half) checked, and exactly what the router held.

Tolerance for the final weights: none (bit-equal).  On CPU with one intra-op thread the update is
a deterministic function of the samples (measured: two uninterrupted runs end bit-equal), and
every sample regenerated with its own seed came out bit-equal to run A's, tokens and logprobs,
though it ran in other batches of the engine; so any difference is a bug, not rounding.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from test_cluster_train import ISOLATED
from test_sigint import _tagged_pids

pytestmark = pytest.mark.e2e
# belayer-cluster's tests' switch: `BELAYER_TEST_NODES=processes` asks for simulated nodes.
_ISOLATED_NODES = ISOLATED and os.environ.get("BELAYER_TEST_NODES", "isolated") != "processes"

_STEPS = 3
_COMMON = [f"algorithm.steps={_STEPS}", "chaos.kill_worker_at_steps=[]", "logging.progress=false",
           "logging.tensorboard=false"]  # fmt: skip
# 16 prompts x 8 samples; a rollout of a few seconds, so the kill lands inside it
_MATH = ["data.workload=math", "rollout.concurrency=4"]
# Where the rollout side runs (one machine, or Ray nodes): no part of what run A trains.
_PLACEMENT = ("cluster.", "system.num_slots=", "system.resume_grace_s=")
_GRACE = "system.resume_grace_s=300"  # the rollout side outlives the trainer; --resume adopts it
_WORKLOADS = [
    pytest.param(_MATH, 128, id="math"),
    # 4 tasks x 4 samples in real sandboxes, no sandbox kills
    pytest.param(
        [
            "data.workload=tooluse",
            "data.tool_task=store",
            "chaos.sandbox_kill_p=0.0",
            "data.held_out=4",
            "rollout.env_checkpoint_policy=always",
        ],  # as test_resume_reattach's (it shares run A)
        16,
        id="tooluse-store",
        marks=pytest.mark.docker,
    ),
]
_CLUSTER_STATE = Path("/run/belayer-isolated")  # belayer-cluster's record of each isolated cluster


def _clusters_of(pid: int) -> list[dict[str, object]]:
    """The isolated clusters (belayer-cluster's records) that process ``pid`` started."""
    found = []
    for record in _CLUSTER_STATE.glob("*.json") if _CLUSTER_STATE.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(record.read_text())
            if state.get("owner") == pid:
                found.append(state)
    return found


def _cluster_leftovers(state: dict[str, object]) -> list[str]:
    """What of an isolated cluster is still on this machine: its record, network namespaces,
    bridge, veths and the head's folder."""
    cluster_id = str(state["id"])
    left = [str(path) for path in _CLUSTER_STATE.glob(f"{cluster_id}.json")]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    left += [name for name in netns if name.startswith(f"bln{cluster_id}-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
    names = [line.split(":")[1].strip().split("@")[0] for line in links if ":" in line]
    left += [name for name in names if name == f"blb{cluster_id}" or name.startswith(f"blv{cluster_id}")]
    left += [str(path) for path in Path("/tmp").glob(f"bli{cluster_id}-*")]
    return left


def _left_after_kill(run_dir: Path, tag: str) -> list[str]:
    """What of the killed run is still there (for the failure message): processes, sockets, memory."""
    left = []
    for pid in _tagged_pids(tag):
        with contextlib.suppress(OSError):
            left.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')[:160]!r}")
    return [*left, *map(str, run_dir.rglob("*.sock")), *map(str, run_dir.glob("slots/*/mem"))]


def _train(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "belayer_grpo", "train", "--json", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)


def _logged_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(
        run_dir / "checkpoints" / f"step_{_STEPS:06d}.pt", map_location="cpu", weights_only=False
    )
    return dict(state["model"])


# Run A of each workload (the rollout side's placement left out), for the whole session: this
# module's and test_resume_reattach's cases share it.  The folder it ran in, renamed (its run B's
# folder path: an agentic trajectory's id, and so its sampling seed, starts with the folder's
# tag), and its final model.
_RUNS_A: dict[tuple[str, ...], tuple[Path, dict[str, torch.Tensor]]] = {}


def uninterrupted_run(
    common: list[str], workload: list[str], tmp_path: Path, env: dict[str, str]
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Run B's folder and run A's final model: run A (uninterrupted, through a rollout host, in
    the folder run B will use, renamed ``a`` afterwards) once a session per workload; a workload
    that differs from one already run only in where its rollout side runs reuses it.  A math run
    B takes ``tmp_path/run`` (math samples do not depend on the folder); an agentic one run A's
    folder path, an earlier case's run B there moved aside to ``tmp_path/earlier``."""
    from test_sigint import _tagged_pids

    key = tuple(arg for arg in [*common, *workload] if not arg.startswith(_PLACEMENT))
    if key not in _RUNS_A:
        run_dir = tmp_path / "run"
        started = time.monotonic()
        done = _train(*key, _GRACE, f"system.run_dir={str(run_dir)!r}", env=env)
        assert done.returncode == 0, done.stderr
        print(f"run A: {time.monotonic() - started:.1f} s")
        deadline = time.monotonic() + 30  # a run that ends stops its rollout host
        while (
            _tagged_pids(env["BELAYER_TEST_TAG"])
            or any(run_dir.rglob("*.sock"))
            or any(run_dir.glob("slots/*/mem"))
        ):
            assert time.monotonic() < deadline, (
                _tagged_pids(env["BELAYER_TEST_TAG"]),
                list(run_dir.rglob("*.sock")),
            )
            time.sleep(0.1)
        run_dir.rename(tmp_path / "a")
        _RUNS_A[key] = (run_dir, _model(tmp_path / "a"))
    folder, model = _RUNS_A[key]
    if "data.workload=math" in workload:
        return tmp_path / "run", model
    if folder.exists():
        folder.rename(tmp_path / "earlier")
    return folder, model


def _sandboxes(run_dir: Path) -> list[str]:
    from belayer_grpo._guardian import RUN_LABEL, run_marker

    found = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={RUN_LABEL}={run_marker(run_dir)}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return found.stdout.split()


@pytest.mark.parametrize(("workload", "num_samples"), _WORKLOADS)
def test_a_run_killed_mid_rollout_resumes_to_the_uninterrupted_model(
    tmp_path: Path, workload: list[str], num_samples: int
) -> None:
    tag = uuid.uuid4().hex
    env = {**os.environ, "BELAYER_TEST_TAG": tag}
    run_dir, model_a = uninterrupted_run(_COMMON, workload, tmp_path, env)
    args = [*_COMMON, *workload, f"system.run_dir={str(run_dir)!r}"]

    log = run_dir / "rollouts" / "step_000002.jsonl"
    with (tmp_path / "b.log").open("w") as output:
        train = subprocess.Popen(
            [sys.executable, "-m", "belayer_grpo", "train", *args],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 300

            def running() -> None:
                assert train.poll() is None, (tmp_path / "b.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "b.log").read_text()

            while len(_logged_lines(log)) < num_samples // 4:
                running()
                time.sleep(0.01)
            train.send_signal(signal.SIGKILL)
            assert train.wait(timeout=60) == -signal.SIGKILL
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
    lines = _logged_lines(log)
    assert num_samples // 4 <= len(lines) < num_samples  # killed mid-rollout
    assert '{"ended": true}' not in lines
    _check_reaped(run_dir, tag, workload)

    resumed = _train("--resume", str(run_dir), env=env)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["status"] == "completed"
    assert report["steps"] == _STEPS
    assert (report["resumed_at_step"], report["steps_replayed"]) == (2, 1)  # step 1 from its log
    assert report["trajectories_reused"] >= num_samples // 4  # at least what was durable before the kill
    assert "trajectories reused" in resumed.stderr
    assert report["trajectories_reused"] + report["trajectories_regenerated"] == num_samples
    print(f"reused {report['trajectories_reused']}, regenerated {report['trajectories_regenerated']}")
    step2 = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step2 = [record for record in step2 if record["step"] == 2]
    assert len(step2) == 1
    assert step2[0]["trajectories_reused"] == report["trajectories_reused"]

    model_b = _model(run_dir)
    assert model_a.keys() == model_b.keys()
    for name, tensor in model_a.items():
        assert torch.equal(tensor, model_b[name]), (name, (tensor - model_b[name]).abs().max())
    # Nothing of either trainer or its rollout host is left.
    deadline = time.monotonic() + 30
    while _tagged_pids(tag):
        assert time.monotonic() < deadline, _tagged_pids(tag)
        time.sleep(0.1)


def _check_reaped(run_dir: Path, tag: str, workload: list[str]) -> None:
    """The guardian reaped everything of the killed run: no process, socket, memory folder or sandbox."""
    deadline = time.monotonic() + 30
    while _tagged_pids(tag) or any(run_dir.rglob("*.sock")) or (run_dir / "slots" / "slot0" / "mem").exists():
        assert time.monotonic() < deadline, (
            _left_after_kill(run_dir, tag),
            (run_dir / "guardian.log").read_text(),
        )
        time.sleep(0.1)
    if "data.workload=tooluse" in workload:
        assert _sandboxes(run_dir) == []
