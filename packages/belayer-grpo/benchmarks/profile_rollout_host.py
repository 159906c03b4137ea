"""Where the rollout host (``system.resume_grace_s > 0``) costs time when nothing fails, part by part.

Each part is timed with the host and without it (the trainer's own `RolloutSystem`), alternated,
on the same default math configuration, model and weights as ``belayer-grpo train`` (1 slot on CPU):

- **start**: `HostSystem.start` (a second Python process: its imports, torch among them, the spec
  file, the router and the slot started there, ``host.json`` polled) against `RolloutSystem.start`
  in this process (torch already imported), until each yields; and in one step of ``belayer-grpo
  train`` (which since 0.6.9 starts the host before it prepares, `prespawn`): the host's import of
  its slot supervisor (torch) and its wait for the trainer's spec after it, from ``host.log``; **stop**: until each has stopped (the host: a ``stop`` call, then its exit);
  **imports**: a bare ``python -c 'import ...'`` of what the host imports (part of its start);
- **control call**: one ``status`` call on ``control.sock`` (a connection, a JSON line each way)
  against the same answer in process;
- **weight push**: `WeightSync.push` of the policy's weights (into the slot's weight server, then
  saved once to a file that the slot keeps: ``keep_weights``, through the control socket with the
  host, in process without);
- **journal event**: `StepLog.append_event` of a typical ``action`` event (written, flushed and
  fsynced; agentic runs with grace > 0 only) and, for scale, the same write without the fsync;
- **lease**: `set_lease` (flock, write, fsync).

    python benchmarks/profile_rollout_host.py --reps 3

Writes ``benchmarks/results/profile_rollout_host.json`` and ``.md`` with ``uptime`` at start and end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

from belayer_grpo._config import Config, load_config
from belayer_grpo._lease import set_lease
from belayer_grpo._model import build_policy, build_tokenizer, engine_model_config
from belayer_grpo._rollout_host import HostSystem
from belayer_grpo._rollout_log import StepLog
from belayer_grpo._system import RolloutSystem
from belayer_grpo._weight_sync import WeightSync

RESULTS = Path(__file__).parent / "results"
_HOST_IMPORTS = (
    "import belayer_grpo._rollout_host, belayer_grpo._system, belayer_grpo._cluster.system, "
    "belayer_grpo._cluster.hosted, belayer_shadow; belayer_shadow.SlotSupervisor"
)  # the supervisor fills its weight server with torch: torch comes with it


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


class _Weights:
    """What `WeightSync.push` reads of a model: its state dict."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors


def _timed(call: Callable[[], Any], times: int) -> list[float]:
    out = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        out.append(time.perf_counter() - started)
    return out


def _policy() -> tuple[Config, Any, dict[str, torch.Tensor]]:
    """The train command's configuration, engine model config and initial weights (math)."""
    from belayer_shadow import weight_layout

    config = load_config(None, ["data.workload=math", "rollout.concurrency=4"])
    torch.set_num_threads(1)  # as the trainer
    model_config = engine_model_config(config.model, build_tokenizer(config.model, "math"), 512)
    state = build_policy(model_config, seed=config.model.seed, path=config.model.path).state_dict()
    names = [spec.name for spec in weight_layout(model_config).tensors]
    return config, model_config, {name: state[name].detach().contiguous().clone() for name in names}


