"""Trainer-crash resume: the rollout host (``system.resume_grace_s > 0``) against a new rollout side.

``--workload math`` (the default): 3 steps of 16 prompts x 8 samples (``rollout.concurrency=4``).
``--workload tooluse``: the default agentic workload as it ships (the ``build`` tool-use task, 4
tasks x 4 samples per step, the adaptive checkpoint policy, sandbox kills with p = 0.05 per action,
real Docker sandboxes), 3 steps, the worker kill of step 3 off and ``data.held_out=4``.  Fixed seed,
the same run folder path for every run (its marker names the requests).  Each repetition, in one run:

- **reference** (grace 0 and grace > 0): the uninterrupted run; its wall time with and without
  the rollout host is the host's cost when nothing fails, its final weights the target.
- **host** (grace > 0): the trainer is SIGKILLed once a quarter of step 2's samples are in its
  rollout log and the router has a request in flight (tooluse: at once); ``--resume`` adopts the rollout host and re-attaches the step's requests
  (tooluse: continues each begun trajectory from its journal, its sandbox rebuilt).
- **baseline** (grace 0, the default): the same kill point; ``--resume`` starts a new router and new
  slots and generates every sample of step 2 missing from the log again.

Measured per interrupted arm: seconds from the kill until the resumed run has finished step 2
(its record in ``metrics.jsonl``) and until it exits; samples reused (from the log), re-attached
(held by the router), regenerated (begun before the kill, generated again from the start) and new
(never sent before the kill); tokens regenerated (tokens the killed trainer had generated that
the resumed one generates again); and whether the final weights equal the grace-0 reference's
bit for bit (else the largest absolute difference; the build task stamps a random build id into
every build, so two of its runs never train on the same tokens).  Tooluse also counts the begun
trajectories' turns and context tokens (responses and observations: the router's contexts do not
tell them apart, so tooluse's "tokens regenerated" of the baseline is n/a), the logged actions of
the begun trajectories at the kill (host arm: the journal is written with grace > 0 only), and
from the host arm's report: trajectories continued, actions replayed, sandboxes restored from a
checkpoint, inconsistent replays and sandbox failures recovered while rebuilding.  Just before
the kill, in both arms, the slot's workers are paused (SIGSTOP, resumed with SIGCONT after the
kill) while the router is asked (``GET /requests/{id}``; tooluse: ``GET /contexts/{trajectory}``)
which of step 2's samples missing from the log it has begun and with how many tokens: with grace 0 the router dies with the trainer, so that snapshot is what the new
rollout side generates again; with grace > 0 the resumed run's report gives the count the router
held after the kill.  Finding the grace-0 router's admin token reads a slot worker's environment
(/proc: root or the same user).

    python benchmarks/bench_resume.py --reps 3
    python benchmarks/bench_resume.py --workload tooluse --reps 3

Writes ``benchmarks/results/bench_resume.json`` and ``bench_resume.md`` (tooluse:
``bench_resume_tooluse.*``) after every repetition, with ``uptime`` at start and end.  Needs the package installed with its test extras (torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import torch

from belayer_grpo._guardian import run_marker
from belayer_router import RouterAdmin

RESULTS = Path(__file__).parent / "results"
STEPS, KILL_STEP = 3, 2
_BASE = [f"algorithm.steps={STEPS}", "chaos.kill_worker_at_steps=[]", "logging.progress=false",
         "logging.tensorboard=false"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Workload:
    """What one benchmark run trains: its overrides, samples per step, turns per trajectory."""

    name: str
    overrides: list[str]
    num_samples: int
    max_turns: int  # agentic: a trajectory's turns (request ids ``-t1`` ...); 0: math
    setup: str

    @property
    def agentic(self) -> bool:
        return self.max_turns > 0

    def paths(self, marker: str, index: int) -> list[str]:
        """What the router is asked of sample ``index`` of the kill step: its request record (math)
        or its latest turn's context and its prompt (agentic: ``L_T``, ``L_0``; the contexts are
        kept under the trajectory id with any grace, the per-turn request ids only with grace > 0)."""
        if not self.agentic:
            return [f"/requests/{marker}-step{KILL_STEP}-{index}"]
        group, sample = divmod(index, 4)  # 4 samples per task
        trajectory = f"{marker}-step{KILL_STEP}-g{group}-s{sample}"
        return [f"/contexts/{trajectory}", f"/contexts/{trajectory}/0"]


WORKLOADS = {
    "math": Workload(
        "math", [*_BASE, "data.workload=math", "rollout.concurrency=4"], 128, 0,
        "math, 3 steps x 128 samples (16 prompts x 8), rollout.concurrency=4",
    ),
    "tooluse": Workload(
        "tooluse", [*_BASE, "data.workload=tooluse", "data.held_out=4"], 16, 4,
        "tooluse (the default agentic workload: build task, adaptive checkpoints, sandbox kills p=0.05 "
        "per action, real Docker sandboxes), 3 steps x 16 trajectories (4 tasks x 4), data.held_out=4",
    ),
}  # fmt: skip


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _train(argv: list[str], log: Path, tag: str) -> subprocess.Popen[bytes]:
    """``belayer-grpo train --json``: the report to ``log``'s ``.json``, the rest to ``log``; every
    process of it carries ``BELAYER_BENCH_TAG=tag`` in its environment."""
    command = [sys.executable, "-m", "belayer_grpo", "train", "--json", *argv]
    env = {**os.environ, "BELAYER_BENCH_TAG": tag}
    with log.with_suffix(".json").open("wb") as out, log.open("wb") as err:
        return subprocess.Popen(command, stdout=out, stderr=err, env=env)


def _tagged(tag: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"BELAYER_BENCH_TAG={tag}".encode() in (
                proc / "environ"
            ).read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _settle(tag: str, within_s: float = 120.0) -> None:
    """Wait until no process of the run is left (the host stops after its run; a guardian reaps)."""
    deadline = time.monotonic() + within_s
    while _tagged(tag):
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of the run still alive after {within_s} s: {_tagged(tag)}")
        time.sleep(0.2)


def _logged(run_dir: Path) -> set[int]:
    path = run_dir / "rollouts" / f"step_{KILL_STEP:06d}.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    indices = set()
    for line in lines:
        try:
            indices.add(int(json.loads(line)["index"]))
        except (ValueError, KeyError):  # a line being written
            continue
    return indices


def _router(run_dir: Path) -> tuple[str, str, list[int]] | None:
    """The run's router URL and admin token and its slots' worker processes (found by their command
    line, which names the router and the run's slot folders); the token from the rollout host's
    file, else from a worker's environment (grace 0: the router lives in the trainer; needs root or
    the same user).  None until a worker runs."""
    slots, workers, token, url = str(run_dir / "slots"), [], None, None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode().split("\0")
            if "--router" not in argv or not any(arg.startswith(slots) for arg in argv):
                continue
            environ = (proc / "environ").read_bytes().decode().split("\0")
        except OSError:
            continue
        workers.append(int(proc.name))
        url = argv[argv.index("--router") + 1]
        env = dict(item.split("=", 1) for item in environ if "=" in item)
        token = env.get("BELAYER_ROUTER_ADMIN_TOKEN", token)
    host_file = run_dir / "rollout-host" / "host.json"
    if host_file.is_file():
        host = json.loads(host_file.read_text())
        url, token = host["url"], host["admin_token"]
    if not workers or url is None or token is None:
        return None
    return url, token, workers


def _signal_all(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """The whole lines of the kill step's log (samples, trajectories and journal events)."""
    path = run_dir / "rollouts" / f"step_{KILL_STEP:06d}.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def _logged_actions(run_dir: Path, marker: str, num_samples: int) -> dict[int, int]:
    """Agentic: by sample index, the journal's committed actions of each trajectory not finished in
    the log (after its last rewind), from the journal events of the kill step's log."""
    records, actions = _records(run_dir), {}
    finished = {r["index"] for r in records if "trajectory" in r and r.get("attempt") == 0}
    for index in range(num_samples):
        group, sample = divmod(index, 4)  # 4 samples per task
        trajectory = f"{marker}-step{KILL_STEP}-g{group}-s{sample}"
        if index in finished:
            continue
        turns: set[int] = set()
        for event in (r for r in records if r.get("trajectory_id") == trajectory):
            if event["event"] == "action":
                turns.add(int(event["turn"]))
            elif event["event"] == "rewind":
                turns = {t for t in turns if t <= int(event["turn"])}
        if turns:
            actions[index] = len(turns)
    return actions


