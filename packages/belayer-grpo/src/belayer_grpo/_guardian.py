"""Nothing orphaned: what a killed run left in its run folder is reaped, at once or at the next start.

Every process of a training run carries ``BELAYER_GRPO_RUN=<marker>`` in its environment (the
trainer sets it before it starts anything, and every descendant inherits it), every sandbox the
run creates carries the label ``belayer.grpo.run=<tag>``.  `reap_run` finds both without any
record that the dead trainer would have had to write, kills and removes them, and removes the
run's sockets, memory folders, sandbox checkpoints and torn training checkpoints (never a
complete ``step_*.pt``: a resumed run needs them).  The nodes of a ``cluster.isolated`` run (each a
PID namespace whose processes carry the marker too) die with the rest; their network namespaces,
veths and bridge, which no process holds, are torn down by belayer-cluster's `clean_stale_clusters`.

belayer-shadow's `reap_stale_processes` runs first on every slot folder (what each slot
supervisor recorded in its ``processes.json``; shadow's own per-slot guardian covers the slots
too).  Two callers: `belayer-grpo train` itself, before it starts anything in a run folder (an earlier
run there may have been SIGKILLed), and a small guardian process (`guard_run`) that the trainer
starts in a session of its own.  The guardian holds the read end of a pipe whose write end only
the trainer has; it reads end-of-file the moment the trainer dies, however it dies, and then
reaps.  A trainer that stops cleanly writes ``done`` first and the guardian just exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from belayer_grpo._errors import SystemStartError
from belayer_grpo._lease import adopted_by, claim_for_reap, host_info

__all__ = [
    "RUN_ENV",
    "RUN_LABEL",
    "Guardian",
    "ReapReport",
    "find_run_processes",
    "guard_run",
    "reap_run",
    "run_facts",
    "run_marker",
    "run_processes_marked",
]

RUN_ENV = "BELAYER_GRPO_RUN"
RUN_LABEL = "belayer.grpo.run"
_DONE = b"done"


def run_marker(run_dir: Path) -> str:
    """The run folder's marker: the same for every run in that folder, different between folders."""
    return "r" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]


@attrs.frozen
class ReapReport:
    """What `reap_run` found and removed."""

    pids: tuple[int, ...] = ()
    sockets: tuple[str, ...] = ()
    containers: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()
    clusters: tuple[str, ...] = ()  # isolated local clusters whose networks were torn down

    @property
    def empty(self) -> bool:
        """True when nothing was left behind."""
        return not (self.pids or self.sockets or self.containers or self.paths or self.clusters)

    def describe(self) -> str:
        """One line for the log."""
        return (
            f"{len(self.pids)} process(es), {len(self.sockets)} socket(s), "
            f"{len(self.containers)} sandbox(es), {len(self.paths)} folder(s)/file(s), "
            f"{len(self.clusters)} isolated cluster(s)"
        )


def find_run_processes(marker: str, *, exclude: tuple[int, ...] = ()) -> list[int]:
    """Live processes whose environment carries ``BELAYER_GRPO_RUN=marker`` (zombies have none)."""
    wanted = f"{RUN_ENV}={marker}".encode()
    skip = {os.getpid(), *exclude}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def _kill_processes(marker: str, exclude: tuple[int, ...], timeout_s: float) -> list[int]:
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    while pids := find_run_processes(marker, exclude=exclude):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return killed


