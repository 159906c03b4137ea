"""Node-loss recovery on a local Ray cluster: Belayer against a whole-job restart, in the same run.

Each repetition starts a fresh local Ray cluster of 4 simulated nodes (1 CPU each), a driver-owned
router, two slots (`a`, `b`) on two nodes and a sandbox host per node. Both arms lose the node of
slot `b` mid-rollout (6 greedy streams of `--tokens` tokens, 8 tokens in), with a live sandbox on
that node checkpointed just before; both see the loss the same way (`RolloutCluster`'s watcher:
Ray's node table or the router's broken streams).

- **whole-job restart** (the baseline, first): on detection the job is torn down (router, every
  slot) and restarted on the nodes left: a new router, two new slots that load the last trainer
  checkpoint (`weights=`, a safetensors file on the shared directory), the lost sandbox restored
  from its checkpoint, and every request sent again; recovered when every request has regenerated
  the tokens it had and streams new ones.
- **Belayer** (second, on the same Ray cluster, slots restarted fresh): the lost node's slot is
  fenced at the router, its requests resume token-exact on the slot left, the sandbox is restored
  on another node; recovered when every affected request streams again and the sandbox is back.

Times are from the node's removal. Writes `benchmarks/results/bench_node_loss.json` and a markdown
table beside it (`.md`: medians with [min, max] over the repetitions, `uptime` at start and end);
with `--nodes isolated` (root) the nodes share nothing (`IsolatedRayCluster`: the lost node is
killed whole) and the results go to `benchmarks/results/bench_node_loss_isolated.json` (and `.md`).

    python benchmarks/bench_node_loss.py --reps 3 --tokens 200
    python benchmarks/bench_node_loss.py --reps 3 --tokens 200 --nodes isolated
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio

from belayer_cluster import (
    DriverRouter,
    IsolatedRayCluster,
    LocalClusterConfig,
    LocalRayCluster,
    RolloutCluster,
    SandboxCluster,
)
from belayer_router import RouterClient, TokenEvent

TOKEN = "bench-node-loss-admin-token"
PROMPTS = [[10 + i, 20 + 3 * i, 30, 40 + i, 50] for i in range(6)]
RESULTS = Path(__file__).parent / "results" / "bench_node_loss.json"
RESULTS_ISOLATED = RESULTS.with_name("bench_node_loss_isolated.json")
ROUTER_HOST = ["127.0.0.1"]  # the router's address: the bridge's on isolated nodes (set per cluster)
SLOT_OPTIONS: dict[str, Any] = {"num_kv_blocks": 256, "stale_s": 5.0}


class Streams:
    """Greedy streams through the router in a thread; every token's arrival time is kept."""

    def __init__(self, url: str, max_tokens: int, reconnect_s: float = 30.0) -> None:
        self.url, self.max_tokens, self.reconnect_s = url, max_tokens, reconnect_s
        self.tokens: list[list[int]] = [[] for _ in PROMPTS]
        self.times: list[list[float]] = [[] for _ in PROMPTS]
        self.resumes: list[int] = [0 for _ in PROMPTS]
        self.errors: list[str] = []
        self._thread = threading.Thread(target=lambda: anyio.run(self._all), daemon=True)

    def start(self) -> Streams:
        self._thread.start()
        return self

    def join(self, timeout_s: float = 300.0) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"streams did not end within {timeout_s} s")

    def wait(self, condition: Any, timeout_s: float = 180.0) -> float:
        deadline = time.monotonic() + timeout_s
        while not condition(self):
            if time.monotonic() > deadline:
                raise RuntimeError("timed out waiting on the streams")
            time.sleep(0.005)
        return time.monotonic()

    async def _all(self) -> None:
        client = RouterClient(self.url, reconnect_timeout_s=self.reconnect_s)
        async with client, anyio.create_task_group() as group:
            for i in range(len(PROMPTS)):
                group.start_soon(self._one, client, i)

    async def _one(self, client: RouterClient, i: int) -> None:
        try:
            stream = client.generate_stream(PROMPTS[i], self.max_tokens, temperature=0.0, seed=i)
            async for event in stream:
                if isinstance(event, TokenEvent):
                    self.tokens[i].append(event.token_id)
                    self.times[i].append(time.monotonic())
                else:
                    self.resumes[i] = event.num_resumes
        except Exception as exc:  # the baseline's router goes away with the job: expected there
            self.errors.append(f"{type(exc).__name__}: {exc}")