def _kill_mid_rollout(
    workload: Workload, argv: list[str], run_dir: Path, log: Path, tag: str
) -> dict[str, Any]:
    """Train; SIGKILL the trainer once a quarter of step 2's samples are logged and the router has
    a request in flight (agentic: at once).  Just
    before, the slots' workers are paused (SIGSTOP: no token streams, no request ends) while the
    router is asked which of the step's samples missing from the log it has begun and with how
    many tokens; they go on (SIGCONT) after the kill."""
    train = _train(argv, log, tag)
    deadline = time.monotonic() + 900
    num_samples = workload.num_samples

    def alive() -> None:
        if train.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before the kill point: {log.read_text()[-3000:]}")

    workers: list[int] = []
    try:
        while (access := _router(run_dir)) is None:
            alive()
            time.sleep(0.1)
        url, token, workers = access
        marker = run_marker(run_dir)
        with RouterAdmin(url, token) as admin:
            while len(_logged(run_dir)) < num_samples // 4:
                alive()
                time.sleep(0.01)
            # (agentic: at once: the other trajectories are mid-flight then; a turn in flight
            # may come only in the next step, the step's last ones ending on sandbox work)
            while not workload.agentic and not admin.counters().values.get("requests_in_flight"):
                alive()
        _signal_all(workers, signal.SIGSTOP)
        paused = time.monotonic()
        time.sleep(0.05)  # what the workers had sent reaches the router
        missing = [i for i in range(num_samples) if i not in _logged(run_dir)]
        ids = {path: i for i in missing for path in workload.paths(marker, i)}
        held = anyio.run(_begun, url, token, list(ids))
        train.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        if train.wait(timeout=60) != -signal.SIGKILL:
            raise RuntimeError(
                f"the run ended before the kill (exit {train.returncode}): it was not mid-rollout"
            )
    finally:
        _signal_all(workers, signal.SIGCONT)
        if train.poll() is None:
            train.kill()
            train.wait()
    logged = _logged(run_dir)
    if len(logged) >= num_samples:
        raise RuntimeError(f"step {KILL_STEP} was whole in the log at the kill: not mid-rollout")
    # begun: sample index -> tokens so far (agentic: its latest turn and its context's tokens
    # after the prompt, responses and observations)
    begun: dict[int, int] = {}
    turns = 0
    for path, answer in held.items():
        index = ids[path]
        if index in logged:  # logged meanwhile: reused
            continue
        if not workload.agentic:
            begun[index] = len(answer["token_ids"])
        elif not path.endswith("/0") and int(answer["turn"]) >= 1:
            prompt = held.get(f"{path}/0", {"token_ids": []})
            begun[index] = len(answer["token_ids"]) - len(prompt["token_ids"])
            turns += int(answer["turn"])
    actions = _logged_actions(run_dir, marker, num_samples) if workload.agentic else {}
    return {
        "killed": killed,
        "workers_paused_s": killed - paused,
        "logged_at_kill": len(logged),
        "begun": len(begun),
        "begun_tokens": sum(begun.values()),
        "begun_turns": turns,
        "begun_actions": sum(actions.values()),  # agentic, from the journal (grace > 0 only)
    }


