"""The rollout side outlives a SIGKILLed trainer for ``system.resume_grace_s``; ``--resume`` re-attaches.

With ``system.resume_grace_s > 0`` the router and the slots run in a rollout host process
(`belayer_grpo._rollout_host`).  A fixed seed, 3 steps; math (16 prompts x 8 samples) and the
tooluse ``store`` task (4 tasks x 4 samples, real Docker sandboxes):

- run A trains uninterrupted (through a rollout host too), then its folder is renamed (once a
  session per workload, shared with test_resume_e2e: `uninterrupted_run`);
- run B, same configuration and folder path, is SIGKILLed once a quarter of step 2's samples are
  in its rollout log, at a moment (checked on the trainer SIGSTOPped) its router holds a request of
  a sample the log has not (agentic: a trajectory in flight has a logged checkpoint).  Its rollout
  host, router and slots keep running (the guardian waits for a trainer to take the lease); ``--resume`` takes it within the grace period, takes the logged
  samples and sends the others again under the same ids: the router answers or continues every
  request it holds (finished, or cut mid-stream: continued from its tokens, not from the start).
  Math: 0 regenerated (each missing sample was held, or never sent).  Agentic (checkpoint policy
  ``always``, so the killed run has checkpoints of its trajectories in flight): 0 regenerated too:
  each begun trajectory continues where it was, its turns answered by the router, its sandbox
  restored from its latest logged checkpoint and only the logged actions after it run again (all of
  them in a fresh sandbox when it had none); the counts are checked against what the log and the
  router held at the kill.  The resumed run has sandbox chaos (``chaos.sandbox_kill_at_actions=[2]``:
  every trajectory's sandbox is killed after its second action, a replayed one too): a sandbox
  killed while it is rebuilt is restored again, counted in ``rebuild_failures_recovered`` exactly
  as the log says (a begun trajectory whose logged action of prefix 2 is after its latest logged
  checkpoint), the counts above do not change and nothing is regenerated; the final weights still equal A's (whose
  run had no chaos: a recovery regenerates nothing the router held).  The killed trainer's
  sandboxes are removed, never used again.  Final
  weights equal A's bit for bit (tolerance none: see test_resume_e2e.py), and nothing of either
  trainer or the host is left afterwards.

The tooluse case runs a second time with its rollout side on Ray (two nodes that share nothing
where this process may make them, a slot each; simulated nodes otherwise, as `test_resume_e2e`'s
cluster case): the rollout host is the Ray driver and owns the nodes' sandbox hosts, the trainer's
sandbox pool calls them through the host (`belayer_grpo._cluster.hosted_sandboxes`).  Killed and
resumed the same way, against the same run A (where the rollout side runs changes no sample): the
same counts, exactly what the log and the router held, 0 regenerated, weights bit-equal; the host
removed the sandboxes the killed trainer's trajectories held (at least one per begun trajectory),
and afterwards nothing is left: processes, the cluster (namespaces, links, head folder), the
shared folder with its checkpoints, any container with the run's label.  The time one sandbox call
through the host adds is printed (measured on the live host after the kill, not asserted).

A run on Ray (math) is killed and nobody resumes it: after the grace period the guardian reaps the host, the cluster it drove (the head,
every node's processes, their namespaces and links, the run's shared folder), the slots and
everything else of the run.  (The kill-and-adopt case on Ray is the tooluse one above; the
math one, once `test_resume_e2e`'s, was removed after 0.6.10: it proved nothing this module's cases do not.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from test_resume_e2e import (
    _ISOLATED_NODES,
    _cluster_leftovers,
    _clusters_of,
    _model,
    _sandboxes,
    _train,
    uninterrupted_run,
)
from test_sigint import _tagged_pids

from belayer_grpo._guardian import run_marker
from belayer_grpo._lease import REAPED, pid_alive

pytestmark = pytest.mark.e2e

_COMMON = ["algorithm.steps=3", "chaos.kill_worker_at_steps=[]", "logging.progress=false",
           "logging.tensorboard=false"]  # fmt: skip
_MATH = ["data.workload=math", "rollout.concurrency=4"]  # 16 prompts x 8 samples


def _records(path: Path) -> list[dict[str, Any]]:
    """The whole lines of a step log (a line torn by a kill mid-write is not one)."""
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def _finished(path: Path) -> list[dict[str, Any]]:
    """The samples (finished trajectories) of a step log, without its journal events."""
    return [r for r in _records(path) if "event" not in r and not r.get("ended")]


def _journal_waits(path: Path) -> bool:
    """Whether a trajectory not finished in the step log has a logged checkpoint (a resume will
    restore it)."""
    records = _records(path)
    done = {r["trajectory"]["trajectory_id"] for r in records if "trajectory" in r}
    return any(r.get("event") == "checkpoint" and r["trajectory_id"] not in done for r in records)


def _kill_mid_rollout(
    args: list[str],
    env: dict[str, str],
    output: Path,
    step: int,
    lines: int,
    samples: int,
    in_flight: bool = True,
) -> int:
    """Start ``belayer-grpo train``, SIGKILL it once ``lines`` samples of ``step`` (of ``samples``) are
    logged, at a moment some are not: for math, while the router holds a request of a sample not in
    the log (one the resume must re-attach); for an agentic step, while a trajectory in flight has
    a logged checkpoint.  The pid of its rollout host, read before the kill."""
    run_dir = Path(args[-1].split("=", 1)[1].strip("'"))
    log = run_dir / "rollouts" / f"step_{step:06d}.jsonl"
    with output.open("w") as out:
        train = subprocess.Popen(
            [sys.executable, "-m", "belayer_grpo", "train", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
        try:
            deadline = time.monotonic() + 300

            def running() -> None:
                assert train.poll() is None, output.read_text()
                assert time.monotonic() < deadline, output.read_text()

            while not log.is_file():  # the step began: the host is up
                running()
                time.sleep(0.01)
            host_file = run_dir / "rollout-host" / "host.json"
            assert host_file.stat().st_mode & 0o077 == 0  # the admin token: the owner's only
            host = json.loads(host_file.read_text())
            # The conditions are checked on a SIGSTOPped trainer, which logs nothing more and sends
            # nothing more meanwhile, and it is killed as it stands; else it goes on (SIGCONT) and
            # they are checked again.  (Polled on a running one, a math step's last samples could be
            # logged between the check and the kill: seen once, 128 of 128 logged, nothing to
            # re-attach.)  A math request lasts a few tokens and a step a second or two: the router's
            # in-flight gauge is 0 at most moments, but with 4 requests a time the router holds one of
            # a sample the log has not at nearly every moment mid-step.
            while True:
                running()
                if len(_finished(log)) < lines or not (in_flight or _journal_waits(log)):
                    time.sleep(0.01)
                    continue
                train.send_signal(signal.SIGSTOP)
                _wait_stopped(train.pid)
                finished = _finished(log)
                if len(finished) >= samples:
                    raise AssertionError(f"step {step} ended before the kill: {len(finished)} samples logged")
                if (in_flight and _held(run_dir, samples, step)[0]) or (
                    not in_flight and _journal_waits(log)
                ):
                    break
                train.send_signal(signal.SIGCONT)
                time.sleep(0.01)  # let it run a little before the next look
            train.send_signal(signal.SIGKILL)
            assert train.wait(timeout=60) == -signal.SIGKILL
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
    return int(host["pid"])


def _wait_stopped(pid: int) -> None:
    """Until every thread of process ``pid`` is stopped (a SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.001)