def _start_slots(
    router: DriverRouter, shared: Path, sandboxes: SandboxCluster | None, **options: Any
) -> RolloutCluster:
    phase = shared / "slots" / f"{time.monotonic_ns()}"  # slot folders are per node and name: fresh
    slots = RolloutCluster(
        ["a", "b"],
        router_url=router.url,
        shared_dir=phase,
        admin_token=TOKEN,
        slot_options={**SLOT_OPTIONS, **options},
        sandboxes=sandboxes,
    )
    slots.start()
    return slots


def _sandbox_on(sandboxes: SandboxCluster, trajectory: str, node_id: str) -> None:
    sandboxes.create(trajectory, node_id)
    sandboxes.exec(trajectory, "echo state > /state.txt")
    sandboxes.checkpoint(trajectory, f"{trajectory}/turn-1")


def _arm_restart(
    ray_cluster: LocalRayCluster | IsolatedRayCluster, shared: Path, tokens: int, reference: list[list[int]]
) -> dict[str, Any]:
    """The baseline: the job torn down and restarted from the last trainer checkpoint."""
    sandboxes = SandboxCluster(shared)
    sandboxes.start()
    router = DriverRouter(shared / "restart-router-1.jsonl", admin_token=TOKEN, host=ROUTER_HOST[0]).start()
    slots = _start_slots(router, shared, None)
    checkpoint = shared / "trainer-checkpoint.safetensors"
    shutil.copyfile(slots.infos["a"].run_dir / "init.safetensors", checkpoint)
    victim = slots.infos["b"].node_id
    _sandbox_on(sandboxes, "traj-restart", victim)
    streams = Streams(router.url, tokens, reconnect_s=0.0).start()
    streams.wait(lambda s: min(len(t) for t in s.tokens) >= 8)
    removed = time.monotonic()
    had = [len(t) for t in streams.tokens]
    ray_cluster.remove_node(victim)
    (loss,) = slots.wait_node_loss(1, timeout_s=120)
    detected = time.monotonic()
    # Whole-job restart: everything down, then up again on the nodes left, from the checkpoint.
    router.kill()
    streams.join()
    slots.stop()
    router = DriverRouter(shared / "restart-router-2.jsonl", admin_token=TOKEN, host=ROUTER_HOST[0]).start()
    restores = sandboxes.recover_node(victim)
    slots = _start_slots(router, shared, None, weights=checkpoint)
    up = time.monotonic()
    again = Streams(router.url, tokens).start()
    back = again.wait(lambda s: all(len(t) > n for t, n in zip(s.tokens, had, strict=True)), 300)
    again.join()
    assert again.tokens == reference, "the restarted job's output differs from the failure-free one"
    slots.stop()
    router.stop()
    sandboxes.stop()
    return {
        "detected_by": loss.detected_by,
        "detect_s": detected - removed,
        "restart_s": up - detected,
        "sandbox_restore_s": restores[0].restore_s,
        "recover_s": back - removed,
        "tokens_lost": sum(had),
    }