async def _begun(url: str, token: str, paths: list[str]) -> dict[str, dict[str, Any]]:
    """Of ``paths`` (``GET``), the router's answers to those it holds: all asked at once (with grace
    0 the router shares the busy trainer's event loop; one by one took long enough for the run to
    finish first)."""
    found: dict[str, dict[str, Any]] = {}
    headers = {"Authorization": f"Bearer {token}"}
    limits = httpx.Limits(max_connections=len(paths) or 1)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, limits=limits) as client:

        async def one(path: str) -> None:
            answer = await client.get(path)
            if answer.status_code == 200:
                found[path] = answer.json()
            elif answer.status_code != 404:
                raise RuntimeError(f"GET {path}: {answer.status_code} {answer.text}")

        async with anyio.create_task_group() as group:
            for path in paths:
                group.start_soon(one, path)
    return found


def _resume(run_dir: Path, log: Path, killed: float, tag: str) -> dict[str, Any]:
    """``--resume`` at once; seconds from the kill to step 2's metrics record and to the exit."""
    train = _train(["--resume", str(run_dir)], log, tag)
    metrics, step_done = run_dir / "metrics.jsonl", None
    while train.poll() is None:
        if step_done is None and metrics.is_file():
            steps = [
                json.loads(line).get("step") for line in metrics.read_text().splitlines() if line.strip()
            ]
            if KILL_STEP in steps:
                step_done = time.monotonic()
        time.sleep(0.05)
    ended = time.monotonic()
    if train.returncode != 0:
        raise RuntimeError(f"--resume failed ({train.returncode}): {log.read_text()[-3000:]}")
    report = json.loads(log.with_suffix(".json").read_text())
    if step_done is None:
        step_done = ended
    return {"step_s": step_done - killed, "run_s": ended - killed, "report": report}