async def _one(kind: str, root: Path, policy: tuple[Config, Any, dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One start, a few calls and pushes, one stop of ``kind`` (``host`` or ``in_process``)."""
    from safetensors.torch import save_file

    config, model_config, tensors = policy
    run_dir = root / kind
    run_dir.mkdir()
    weights = run_dir / "policy_init.safetensors"
    save_file(tensors, str(weights))
    starter = HostSystem.start if kind == "host" else RolloutSystem.start
    started = time.perf_counter()
    async with starter(config, run_dir, model_config, weights) as system:
        start_s = time.perf_counter() - started
        status = await anyio.to_thread.run_sync(
            _timed, lambda: (system.healthy_slots(), system.num_handovers()), 20
        )
        sync = WeightSync(
            system.weight_sockets,
            keepers=[slot.keep_weights for slot in system.slots],
            keep_file=run_dir / "pushed-weights.safetensors",
        )
        model = _Weights(tensors)
        pushes = await anyio.to_thread.run_sync(_timed, lambda: sync.push(model), 5)  # type: ignore[arg-type]
        stopping = time.perf_counter()
    stop_s = time.perf_counter() - stopping
    return {
        "start_s": start_s, "stop_s": stop_s, "status_call_s": status,
        "weight_push_s": pushes,
    }  # fmt: skip


def _train(root: Path) -> dict[str, float]:
    """One step of ``belayer-grpo train`` with a grace period: what its host's log says of its import
    (started before the trainer prepares) and of its wait for the trainer's spec."""
    run_dir = root / "train"
    command = [sys.executable, "-m", "belayer_grpo", "train", "algorithm.steps=1", "logging.progress=false",
               "logging.tensorboard=false", "chaos.kill_worker_at_steps=[]", "data.workload=math",
               "system.resume_grace_s=300", f"system.run_dir={str(run_dir)!r}"]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    log = (run_dir / "rollout-host" / "host.log").read_text()
    found = re.search(r"imported the slot supervisor in ([\d.]+) s, then waited ([\d.]+) s", log)
    if found is None:
        raise RuntimeError(f"the host's log does not say how long it imported: {log[-2000:]}")
    return {"import_s": float(found.group(1)), "waited_s": float(found.group(2))}


def _journal(root: Path, times: int) -> dict[str, list[float]]:
    event = {
        "event": "action", "v": 1, "trajectory_id": "run-step2-g0-s0", "turn": 3, "prefix": 3,
        "command": "python build.py --target all", "exit_code": 0, "stdout": "built 12 files\n" * 4,
        "stderr": "", "duration_s": 0.21, "context_hash": "0" * 64,
    }  # fmt: skip
    log = StepLog.open(root / "rollouts" / "step_000002.jsonl")
    with_fsync = _timed(lambda: log.append_event(event), times)
    log.close()
    with (root / "no-fsync.jsonl").open("wb") as out:

        def write() -> None:
            out.write(json.dumps(event).encode() + b"\n")
            out.flush()

        without = _timed(write, times)
    return {"journal_event_s": with_fsync, "journal_event_no_fsync_s": without}


def _ms(values: list[float]) -> str:
    values = sorted(values)
    return f"{statistics.median(values) * 1e3:.2f} ms [{values[0] * 1e3:.2f}, {values[-1] * 1e3:.2f}]"


def _s(values: list[float]) -> str:
    values = sorted(values)
    return f"{statistics.median(values):.2f} s [{values[0]:.2f}, {values[-1]:.2f}]"


def _table(document: dict[str, Any]) -> str:
    reps = document["reps"]

    def pooled(kind: str, key: str) -> list[float]:
        return [v for r in reps for v in r[kind][key]]

    def each(kind: str, key: str) -> list[float]:
        return [r[kind][key] for r in reps]

    starts = [r["host"]["start_s"] - r["in_process"]["start_s"] for r in reps]
    rows = [
        ("start (until the router and every slot serve)", _s(each("in_process", "start_s")), _s(each("host", "start_s")), _s(starts)),
        ("`belayer-grpo train` (1 step, grace 300): the host's import of the slot supervisor (torch), started before the trainer prepares (`prespawn`, 0.6.9)", "-", _s([r["train"]["import_s"] for r in reps]), "-"),
        ("... and then its wait for the trainer's spec (> 0: the import was off the start's critical path)", "-", _s([r["train"]["waited_s"] for r in reps]), "-"),
        ("of the start: `python -c 'import ...'` of the host's modules (torch with the slot supervisor)", "-", _s([v for r in reps for v in r["imports_s"]]), "-"),
        ("stop", _s(each("in_process", "stop_s")), _s(each("host", "stop_s")), _s([r["host"]["stop_s"] - r["in_process"]["stop_s"] for r in reps])),
        ("`status` call (healthy slots, handovers)", _ms(pooled("in_process", "status_call_s")), _ms(pooled("host", "status_call_s")), "-"),
        ("weight push (server + file + keep_weights)", _ms(pooled("in_process", "weight_push_s")), _ms(pooled("host", "weight_push_s")), "-"),
        ("journal event (write + fsync; agentic, grace > 0 only)", "-", _ms([v for r in reps for v in r["journal_event_s"]]), "-"),
        ("for scale: the same write without fsync", _ms([v for r in reps for v in r["journal_event_no_fsync_s"]]), "-", "-"),
        ("lease (`set_lease`: flock + write + fsync, once per start)", "-", _ms([v for r in reps for v in r["lease_s"]]), "-"),
    ]  # fmt: skip
    return "\n".join(
        [
            f"`{document['command']}`: {len(reps)} repetitions (host and in-process alternated), "
            f"{document['started_utc']} to {document['ended_utc']} UTC; default math configuration, 1 slot "
            "on CPU; shared 2-core machine. Median [min, max]; the calls, pushes and events pooled over the repetitions.",
            "",
            "| part | grace 0 (in the trainer) | grace > 0 (rollout host) | host - in process (per rep) |",
            "|---|---|---|---|",
            *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows),
            "",
            f"uptime at start: `{document['uptime_before']}`",
            f"uptime at end: `{document['uptime_after']}`",
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_rollout_host.json")
    args = parser.parse_args()
    uptime_before, started = _uptime(), time.time()
    policy = _policy()
    reps = []
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="profile-host-") as tmp:
            root = Path(tmp)
            rep_out: dict[str, Any] = {"rep": rep}
            kinds = ["in_process", "host"]
            for kind in kinds if rep % 2 == 0 else kinds[::-1]:
                rep_out[kind] = anyio.run(_one, kind, root, policy)
            rep_out["imports_s"] = _timed(
                lambda: subprocess.run([sys.executable, "-c", _HOST_IMPORTS], check=True), 2
            )
            rep_out["train"] = _train(root)
            rep_out.update(_journal(root, 50))
            lease_dir = root / "lease"
            lease_dir.mkdir()
            rep_out["lease_s"] = _timed(functools.partial(set_lease, lease_dir, os.getpid()), 20)
            reps.append(rep_out)
            print(json.dumps({k: v for k, v in rep_out.items() if k in ("rep", *kinds)}),
                  file=sys.stderr, flush=True)  # fmt: skip
    document = {
        "benchmark": "profile_rollout_host",
        "command": f"python benchmarks/profile_rollout_host.py --reps {args.reps}",
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "ended_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "uptime_before": uptime_before,
        "uptime_after": _uptime(),
        "reps": reps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_table(document))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