def _arm_belayer(
    ray_cluster: LocalRayCluster | IsolatedRayCluster, shared: Path, tokens: int, reference: list[list[int]]
) -> dict[str, Any]:
    """Belayer: fence the lost node's slot, resume its requests elsewhere, restore its sandbox."""
    sandboxes = SandboxCluster(shared)
    sandboxes.start()
    router = DriverRouter(shared / "belayer-router.jsonl", admin_token=TOKEN, host=ROUTER_HOST[0]).start()
    slots = _start_slots(router, shared, sandboxes)
    victim = slots.infos["b"].node_id
    _sandbox_on(sandboxes, "traj-belayer", victim)
    streams = Streams(router.url, tokens).start()
    streams.wait(lambda s: min(len(t) for t in s.tokens) >= 8)
    removed, removed_wall = time.monotonic(), time.time()
    had = [len(t) for t in streams.tokens]
    ray_cluster.remove_node(victim)
    streams.join()
    (loss,) = slots.wait_node_loss(1, timeout_s=120)
    assert streams.tokens == reference, "a resumed stream differs from the failure-free output"
    affected = [i for i, n in enumerate(streams.resumes) if n >= 1]
    # An affected stream streams again at the token that ends its longest gap after the removal.
    again = []
    for i in affected:
        times = streams.times[i][had[i] - 1 :]
        gaps = [(b - a, b) for a, b in itertools.pairwise(times) if b >= removed]
        again.append(max(gaps)[1] - removed)
    sandbox_back = loss.detected_at + loss.recover_s - removed_wall
    slots.stop()
    router.stop()
    sandboxes.stop()
    return {
        "detected_by": loss.detected_by,
        "detect_s": loss.detected_at - removed_wall,
        "affected_requests": len(affected),
        "requests_streaming_again_s": max(again) if again else 0.0,
        "sandbox_restore_s": loss.sandboxes[0].restore_s,
        "sandboxes_restored_s": sandbox_back,
        "recover_s": max([*again, sandbox_back]),
        "tokens_lost": 0,
    }


def _reference(shared: Path, tokens: int) -> list[list[int]]:
    router = DriverRouter(shared / "reference-router.jsonl", admin_token=TOKEN, host=ROUTER_HOST[0]).start()
    slots = _start_slots(router, shared, None)
    streams = Streams(router.url, tokens).start()
    streams.join()
    slots.stop()
    router.stop()
    return streams.tokens


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _table(document: dict[str, Any]) -> str:
    """The results as a markdown table: medians over the repetitions with [min, max]."""
    reps = document["reps"]

    def cell(arm: str, key: str, unit: str = " s", digits: int = 1) -> str:
        values = sorted(float(r[arm][key]) for r in reps)
        med = statistics.median(values)
        return f"{med:.{digits}f}{unit} [{values[0]:.{digits}f}, {values[-1]:.{digits}f}]"

    rows = [
        ("loss detected", cell("belayer", "detect_s"), cell("whole_job_restart", "detect_s")),
        (
            "every affected request streaming again",
            cell("belayer", "requests_streaming_again_s"),
            cell("whole_job_restart", "recover_s"),
        ),
        (
            "sandbox restored on another node",
            f"{cell('belayer', 'sandboxes_restored_s')} (restore itself {cell('belayer', 'sandbox_restore_s')})",
            "(restored during the restart)",
        ),
        (
            "**recovered (requests and sandbox)**",
            f"**{cell('belayer', 'recover_s')}**",
            f"**{cell('whole_job_restart', 'recover_s')}** (restart {cell('whole_job_restart', 'restart_s')})",
        ),
        (
            "tokens regenerated",
            cell("belayer", "tokens_lost", "", 0),
            cell("whole_job_restart", "tokens_lost", "", 0),
        ),
    ]
    lines = [
        f"`{document['command']}`: {len(reps)} repetitions, {document['started_utc']} to "
        f"{document['ended_utc']} UTC; {document['setup']}.",
        "",
        "| recovery after a node loss (median [min, max]) | Belayer | whole-job restart |",
        "|---|---|---|",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "",
        "Detected by: "
        + ", ".join(
            f"rep {r['rep']}: {r['belayer']['detected_by']} / {r['whole_job_restart']['detected_by']}"
            for r in reps
        )
        + " (Belayer / restart).",
        f"Cluster start-up per repetition (s): {document['cluster_startup_s']}.",
        f"uptime at start: `{document['uptime_before']}`",
        f"uptime at end: `{document['uptime_after']}`",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--nodes",
        choices=("isolated", "processes"),
        default="processes",
        help="isolated: nodes that share nothing (IsolatedRayCluster, root); processes: simulated nodes",
    )
    args = parser.parse_args()
    if args.out is None:
        args.out = RESULTS_ISOLATED if args.nodes == "isolated" else RESULTS
    startups: list[dict[str, float]] = []
    reps: list[dict[str, Any]] = []
    load_before, uptime_before, started = os.getloadavg(), _uptime(), time.time()
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="bnl-") as tmp:
            shared = Path(tmp)
            config = LocalClusterConfig(num_nodes=4, cpus_per_node=1)
            ray_cluster: LocalRayCluster | IsolatedRayCluster = (
                IsolatedRayCluster(config, shared_dir=shared)
                if args.nodes == "isolated"
                else LocalRayCluster(config)
            )
            with ray_cluster:
                ROUTER_HOST[0] = getattr(ray_cluster, "head_ip", "") or "127.0.0.1"
                startups.append(getattr(ray_cluster, "startup_s", {}))
                reference = _reference(shared, args.tokens)
                restart = _arm_restart(ray_cluster, shared, args.tokens, reference)
                belayer = _arm_belayer(ray_cluster, shared, args.tokens, reference)
        reps.append({"rep": rep, "whole_job_restart": restart, "belayer": belayer})
        print(json.dumps(reps[-1]), file=sys.stderr)
        _write(args, reps, startups, (load_before, uptime_before, started))
    return 0