def _uninterrupted(argv: list[str], log: Path) -> float:
    tag = os.urandom(8).hex()
    started = time.monotonic()
    train = _train(argv, log, tag)
    train.wait()
    if train.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed: {log.read_text()[-3000:]}")
    wall = time.monotonic() - started
    _settle(tag)
    return wall


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(
        run_dir / "checkpoints" / f"step_{STEPS:06d}.pt", map_location="cpu", weights_only=False
    )
    return dict(state["model"])


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    if a.keys() != b.keys():
        return {"bit_equal": False, "max_abs_diff": None}
    diff = max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)
    return {"bit_equal": all(torch.equal(a[k], b[k]) for k in a), "max_abs_diff": diff}


def _arm(
    workload: Workload, kind: str, grace: float, root: Path, run_dir: Path, reference: dict[str, torch.Tensor]
) -> dict[str, Any]:
    argv = [*workload.overrides, f"system.resume_grace_s={grace}", f"system.run_dir={str(run_dir)!r}"]
    tag = os.urandom(8).hex()
    kill = _kill_mid_rollout(workload, argv, run_dir, root / f"{kind}-killed.log", tag)
    num_samples = workload.num_samples
    resumed = _resume(run_dir, root / f"{kind}-resumed.log", kill["killed"], tag)
    _settle(tag)
    report = resumed["report"]
    if report.get("status") != "completed" or report.get("steps") != STEPS:
        raise RuntimeError(f"{kind}: the resumed run did not complete: {report}")
    reused = int(report["trajectories_reused"])
    if kind == "host":
        reattached, reattached_tokens = int(report["requests_reattached"]), int(report["tokens_reattached"])
        regenerated, new = int(report["trajectories_regenerated"]), int(report["trajectories_new"])
        tokens_regenerated = 0 if regenerated == 0 else None
    else:  # grace 0: every missing sample is generated again; those begun before the kill are lost work
        reattached = reattached_tokens = 0
        regenerated, new = kill["begun"], num_samples - reused - kill["begun"]
        # (agentic: the router's contexts do not tell generated tokens from observations)
        tokens_regenerated = None if workload.agentic else kill["begun_tokens"]
        counted = int(report["trajectories_regenerated"])
        # (agentic: a group resampled after an unrecoverable trajectory generates more)
        if counted != num_samples - reused and not (workload.agentic and counted > num_samples - reused):
            raise RuntimeError(f"baseline: report counts {counted} regenerated")
    agentic: dict[str, Any] = {}
    if workload.agentic:
        keys = ("trajectories_reattached", "actions_replayed", "sandboxes_restored_from_checkpoint",
                "reattached_inconsistent", "rebuild_failures_recovered")  # fmt: skip
        agentic = {
            "turns_begun_before_kill": kill["begun_turns"],
            "actions_begun_before_kill": kill["begun_actions"] if kind == "host" else None,
            **{key: int(report.get(key, 0)) if kind == "host" else 0 for key in keys},
            # the baseline runs every action of a begun trajectory again (the journal, grace > 0
            # only, would say how many)
            "actions_run_again": int(report.get("actions_replayed", 0)) if kind == "host" else None,
        }
    weights = _compare(reference, _weights(run_dir))
    run_dir.rename(root / kind)
    return {
        "kill_to_step_done_s": resumed["step_s"],
        "kill_to_run_done_s": resumed["run_s"],
        "samples_logged_at_kill": kill["logged_at_kill"],
        "samples_reused": reused,
        "samples_reattached": reattached,
        "samples_regenerated": regenerated,
        "samples_new": new,
        "tokens_reattached": reattached_tokens,
        "tokens_regenerated": tokens_regenerated,
        "begun_before_kill": kill["begun"],
        "workers_paused_before_kill_s": kill["workers_paused_s"],
        "tokens_begun_before_kill": kill["begun_tokens"],
        "resumed_report_wall_s": report.get("wall_s"),
        "weights_vs_reference": weights,
        **agentic,
    }


