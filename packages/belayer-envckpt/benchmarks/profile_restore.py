"""Where a full restore of a process holding N MB spends its time on Docker (CRIU 4.2, runc).

One `belayer/debian-python` sandbox whose process holds ``--rss`` MB of random bytes is
checkpointed once (`full_checkpoint`) and restored ``--reps`` times into new containers.  During
each restore a thread samples, every 10 ms, what lies on disk and what runs:

- the CRIU images in the new container's checkpoint folder (our copy, or hard links);
- containerd's content-store ingest (the engine streams the folder there as a tar, digested);
- containerd's ``ctrd-checkpoint*`` unpack folder in /tmp;
- whether a ``runc ... restore`` process (and CRIU under it) runs;

and CRIU's own ``restore.log`` gives CRIU's time.  The phases: ours before the start (verify,
create, layer; `restore_timings_ms`), images into the engine's folder, the engine's content-store
upload, the unpack, runc + CRIU, and ours after (clean-up, reload).

The ways, interleaved: the default (the page images handed to the engine as links to the store's
files, read in place by CRIU: `Engine.restore_in_place`) and the baseline of 0.6.0 and before
(every image copied into the engine's folder and streamed through containerd); with ``--both``
also the baseline with the store on the engine's data root's mount (images hard-linked).

    python benchmarks/profile_restore.py [--rss 200] [--reps 3] [--both]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from belayer_envckpt import CheckpointStore, Engine, Sandbox, SandboxConfig, full_checkpoint, full_restore

APP = "import os, time\nstate = bytearray(os.urandom({mb} * 1024 * 1024))\nwhile True:\n    time.sleep(1)\n"
INGEST = Path("/var/lib/docker/containerd/daemon/io.containerd.content.v1.content/ingest")
TASKS = Path("/var/run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby")


def _size(root: Path) -> int:
    total = 0
    try:
        for entry in os.scandir(root):
            if entry.is_dir(follow_symlinks=False):
                total += _size(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def _runc_restoring() -> bool:
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"runc") and b"restore" in argv:
                return True
    return False


class Sampler(threading.Thread):
    def __init__(self, engine_root: Path) -> None:
        super().__init__(daemon=True)
        self.containers = engine_root / "containers"
        self.samples: list[tuple[float, int, int, int, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            ckpt = sum(_size(p) for p in self.containers.glob("*/checkpoints"))
            ctrd = sum(_size(p) for p in Path("/tmp").glob("ctrd-checkpoint*"))
            self.samples.append((time.perf_counter(), ckpt, _size(INGEST), ctrd, _runc_restoring()))
            time.sleep(0.01)


def _first(samples: list[tuple[float, int, int, int, bool]], index: int, above: float) -> float | None:
    return next((s[0] for s in samples if s[index] > above), None)


def profile_one(engine: Engine, ckpt: object, images_bytes: int) -> dict[str, float]:
    sampler = Sampler(engine.root_dir())
    sampler.start()
    time.sleep(0.05)
    base = sampler.samples[-1]
    started = time.perf_counter()
    restored = full_restore(ckpt, engine=engine, remove_failed=False)  # type: ignore[arg-type]
    ended = time.perf_counter()
    images_way = restored.restore_images
    log = next(iter(TASKS.glob(f"{restored.id}/work/restore.log")), None)
    criu_s = None
    if log is not None:
        times = re.findall(r"^\((\d+\.\d+)\)", log.read_text(errors="replace"), re.M)
        criu_s = float(times[-1]) if times else None
    time.sleep(0.05)
    sampler.stop.set()
    sampler.join()
    restored.remove()
    s = sampler.samples
    timings = restored.restore_timings_ms
    start_step = (
        started
        + sum(
            timings.get(k, 0.0)
            for k in ("verify_ms", "remove_ms", "create_ms", "layer_ms", "pages_verify_wait_ms")
        )
        / 1e3
    )
    copied = _first(s, 1, base[1] + 0.95 * images_bytes) or start_step
    unpack = _first(s, 3, base[3] + 1e6) or copied
    runc = [x[0] for x in s if x[4]]
    runc_start, runc_end = (runc[0], runc[-1]) if runc else (unpack, unpack)
    ms = lambda a, b: round((b - a) * 1e3, 1)  # noqa: E731
    return {
        "total_ms": round((ended - started) * 1e3, 1),
        # On the critical path: the checks before the create, and the wait for the page hashing after it.
        "ours_verify_ms": round(timings["verify_ms"] + timings.get("pages_verify_wait_ms", 0.0), 1),
        "ours_create_and_layer_ms": round(timings["create_ms"] + timings["layer_ms"], 1),
        "images_into_engine_folder_ms": ms(start_step, copied),
        "engine_content_store_upload_ms": ms(copied, unpack),
        "containerd_unpack_ms": ms(unpack, runc_start),
        "runc_and_criu_ms": ms(runc_start, runc_end),
        "criu_restore_log_ms": round(criu_s * 1e3, 1) if criu_s is not None else -1.0,
        "after_ms": ms(runc_end, ended),
        "peak_ingest_mb": round(max(x[2] for x in s) / 1e6, 1),
        "images_in_place": float(images_way == "in-place"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rss", type=int, default=200)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--both", action="store_true", help="also a store on the engine root's mount")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "profile_restore.json"))
    args = parser.parse_args()
    engine = Engine.connect()
    engine.require_checkpoint_support()
    copying = Engine.connect(restore_in_place=False)
    load_before = os.getloadavg()
    store = Path(tempfile.mkdtemp(prefix="belayer-prof-"))
    # name -> (store folder, engine): both /tmp rows restore the very same checkpoint
    places = {
        "store in /tmp, page images read in place (default)": (store, engine),
        "store in /tmp, images copied (0.6.0)": (store, copying),
    }
    if args.both:
        linked = engine.root_dir() / f"belayer-prof-{os.getpid()}"
        places["store on the engine root's mount, images hard-linked (0.6.0)"] = (linked, copying)
    config = SandboxConfig(
        image="belayer/debian-python:latest",
        command=("python3", "-c", APP.format(mb=args.rss)),
        labels={"belayer.bench": "1"},
    )
    sandbox = Sandbox.create(engine, config, trajectory="prof")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in places}
    try:
        time.sleep(2)
        taken: dict[Path, object] = {}
        for root, _engine in places.values():
            if root not in taken:
                taken[root] = full_checkpoint(sandbox, "prof", store=CheckpointStore(root))
        first = next(iter(taken.values()))
        images = sum(r.size for k, r in first.files.items() if k.startswith("criu/"))  # type: ignore[attr-defined]
        for _ in range(args.reps):
            for name, (root, way) in places.items():
                runs[name].append(profile_one(way, taken[root], images))
                print(name, json.dumps(runs[name][-1]), flush=True)
    finally:
        sandbox.remove()
        copying.close()
        for root, _engine in places.values():
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "cpus": os.cpu_count(),
        "rss_mb": args.rss,
        "criu_images_mb": round(images / 1e6, 1),
        "reps": args.reps,
        "medians": {
            name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
        },
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["medians"], indent=1))


if __name__ == "__main__":
    main()