def _write(
    args: argparse.Namespace,
    reps: list[dict[str, Any]],
    startups: list[dict[str, float]],
    before: tuple[Any, str, float],
) -> None:
    """Write the results of the repetitions so far (after each one: a crash keeps the finished ones)."""
    load_before, uptime_before, started = before

    def median(arm: str, key: str) -> float:
        return float(statistics.median(r[arm][key] for r in reps))

    def spread(arm: str, key: str) -> list[float]:
        values = [float(r[arm][key]) for r in reps]
        return [min(values), max(values)]

    summary = {
        "node_loss_recovery_s": median("belayer", "recover_s"),
        "node_loss_requests_streaming_again_s": median("belayer", "requests_streaming_again_s"),
        "node_loss_sandboxes_restored_s": median("belayer", "sandboxes_restored_s"),
        "node_loss_detect_s": median("belayer", "detect_s"),
        "sandbox_restore_s": median("belayer", "sandbox_restore_s"),
        "whole_job_restart_recovery_s": median("whole_job_restart", "recover_s"),
        "whole_job_restart_restart_s": median("whole_job_restart", "restart_s"),
        "whole_job_restart_tokens_lost": median("whole_job_restart", "tokens_lost"),
        "node_loss_tokens_lost": 0,
        "repetitions": len(reps),
    }
    ranges = {  # [min, max] over the repetitions
        "node_loss_recovery_s": spread("belayer", "recover_s"),
        "node_loss_requests_streaming_again_s": spread("belayer", "requests_streaming_again_s"),
        "node_loss_sandboxes_restored_s": spread("belayer", "sandboxes_restored_s"),
        "node_loss_detect_s": spread("belayer", "detect_s"),
        "whole_job_restart_recovery_s": spread("whole_job_restart", "recover_s"),
        "whole_job_restart_tokens_lost": spread("whole_job_restart", "tokens_lost"),
    }
    document = {
        "benchmark": "bench_node_loss",
        "command": f"python benchmarks/bench_node_loss.py --reps {args.reps} --tokens {args.tokens}"
        + (" --nodes isolated" if args.nodes == "isolated" else ""),
        "nodes": args.nodes,
        "cluster_startup_s": startups,
        "setup": f"local Ray cluster, 4 {'isolated' if args.nodes == 'isolated' else 'simulated'} nodes "
        "x 1 CPU on one 2-core machine; 2 slots "
        "(belayer-shadow built-in model, seed 0, CPU); 6 greedy streams; one sandbox (belayer/busybox) "
        "on the lost node; medians over reps",
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "uptime_before": uptime_before,
        "uptime_after": _uptime(),
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(started)),
        "ended_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "summary": summary,
        "ranges": ranges,
        "reps": reps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(_table(document))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(main())