def one_rep(workload: Workload, rep: int, grace: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        root = Path(tmp)
        run_dir = root / "run"
        walls: dict[str, float] = {}
        order = [0.0, grace] if rep % 2 == 0 else [grace, 0.0]  # alternated: load drifts over a rep
        for g in order:
            name = "grace_0" if g == 0 else "grace_on"
            argv = [*workload.overrides, f"system.resume_grace_s={g}", f"system.run_dir={str(run_dir)!r}"]
            walls[name] = _uninterrupted(argv, root / f"reference-{name}.log")
            run_dir.rename(root / f"reference-{name}")
        reference = _weights(root / "reference-grace_0")
        arms: dict[str, Any] = {}
        for kind in ["baseline", "host"] if rep % 2 == 0 else ["host", "baseline"]:
            arms[kind] = _arm(workload, kind, 0.0 if kind == "baseline" else grace, root, run_dir, reference)
        return {
            "rep": rep,
            "reference_wall_s": walls,
            "reference_grace_on_vs_grace_0": _compare(reference, _weights(root / "reference-grace_on")),
            **arms,
        }


def _cell(reps: list[dict[str, Any]], get: Any, digits: int = 1, unit: str = " s") -> str:
    values = sorted(float(get(r)) for r in reps)
    return f"{statistics.median(values):.{digits}f}{unit} [{values[0]:.{digits}f}, {values[-1]:.{digits}f}]"


def _table(document: dict[str, Any]) -> str:
    reps = document["reps"]
    agentic = document.get("workload") == "tooluse"

    def arm(kind: str, key: str, digits: int = 1, unit: str = " s") -> str:
        if any(r[kind][key] is None for r in reps):
            return "n/a"
        return _cell(reps, lambda r: r[kind][key], digits, unit)

    def weights(kind: str) -> str:
        checks = [r[kind]["weights_vs_reference"] for r in reps]
        if all(c["bit_equal"] for c in checks):
            return "bit-equal (all reps)"
        return "max abs diff " + ", ".join(str(c["max_abs_diff"]) for c in checks)

    rows = [
        ("kill -> resumed run finished step 2", arm("host", "kill_to_step_done_s"), arm("baseline", "kill_to_step_done_s")),
        ("kill -> resumed run finished (step 3 too)", arm("host", "kill_to_run_done_s"), arm("baseline", "kill_to_run_done_s")),
        ("samples in the log at the kill (reused)", arm("host", "samples_reused", 0, ""), arm("baseline", "samples_reused", 0, "")),
        ("samples re-attached (router held them)", arm("host", "samples_reattached", 0, ""), arm("baseline", "samples_reattached", 0, "")),
        ("samples regenerated (begun before the kill)", arm("host", "samples_regenerated", 0, ""), arm("baseline", "samples_regenerated", 0, "")),
        ("samples never sent before the kill", arm("host", "samples_new", 0, ""), arm("baseline", "samples_new", 0, "")),
        ("tokens re-attached (not generated again)", arm("host", "tokens_reattached", 0, ""), arm("baseline", "tokens_reattached", 0, "")),
        ("tokens regenerated", arm("host", "tokens_regenerated", 0, ""), arm("baseline", "tokens_regenerated", 0, "")),
        ("final weights vs the uninterrupted run", weights("host"), weights("baseline")),
    ]  # fmt: skip
    if agentic:  # trajectories: samples are trajectories, requests their turns
        rows = [(a.replace("samples", "trajectories"), b, c) for a, b, c in rows]
        rows[3] = ("turns re-attached (router held them)", rows[3][1], rows[3][2])
        rows[-1:-1] = [
            ("context tokens of the begun trajectories at the kill (responses + observations)", arm("host", "tokens_begun_before_kill", 0, ""), arm("baseline", "tokens_begun_before_kill", 0, "")),
            ("turns of the begun trajectories at the kill", arm("host", "turns_begun_before_kill", 0, ""), arm("baseline", "turns_begun_before_kill", 0, "")),
            ("begun trajectories continued from their journal", arm("host", "trajectories_reattached", 0, ""), arm("baseline", "trajectories_reattached", 0, "")),
            ("actions the begun trajectories had logged (journal: host path only)", arm("host", "actions_begun_before_kill", 0, ""), arm("baseline", "actions_begun_before_kill", 0, "")),
            ("logged actions run again (baseline: every action of a begun trajectory, uncounted)", arm("host", "actions_run_again", 0, ""), arm("baseline", "actions_run_again", 0, "")),
            ("sandboxes restored from a logged checkpoint", arm("host", "sandboxes_restored_from_checkpoint", 0, ""), "n/a"),
            ("replays that returned something else", arm("host", "reattached_inconsistent", 0, ""), "n/a"),
            ("sandbox failures recovered while rebuilding", arm("host", "rebuild_failures_recovered", 0, ""), "n/a"),
        ]  # fmt: skip
    ref = [r["reference_grace_on_vs_grace_0"] for r in reps]
    on = [r["reference_wall_s"]["grace_on"] for r in reps]
    off = [r["reference_wall_s"]["grace_0"] for r in reps]
    ratio = [a / b for a, b in zip(on, off, strict=True)]
    lines = [
        f"`{document['command']}`: {len(reps)} repetitions, {document['started_utc']} to {document['ended_utc']} UTC; "
        f"{document['setup']}. Median [min, max] over the repetitions.",
        "",
        f"| after a SIGKILL of the trainer mid-step-{KILL_STEP} | host path (grace {document['grace_s']:g} s) "
        "| baseline (grace 0: new rollout side) |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
        "| uninterrupted run, nothing fails | grace 0 | grace > 0 (rollout host) | ratio |",
        "|---|---|---|---|",
        f"| wall time ({STEPS} steps, start-up included) | {_cell(reps, lambda r: r['reference_wall_s']['grace_0'])} "
        f"| {_cell(reps, lambda r: r['reference_wall_s']['grace_on'])} "
        f"| {statistics.median(ratio):.2f} [{min(ratio):.2f}, {max(ratio):.2f}] |",
        "",
        "Uninterrupted grace > 0 weights vs grace 0: "
        + ("bit-equal (all reps)" if all(c["bit_equal"] for c in ref) else str(ref))
        + ".",
        f"uptime at start: `{document['uptime_before']}`",
        f"uptime at end: `{document['uptime_after']}`",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--grace", type=float, default=300.0, help="system.resume_grace_s of the host path")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="math")
    parser.add_argument(
        "--out", type=Path, default=None, help="results file (default: benchmarks/results/...)"
    )
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    name = "bench_resume" if workload.name == "math" else f"bench_resume_{workload.name}"
    out: Path = args.out or RESULTS / f"{name}.json"
    kill_point = "" if workload.agentic else " and a request was in flight"
    uptime_before, load_before, started = _uptime(), os.getloadavg(), time.time()
    reps: list[dict[str, Any]] = []
    for rep in range(args.reps):
        reps.append(one_rep(workload, rep, args.grace))
        print(json.dumps(reps[-1]), file=sys.stderr, flush=True)
        document = {
            "benchmark": "bench_resume",
            "command": "python benchmarks/bench_resume.py"
            + (f" --workload {workload.name}" if workload.name != "math" else "")
            + f" --reps {args.reps}"
            + (f" --grace {args.grace:g}" if args.grace != 300.0 else ""),
            "workload": workload.name,
            "grace_s": args.grace,
            "setup": f"{workload.setup}, fixed seed, 1 slot on CPU (the default), trainer SIGKILLed once "
            f"{workload.num_samples // 4} of step {KILL_STEP}'s samples were logged{kill_point}; "
            "shared 2-core machine",
            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
            "ended_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "uptime_before": uptime_before,
            "uptime_after": _uptime(),
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
            "repetitions": len(reps),
            "reps": reps,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=2) + "\n")
        out.with_suffix(".md").write_text(_table(document))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