def _held(run_dir: Path, num_samples: int, step: int = 2) -> tuple[int, int]:
    """How many of a step's math samples missing from the rollout log the killed (or stopped)
    trainer's router holds now and their tokens (`GET /requests/{id}`, the id a resumed trainer
    derives: `<tag>-step<step>-<index>`)."""
    host = json.loads((run_dir / "rollout-host" / "host.json").read_text())
    logged = {record["index"] for record in _finished(run_dir / "rollouts" / f"step_{step:06d}.jsonl")}
    headers = {"Authorization": f"Bearer {host['admin_token']}"}
    with httpx.Client(base_url=host["url"], headers=headers, timeout=30) as client:
        answers = [
            client.get(f"/requests/{run_marker(run_dir)}-step{step}-{i}")
            for i in range(num_samples)
            if i not in logged
        ]
    assert {answer.status_code for answer in answers} <= {200, 404}
    held = [answer.json() for answer in answers if answer.status_code == 200]
    return len(held), sum(len(record["token_ids"]) for record in held)


def _expected_reattach(run_dir: Path, num_samples: int, kill_at: int) -> tuple[int, int, int, int]:
    """What a resume must continue, from what the step log and the router held at the kill: the
    begun trajectories (the router holds their first turn, the log does not hold them finished),
    the logged actions after each one's latest logged checkpoint (all of them without one), how
    many have a checkpoint to restore, and how many rebuilds chaos kills (one whose replayed
    actions bring the sandbox to prefix ``kill_at``: restored again, it is not killed twice)."""
    host = json.loads((run_dir / "rollout-host" / "host.json").read_text())
    path = run_dir / "rollouts" / "step_000002.jsonl"
    records = _records(path)
    finished = {r["trajectory"]["trajectory_id"] for r in records if "trajectory" in r}
    ids = [f"{run_marker(run_dir)}-step2-g{g}-s{s}" for g in range(num_samples // 4) for s in range(4)]
    headers = {"Authorization": f"Bearer {host['admin_token']}"}
    with httpx.Client(base_url=host["url"], headers=headers, timeout=30) as client:
        begun = [t for t in ids if t not in finished and client.get(f"/requests/{t}-t1").status_code == 200]
    replayed = restored = killed = 0
    for trajectory in begun:
        events = [r for r in records if r.get("trajectory_id") == trajectory]
        assert all(e["event"] in ("action", "checkpoint") for e in events)  # no sandbox chaos here
        checkpointed = [e["turn"] for e in events if e["event"] == "checkpoint"]
        after = max(checkpointed, default=0)
        again = [e for e in events if e["event"] == "action" and e["turn"] > after]
        replayed += len(again)
        restored += bool(checkpointed)
        killed += any(e["prefix"] == kill_at for e in again)
    return len(begun), replayed, restored, killed


def _nothing_left(run_dir: Path, tag: str, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while _tagged_pids(tag) or any(run_dir.rglob("*.sock")) or any(run_dir.glob("slots/*/mem")):
        assert time.monotonic() < deadline, (
            _tagged_pids(tag), list(run_dir.rglob("*.sock")), (run_dir / "guardian.log").read_text()
        )  # fmt: skip
        time.sleep(0.1)


_TOOLUSE = [
    "data.workload=tooluse",
    "data.tool_task=store",
    "chaos.sandbox_kill_p=0.0",
    "data.held_out=4",
    "rollout.env_checkpoint_policy=always",  # so a trajectory in flight has one to restore
]
# Where the rollout side runs: no part of what run A trains (`test_resume_e2e`'s measurement).
_NODES = ["cluster.nodes=2", f"cluster.isolated={str(_ISOLATED_NODES).lower()}", "system.num_slots=2"]
_WORKLOADS = [
    pytest.param(_MATH, 128, id="math"),
    # 4 tasks x 4 samples in real sandboxes, no sandbox kills
    pytest.param(_TOOLUSE, 16, id="tooluse-store", marks=pytest.mark.docker),
    # the same on Ray (the rollout host drives the cluster and owns the nodes' sandbox hosts); its
    # run A is the one above (same folder path: the trajectories' seeds start with its tag)
    pytest.param(
        [*_TOOLUSE, *_NODES],
        16,
        id="tooluse-store-isolated-cluster" if _ISOLATED_NODES else "tooluse-store-cluster",
        marks=pytest.mark.docker,
    ),
]


@pytest.mark.parametrize(("workload", "num_samples"), _WORKLOADS)
def test_a_resume_within_the_grace_period_regenerates_nothing(
    tmp_path: Path, workload: list[str], num_samples: int
) -> None:
    tag = os.urandom(8).hex()
    env = {**os.environ, "BELAYER_TEST_TAG": tag}
    math = "data.workload=math" in workload
    on_ray = "cluster.nodes=2" in workload
    # run A: uninterrupted, through a rollout host on one machine (test_resume_e2e's, shared)
    run_dir, model_a = uninterrupted_run(_COMMON, workload, tmp_path, env)
    args = [*_COMMON, *workload, "system.resume_grace_s=300", f"system.run_dir={str(run_dir)!r}"]

    host_pid = _kill_mid_rollout(
        args, env, tmp_path / "b.log", step=2, lines=num_samples // 4, samples=num_samples, in_flight=math
    )
    clusters = _clusters_of(host_pid)  # the rollout host started the cluster: it drives it
    shared = Path((run_dir / "cluster-shared").read_text()) if on_ray else None
    logged = len(_finished(run_dir / "rollouts" / "step_000002.jsonl"))
    assert num_samples // 4 <= logged < num_samples
    assert not any(r.get("ended") for r in _records(run_dir / "rollouts" / "step_000002.jsonl"))
    time.sleep(2.0)
    assert pid_alive(host_pid), (run_dir / "rollout-host" / "host.log").read_text()[
        -3000:
    ]  # it outlives the trainer
    if clusters:  # the cluster too: its record is still in use
        assert f"{clusters[0]['id']}.json" in str(_cluster_leftovers(clusters[0]))
    assert on_ray or any(run_dir.glob("slots/*/mem"))
    assert "waits 300 s" in (run_dir / "guardian.log").read_text()

    if on_ray:
        _time_hosted_calls(run_dir)
    held = _held(run_dir, num_samples) if math else (0, 0)
    reattach = (0, 0, 0, 0) if math else _expected_reattach(run_dir, num_samples, kill_at=2)
    killed = [] if math else _sandboxes(run_dir)  # the killed trainer's sandboxes
    assert math or reattach[2] >= 1  # a begun trajectory has a checkpoint to restore

    # Agentic: sandbox chaos in the resumed run only (the uninterrupted run A had none).
    chaos = [] if math else ["chaos.sandbox_kill_at_actions=[2]"]
    resumed = _train("--resume", str(run_dir), *chaos, env=env)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    print({key: report.get(key) for key in ("trajectories_reused", "requests_reattached", "tokens_reattached",
                                            "trajectories_new", "trajectories_regenerated", "trajectories_reattached",
                                            "actions_replayed", "sandboxes_restored_from_checkpoint",
                                            "rebuild_failures_recovered")}, reattach)  # fmt: skip
    assert report["status"] == "completed"
    assert report["steps"] == 3
    assert (report["resumed_at_step"], report["steps_replayed"]) == (2, 1)  # step 1 from its log
    assert "re-attached to the rollout host" in resumed.stderr
    assert "trajectories reused" in resumed.stderr
    assert report["trajectories_reused"] >= logged
    assert report["requests_reattached"] >= 1  # at least the requests cut mid-stream by the kill
    # Every sample is reused (logged), re-attached (the router held it) or was never sent.
    assert report["trajectories_regenerated"] == 0
    if math:
        # exactly what the router held after the kill
        assert (report["requests_reattached"], report["tokens_reattached"]) == held
        total = report["trajectories_reused"] + report["requests_reattached"] + report["trajectories_new"]
    else:
        # Each begun trajectory continued where it was: its sandbox restored from its latest logged
        # checkpoint, only the logged actions after it run again; exactly what the log and the
        # router held at the kill.
        counts = ("trajectories_reattached", "actions_replayed", "sandboxes_restored_from_checkpoint",
                  "rebuild_failures_recovered")  # fmt: skip
        assert tuple(report[key] for key in counts) == reattach
        assert report["reattached_inconsistent"] == 0
        assert report["requests_reattached"] >= report["trajectories_reattached"] >= 1
        total = report["trajectories_reused"] + report["trajectories_reattached"] + report["trajectories_new"]
        assert killed
        if on_ray:
            # The sandboxes the killed trainer's trajectories held (on the nodes, the host's) were
            # removed by the host when the resumed trainer opened its pool (at least one per begun
            # trajectory); the resumed ones restored their checkpoints from the shared store.
            released = re.search(r"removed (\d+) sandbox\(es\) the killed trainer's", resumed.stderr)
            assert released, resumed.stderr
            assert int(released.group(1)) >= reattach[0]
        else:
            # The killed trainer's sandboxes were removed when the resume began, never used again.
            reaped = re.search(r"reaped what an earlier run left in .*?(\d+) sandbox\(es\)", resumed.stderr)
            assert reaped, resumed.stderr
            assert int(reaped.group(1)) >= len(killed)
            assert not set(killed) & set(_all_containers())
            assert not list((run_dir / "env-checkpoints").rglob("*"))  # each went with its trajectory
        assert _sandboxes(run_dir) == []  # nothing with the run's label (on Ray: the host's stop)
    assert total == num_samples
    step2 = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step2 = [record for record in step2 if record["step"] == 2]
    assert len(step2) == 1
    assert step2[0]["trajectories_reused"] == report["trajectories_reused"]
    assert step2[0]["requests_reattached"] == report["requests_reattached"]
    if not math:
        assert step2[0]["actions_replayed"] == report["actions_replayed"]
        # The chaos in the resumed run: every rebuild it killed is among the run's sandbox failures.
        # (It strikes only a trajectory that runs a second action live: none may, when the agent
        # answers after one; seen once at load 0-2, 0 failures in steps 2-3.)
        resumed_steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        failures = sum(record.get("env_failures", 0) for record in resumed_steps if record["step"] >= 2)
        print("env_failures (steps 2-3)", failures)
        assert failures >= reattach[3]

    model_b = _model(run_dir)
    assert model_a.keys() == model_b.keys()
    for name, tensor in model_a.items():
        assert torch.equal(tensor, model_b[name]), (name, (tensor - model_b[name]).abs().max())
    assert not pid_alive(host_pid)
    _nothing_left(run_dir, tag, 30)  # both trainers, both guardians, the host and its slots
    # On Ray: the cluster the host drove (isolated: its namespaces, links, head folder) and the
    # run's shared folder (the sandboxes' checkpoints) are gone too.
    assert len(clusters) == (on_ray and _ISOLATED_NODES)
    deadline = time.monotonic() + 30
    while clusters and _cluster_leftovers(clusters[0]):
        assert time.monotonic() < deadline, _cluster_leftovers(clusters[0])
        time.sleep(0.1)
    assert shared is None or not shared.exists()
    assert not (run_dir / "cluster-shared").exists()


def _time_hosted_calls(run_dir: Path) -> None:
    """Print what a sandbox call through the rollout host adds (no sandbox work: the release of a
    trajectory that holds none, a socket round trip and a thread in the host); not asserted."""
    from belayer_grpo._cluster.hosted_sandboxes import HostedSandboxes

    hosts = HostedSandboxes(run_dir / "rollout-host" / "control.sock", Path("/nonexistent"))
    times = []
    for _ in range(200):
        began = time.perf_counter()
        hosts.release("nobody")
        times.append(time.perf_counter() - began)
    times.sort()
    load = os.getloadavg()[0]
    print(
        f"hosted sandbox call overhead: median {times[100] * 1e3:.2f} ms, p90 {times[180] * 1e3:.2f} ms, load {load:.1f}"
    )


def _all_containers() -> list[str]:
    found = subprocess.run(["docker", "ps", "-aq"], capture_output=True, text=True, check=True)
    return found.stdout.split()


def test_a_run_nobody_resumes_is_reaped_after_the_grace_period(tmp_path: Path) -> None:
    tag = os.urandom(8).hex()
    env = {**os.environ, "BELAYER_TEST_TAG": tag}
    run_dir = tmp_path / "run"
    nodes = ["cluster.nodes=2", f"cluster.isolated={str(_ISOLATED_NODES).lower()}", "system.num_slots=2"]
    args = [*_COMMON, *_MATH, *nodes, "system.resume_grace_s=5", f"system.run_dir={str(run_dir)!r}"]
    host_pid = _kill_mid_rollout(args, env, tmp_path / "b.log", step=1, lines=1, samples=128)
    clusters = _clusters_of(host_pid)  # the rollout host started the cluster: it drives it
    shared = Path((run_dir / "cluster-shared").read_text())
    assert pid_alive(host_pid)  # killed a moment ago: within the grace period
    assert len(clusters) == _ISOLATED_NODES
    _nothing_left(run_dir, tag, 5 + 60)
    assert not pid_alive(host_pid)
    deadline = time.monotonic() + 30
    while clusters and _cluster_leftovers(clusters[0]):  # the nodes' namespaces, links, the head's folder
        assert time.monotonic() < deadline, (
            _cluster_leftovers(clusters[0]),
            (run_dir / "guardian.log").read_text(),
        )
        time.sleep(0.1)
    assert not shared.exists()
    assert (run_dir / "rollout-host" / "lease").read_text() == REAPED
    guardian = (run_dir / "guardian.log").read_text()
    assert "waits 5 s" in guardian
    assert "reaped" in guardian
