"""How often an exec's output is lost: docker-py's ``exec_start`` (the old path) against
belayer-envckpt's own reader (`exec_in`), same sandbox, same load, interleaved rounds.

Each exec runs ``echo out-N; printf 'err-%s\\n' N >&2`` (a short command: its output tends to
arrive with the response head, which docker-py drops); ``--threads`` run at once, with
``--burners`` host processes spinning on the CPU beside them (and ``--gil-burners`` threads
spinning in the client's own process, as in a busy Ray actor).  An exec is *lost* when it exited 0
but its stdout or stderr is not the known text.  Also the median seconds per exec of each path.

    python benchmarks/exec_loss.py --rounds 6 --per-round 200   # writes benchmarks/results/exec_loss.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from belayer_envckpt import Engine, Sandbox, SandboxConfig
from belayer_envckpt._exec import exec_in

RESULTS = Path(__file__).parent / "results" / "exec_loss.json"


def _old_path(api: Any, container_id: str, argv: list[str]) -> tuple[str, str, int]:
    """What exec_in did up to 0.2.2: docker-py's exec_start(demux=True), then exec inspect."""
    exec_id = api.exec_create(container_id, argv, workdir="/")["Id"]
    stdout, stderr = api.exec_start(exec_id, demux=True)
    code = api.exec_inspect(exec_id).get("ExitCode")
    return (stdout or b"").decode(), (stderr or b"").decode(), int(code if code is not None else -1)


def _new_path(api: Any, container_id: str, argv: list[str]) -> tuple[str, str, int]:
    r = exec_in(api, container_id, argv, workdir="/", timeout_s=120)
    return r.stdout, r.stderr, r.exit_code


def _batch(path: Any, api: Any, container_id: str, count: int, threads: int) -> dict[str, Any]:
    outcome = {"execs": 0, "lost": 0, "failed": 0, "seconds": []}
    lock = threading.Lock()
    todo = iter(range(count))

    def worker() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            argv = ["sh", "-c", f"echo out-{i}; printf 'err-%s\\n' {i} >&2"]
            started = time.perf_counter()
            got = path(api, container_id, argv)
            elapsed = time.perf_counter() - started
            with lock:
                outcome["execs"] += 1
                outcome["seconds"].append(elapsed)
                if got[2] != 0:
                    outcome["failed"] += 1
                elif got[:2] != (f"out-{i}\n", f"err-{i}\n"):
                    outcome["lost"] += 1

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=200)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--gil-burners", type=int, default=0, help="threads spinning in this process")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    for _ in range(args.gil_burners):
        threading.Thread(target=spin, daemon=True).start()
    totals = {name: {"execs": 0, "lost": 0, "failed": 0, "seconds": []} for name in ("docker_py", "exec_in")}
    loads = []
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        with Engine.connect() as engine:
            sandbox = Sandbox.create(engine, SandboxConfig(image="belayer/busybox:latest"))
            try:
                for round_ in range(args.rounds):
                    order = [("docker_py", _old_path), ("exec_in", _new_path)]
                    for name, path in order if round_ % 2 == 0 else order[::-1]:
                        loads.append(os.getloadavg()[0])
                        got = _batch(path, engine._client.api, sandbox.id, args.per_round, args.threads)
                        for key in ("execs", "lost", "failed"):
                            totals[name][key] += got[key]
                        totals[name]["seconds"] += got["seconds"]
                        print(f"round {round_} {name}: {got['lost']} lost of {got['execs']}", flush=True)
            finally:
                sandbox.remove()
    finally:
        stop.set()
        for burner in burners:
            burner.kill()
            burner.wait()
    rows = {
        name: {
            "execs": t["execs"],
            "lost": t["lost"],
            "failed": t["failed"],
            "lost_fraction": round(t["lost"] / max(1, t["execs"]), 5),
            "median_s_per_exec": round(statistics.median(t["seconds"]), 4),
        }
        for name, t in totals.items()
    }
    result = {
        "command": "python benchmarks/exec_loss.py " + " ".join(sys.argv[1:]),
        "threads": args.threads,
        "burners": args.burners,
        "gil_burners": args.gil_burners,
        "load_average_1min_min_max": [round(min(loads), 1), round(max(loads), 1)],
        "note": "shared 2-core machine, other engineers' suites running beside it",
        "paths": rows,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