def _run_config(run_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _isolated(run_dir: Path) -> bool:
    cluster = _run_config(run_dir).get("cluster")
    return isinstance(cluster, dict) and bool(cluster.get("isolated"))


def _remove_isolated_clusters(isolated: bool) -> list[str]:
    if not isolated:
        return []  # only `cluster.isolated` makes namespaces and links that outlive their processes
    from belayer_cluster import clean_stale_clusters

    # Every cluster whose owner is dead: the killed trainer's (its processes are gone by now).
    return clean_stale_clusters()


def _cluster_shared(run_dir: Path) -> list[Path]:
    """The temporary shared folder of a cluster run (its router journal, the slots' folders), if
    one is recorded; only a folder that belayer-grpo made (its name says so)."""
    try:
        shared = Path((run_dir / "cluster-shared").read_text().strip())
    except OSError:
        return []
    if not shared.is_absolute() or not shared.name.startswith("belayer-grpo-cluster-"):
        return []
    return [shared, run_dir / "cluster-shared"]


def run_facts(run_dir: Path) -> tuple[bool, list[Path]]:
    """What a reap needs of the folder besides its processes: whether its cluster is isolated
    (namespaces and links to tear down) and its cluster's shared folder with the record naming it."""
    return _isolated(run_dir), _cluster_shared(run_dir)


def _workload(run_dir: Path) -> str | None:
    data = _run_config(run_dir).get("data")
    workload = data.get("workload") if isinstance(data, dict) else None
    return workload if isinstance(workload, str) else None


def _remove_containers(run_dir: Path, marker: str, workload: str | None) -> list[str]:
    workload = workload or _workload(run_dir)
    if workload is None:
        return []  # no configuration: no run ever made sandboxes here
    if workload == "math":
        return []  # only the agentic workloads create sandboxes; a math run needs no container engine
    from belayer_envckpt import BelayerEnvckptError, Engine

    try:
        with Engine.connect() as engine:
            found = engine.list_containers([f"{RUN_LABEL}={marker}"])
            for container in found:
                engine.remove(container.id)
    except BelayerEnvckptError as error:
        print(f"belayer-grpo: cannot remove the run's sandboxes: {error}", file=sys.stderr)
        return []
    return [container.id for container in found]


def _reap_slots(run_dir: Path, owner_gone: bool) -> list[int]:
    from belayer_shadow import BelayerShadowError, reap_stale_processes

    pids: list[int] = []
    for slot in sorted(run_dir.glob("slots/*")):
        try:
            pids += reap_stale_processes(slot, owner_gone=owner_gone)
        except BelayerShadowError as error:
            if not owner_gone:  # a live trainer owns the folder: its processes are not leftovers
                raise SystemStartError(
                    f"{error}; another `belayer-grpo train` seems to use {run_dir}: stop it or pick "
                    "another system.run_dir"
                ) from error
            # The guardian keeps going: the marker scan below kills what this left.
            print(f"belayer-grpo guardian: {slot}: {error}", file=sys.stderr, flush=True)
    return pids


def reap_run(
    run_dir: Path,
    *,
    exclude: tuple[int, ...] = (),
    timeout_s: float = 20.0,
    owner_gone: bool = False,
    keep_rollout_host: bool = False,
    keep_sandboxes: bool = False,
    workload: str | None = None,
    at_death: tuple[bool, list[Path]] | None = None,
) -> ReapReport:
    """Kill and remove everything of an earlier run in ``run_dir`` that is still there.

    ``owner_gone``: the caller knows the trainer is dead (the guardian), so a slot folder whose
    recorded owner still looks alive (an unreaped zombie) is reaped anyway; otherwise such a
    folder raises `SystemStartError`.  ``keep_rollout_host``: a resumed trainer that adopted the
    run's rollout host (`belayer_grpo._rollout_host`) keeps its processes, sockets and memory
    folders and the sandbox checkpoints (the trajectories in flight continue from them,
    `belayer_grpo._agentic.journal`); the killed trainer's sandboxes still go, unless
    ``keep_sandboxes``: on Ray they are the adopted host's sandbox hosts' (it removes those the
    killed trainer's trajectories held, `belayer_grpo._cluster.hosted_sandboxes`).
    ``workload``: the run's ``data.workload`` when its ``config.json`` may be gone by now (the
    guardian reads it when the trainer dies, before a grace period), else read from it;
    ``at_death`` likewise: whether the run's cluster was isolated and its shared folder
    (`run_facts`).
    """
    isolated, shared = at_death if at_death is not None else run_facts(run_dir)
    marker = run_marker(run_dir)
    pids: list[int] = []
    sockets = []
    if not keep_rollout_host:
        # The slots' own records first (start-time checked), then everything that carries the marker.
        pids = _reap_slots(run_dir, owner_gone)
        pids += [pid for pid in _kill_processes(marker, exclude, timeout_s) if pid not in pids]
        for socket in run_dir.rglob("*.sock"):
            with contextlib.suppress(FileNotFoundError):
                socket.unlink()
                sockets.append(str(socket))
    containers = [] if keep_sandboxes else _remove_containers(run_dir, marker, workload)
    clusters = _remove_isolated_clusters(isolated)
    paths = []
    # Memory-server folders, sandbox checkpoints of trajectories that will never resume, torn
    # training checkpoints (complete ones stay: `system.resume=latest` reads them).
    for path in [
        *([] if keep_rollout_host else run_dir.glob("slots/*/mem")),
        *([] if keep_rollout_host else [run_dir / "env-checkpoints"]),
        *run_dir.glob("checkpoints/.*.tmp"),
        *([] if keep_rollout_host else [run_dir / "rollout-host" / "host.json"]),
        *([] if keep_rollout_host else shared),
    ]:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            paths.append(str(path))
        elif path.exists():
            path.unlink(missing_ok=True)
            paths.append(str(path))
    return ReapReport(tuple(pids), tuple(sockets), tuple(containers), tuple(paths), tuple(clusters))


@contextlib.contextmanager
def run_processes_marked(run_dir: Path) -> Iterator[str]:
    """Every process started inside carries the run's marker (the variable is restored after)."""
    marker = run_marker(run_dir)
    previous = os.environ.get(RUN_ENV)
    os.environ[RUN_ENV] = marker
    try:
        yield marker
    finally:
        if previous is None:
            os.environ.pop(RUN_ENV, None)
        else:
            os.environ[RUN_ENV] = previous


@attrs.define
class Guardian:
    """The trainer's side of the guardian process of one run folder (a context manager)."""

    run_dir: Path
    _process: subprocess.Popen[bytes] | None = None
    _pipe: IO[bytes] | None = None

    def __enter__(self) -> Guardian:
        env = {key: value for key, value in os.environ.items() if key != RUN_ENV}
        with (self.run_dir / "guardian.log").open("ab") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "belayer_grpo._guardian", str(self.run_dir), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                start_new_session=True,  # a signal to the trainer's process group does not reach it
            )
        self._pipe = self._process.stdin
        return self

    def __exit__(self, *_exc: object) -> None:
        # Clean stop: everything was stopped by the trainer itself; the guardian only exits.
        if self._pipe is not None:
            with contextlib.suppress(OSError):
                self._pipe.write(_DONE)
                self._pipe.close()
        if self._process is not None:
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def _adopted_in_grace(run_dir: Path, trainer_pid: int) -> bool:
    """With a rollout host running (``system.resume_grace_s > 0``): wait the grace period for a
    trainer to take the lease (`belayer_grpo._lease`); True when one did (it owns the run now)."""
    try:
        grace_s = float(_run_config(run_dir)["system"]["resume_grace_s"])
    except (KeyError, TypeError, ValueError):
        grace_s = 0.0
    if grace_s <= 0 or host_info(run_dir) is None:
        return False
    print(f"belayer-grpo guardian: trainer {trainer_pid} died; its rollout host waits {grace_s:g} s "
          "for `belayer-grpo train --resume`", file=sys.stderr, flush=True)  # fmt: skip
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if (adopter := adopted_by(run_dir, trainer_pid)) is not None:
            print(f"belayer-grpo guardian: trainer {adopter} took the run over", file=sys.stderr, flush=True)
            return True
        time.sleep(0.2)
    if not claim_for_reap(run_dir, trainer_pid):
        print("belayer-grpo guardian: a trainer took the run over", file=sys.stderr, flush=True)
        return True
    return False


def guard_run(run_dir: Path, trainer_pid: int) -> int:
    """The guardian process: wait for the trainer's end; reap the run folder unless it said done."""
    message = sys.stdin.buffer.read()  # end-of-file: the trainer exited or was killed
    if message == _DONE:
        return 0
    # Now: the folder may be removed while a grace period runs (what it names must still go).
    workload, facts = _workload(run_dir), run_facts(run_dir)
    if _adopted_in_grace(run_dir, trainer_pid):
        return 0
    report = reap_run(run_dir, exclude=(trainer_pid,), owner_gone=True, workload=workload, at_death=facts)
    print(
        f"belayer-grpo guardian: trainer {trainer_pid} died; reaped {report.describe()}",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(guard_run(Path(sys.argv[1]), int(sys.argv[2])))
