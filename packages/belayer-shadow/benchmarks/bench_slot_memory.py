"""What a slot's processes hold in memory while its shadow stands by, beside a bare vLLM process.

    python benchmarks/bench_slot_memory.py                      # both engines, 28M and 164M
    python benchmarks/bench_slot_memory.py --sizes 28M --engines vllm --breakdown

For each model size, a seeded Qwen3 folder (config.json + model.safetensors) is served by one slot
(`SlotSupervisor`: weight server, KV server, main worker, standby shadow, a real router in this
process), once per engine. Once the shadow stands by (and has settled: its weight pin released,
its KV cache moved onto the arena), each process's `/proc/PID/smaps_rollup` gives its PSS, shared
(clean + dirty) and private (clean + dirty) bytes. Beside it, a bare vLLM `LLM` of the same folder
in one process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the same KV cache bytes, one short generate,
then its heap trimmed as our workers' are) is measured the same way; its *runtime* is its bytes
less the model's bytes and its KV cache's (what any vLLM process holds besides weights and KV; on
the CPU vLLM's packed copy of the linear weights stands in for its plain ones). A process that only
imports vLLM's engine gives the floor under any vLLM worker (`vllm_import_floor`).

Goals (issue 35): no private weight bytes in any worker (the weight-copy test checks every
parameter); the whole vLLM slot within model bytes + KV + 2 x the bare vLLM runtime, counted alike
on both sides in two accountings (`goals`: anonymous memory, libraries left out; PSS, libraries'
shares in; the memory servers' shared memory counted in full once); the standby shadow's own
private bytes (outside the servers' shared memory) at most half the main worker's.

After the measurement the idle main is SIGKILLed and the handover's timed steps are recorded
(`handover_steps_s`: on the CPU a vLLM shadow packs its linear layers again in `handover.flush`,
the price of standing by without those copies).

`--breakdown` adds, per process, its largest private mappings (from /proc/PID/smaps), the tool
used to find what each worker holds. Saves JSON to benchmarks/results/bench_slot_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import anyio

from belayer_router import RouterConfig, running_router
from belayer_shadow import ModelConfig, SlotConfig, SlotSupervisor, init_weights, save_safetensors

RESULTS = Path(__file__).parent / "results" / "bench_slot_memory.json"
TOKEN = "bench-admin-token"
MB = 1e6
SIZES = {
    "28M": {"hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64},
    "164M": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 13, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64},
}  # fmt: skip
NUM_KV_BLOCKS, BLOCK_SIZE = 256, 16
VLLM_BLOCK_SIZE = 128  # vLLM's CPU attention blocks
SETTLE_S = 2.0  # after the shadow's weight check (its last step before it only polls)


def model_config(size: str) -> ModelConfig:
    return ModelConfig.from_dict({**ModelConfig.default().to_dict(), **SIZES[size]})


def write_model(size: str, folder: Path) -> int:
    """A model folder (config.json + model.safetensors, seeded init); returns its weight bytes."""
    config = model_config(size)
    folder.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf().to_dict()
    hf["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(hf))
    weights = init_weights(config, seed=0)
    save_safetensors(weights, folder / "model.safetensors")
    return sum(t.numel() * t.element_size() for t in weights.values())


def kv_bytes(config: ModelConfig) -> int:
    per_block = 2 * config.num_hidden_layers * BLOCK_SIZE * config.num_key_value_heads * config.head_dim * 4
    return NUM_KV_BLOCKS * per_block


def rollup(pid: int) -> dict[str, int]:
    """PSS, RSS, shared and private bytes of `pid` (smaps_rollup)."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            fields[key] = int(parts[0]) * 1024
    private = fields["Private_Clean"] + fields["Private_Dirty"]
    return {
        "pss": fields["Pss"],
        "rss": fields["Rss"],
        "shared": fields["Shared_Clean"] + fields["Shared_Dirty"],
        "private": private,
        # Private bytes outside the memory servers' shared mappings (a page of the weight server or
        # the KV arena that only this process touched counts as private above).
        "private_own": private - shm_private(pid),
        "anonymous": fields.get("Anonymous", 0),
        "pss_shmem": fields.get("Pss_Shmem", 0),
        "pss_anon": fields.get("Pss_Anon", 0),
    }


def shm_private(pid: int) -> int:
    """Private bytes of `pid` in shared-memory mappings (memfd, /dev/shm)."""
    total, shm = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            shm = len(head) > 5 and head[5].startswith(("memfd:", "/dev/shm/", "/memfd:"))
        elif shm and line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(head[1]) * 1024
    return total


def breakdown(pid: int, top: int = 12) -> list[dict[str, Any]]:
    """The mappings of `pid` with the most private bytes, grouped by name (anonymous ones by size)."""
    private: dict[str, int] = defaultdict(int)
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:
            start, end = (int(x, 16) for x in head[0].split("-"))
            label = head[5] if len(head) > 5 else "[anon]"
            if label == "[anon]":
                label = (
                    f"[anon {(end - start) / MB:.0f} MB mapping]" if end - start >= 8 * MB else "[anon small]"
                )
            name = label.rsplit("/site-packages/", 1)[-1]
        elif line.startswith(("Private_Clean:", "Private_Dirty:")):
            private[name] += int(head[1]) * 1024
    rows = sorted(private.items(), key=lambda kv: -kv[1])[:top]
    return [{"mapping": n, "private_mb": round(b / MB, 1)} for n, b in rows if b]


def slot_processes(slot: SlotSupervisor) -> dict[str, int]:
    pids = {}
    for role, server in (("weight server", slot.weights_server), ("kv server", slot.kv_server)):
        assert server is not None
        pids[role] = server.pid
    for role, child in (("main", slot.main), ("shadow", slot.shadow)):
        assert child is not None
        pids[role] = child.pid
    return pids


async def measure_slot(engine: str, folder: Path, run_dir: Path, with_breakdown: bool) -> dict[str, Any]:
    async with running_router(RouterConfig(admin_token=TOKEN)) as (url, _app):
        config = SlotConfig(
            slot="s0",
            router_url=url,
            run_dir=run_dir,
            admin_token=TOKEN,
            engine=engine,
            model=folder / "config.json",
            weights=folder / "model.safetensors",
            num_kv_blocks=NUM_KV_BLOCKS,
            block_size=BLOCK_SIZE,
            start_timeout_s=900.0,
        )
        slot = SlotSupervisor(config)
        await anyio.to_thread.run_sync(slot.start)
        try:
            await anyio.to_thread.run_sync(lambda: slot.wait_protected(900.0))
            with anyio.fail_after(120):  # the shadow checks its weights once it has settled
                while not any(  # noqa: ASYNC110 (the events are a file: nothing to wait on)
                    e["event"] == "weights.private" and e["source"].startswith("shadow:")
                    for e in slot.events()
                ):
                    await anyio.sleep(0.2)
            await anyio.sleep(SETTLE_S)
            checks = {
                e["source"].split(":")[0]: e["count"]
                for e in slot.events()
                if e["event"] == "weights.private"
            }
            processes = {}
            for role, pid in slot_processes(slot).items():
                entry: dict[str, Any] = {"pid": pid, **rollup(pid)}
                if with_breakdown:
                    entry["private_top"] = breakdown(pid)
                processes[role] = entry
            processes["main"]["private_weights"] = checks.get("worker")
            processes["shadow"]["private_weights"] = checks.get("shadow")
            # What standing by light costs: the handover's steps (the flush step re-packs a vLLM
            # shadow's linear layers on the CPU), after a SIGKILL of the idle main.
            slot.kill_main()
            await anyio.to_thread.run_sync(lambda: slot.wait_handovers(1, 600.0))
            steps = {}
            for event in slot.events():
                if event["event"].startswith("handover.") and "duration_s" in event:
                    steps[event["event"]] = round(event["duration_s"], 3)
            processes["shadow"]["handover_steps_s"] = steps
        finally:
            await anyio.to_thread.run_sync(slot.stop)
    return processes


BARE = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
import ctypes, importlib, torch
torch.set_num_threads(1)
for name in ("torchvision", "torchaudio", "torchcodec"):  # CUDA builds beside a CPU torch: as absent,
    try:                                                  # as every vLLM worker of ours does
        importlib.import_module(name)
    except Exception:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
        sys.modules[name] = None
from vllm import LLM, SamplingParams, TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
          kv_cache_memory_bytes=int(sys.argv[2]), max_model_len=int(sys.argv[3]), max_num_seqs=64, seed=0)
params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3, 4])], params, use_tqdm=False)
print("READY", flush=True)
sys.stdin.readline()
ctypes.CDLL(None).malloc_trim(0)  # as our workers do once started: free heap pages back
print("TRIMMED", flush=True)
sys.stdin.readline()
"""


IMPORTS = """
import ctypes, importlib, sys
import torch
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        importlib.import_module(name)
    except Exception:
        for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[m]
        sys.modules[name] = None
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.llm_engine import LLMEngine
import vllm.v1.executor.uniproc_executor, vllm.v1.worker.cpu_worker
ctypes.CDLL(None).malloc_trim(0)
print("READY", flush=True)
sys.stdin.readline()
"""


def measure_import_floor() -> dict[str, Any]:
    """A process that only imports what an in-process vLLM engine on the CPU imports (torch, vLLM's
    engine, executor and CPU worker), heap trimmed: the floor under any vLLM worker's private bytes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", IMPORTS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError(f"the import-floor process exited with {proc.wait()}")
        entry: dict[str, Any] = {"pid": proc.pid, **rollup(proc.pid)}
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        return entry
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def measure_bare(folder: Path, kv: int, with_breakdown: bool) -> dict[str, Any]:
    """A bare vLLM `LLM` of `folder` in one process, after one short generate (the KV cache and
    context length of the slot's vLLM workers)."""
    config = ModelConfig.from_json_file(folder)
    per_block = kv // NUM_KV_BLOCKS * VLLM_BLOCK_SIZE // BLOCK_SIZE
    max_model_len = min(config.max_position_embeddings, (kv // per_block - 1) * VLLM_BLOCK_SIZE)
    proc = subprocess.Popen(
        [sys.executable, "-c", BARE, str(folder), str(kv), str(max_model_len)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        for line in proc.stdout:
            if line.strip() == "READY":
                break
        else:
            raise RuntimeError(f"bare vLLM exited with {proc.wait()} before it was ready")
        time.sleep(1.0)
        untrimmed = rollup(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "TRIMMED":
            raise RuntimeError(f"bare vLLM exited with {proc.wait()} before its heap was trimmed")
        time.sleep(1.0)
        # The baseline the budget uses: trimmed, as our workers are once started (`trim_heap`).
        entry: dict[str, Any] = {"pid": proc.pid, **rollup(proc.pid), "untrimmed": untrimmed}
        if with_breakdown:
            entry["private_top"] = breakdown(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
        return entry
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def summarise(
    size: str, model_bytes: int, kv: int, slots: dict[str, Any], bare: dict[str, Any] | None
) -> dict[str, Any]:
    """Per slot its whole PSS; with a bare process, the goals in two accountings that count the
    slot and the bare process alike (see `goals`)."""
    out: dict[str, Any] = {"size": size, "model_bytes": model_bytes, "kv_bytes": kv, "slots": slots}
    for processes in slots.values():
        members = list(processes.values())
        total = sum(p["pss"] for p in members)
        processes["whole slot"] = {
            "pss": total,
            "over_model_bytes": round(total / model_bytes, 2),
            # The memory servers' shared memory counted in full, once (resident or not: the KV
            # arena is only touched as requests fill it), plus what each process holds besides it.
            "pss_full": sum(p["pss"] - p["pss_shmem"] for p in members) + model_bytes + kv,
            "anonymous_full": sum(p["anonymous"] for p in members) + model_bytes + kv,
        }
    if bare is not None:
        out["bare_vllm"] = {
            **bare,
            "runtime_private": bare["private"] - model_bytes - kv,
            "runtime_anonymous": bare["anonymous"] - model_bytes - kv,
            "runtime_pss": bare["pss"] - model_bytes - kv,
        }
        vllm = slots.get("vllm")
        if vllm is not None:
            out["goals"] = goals(model_bytes, kv, vllm, out["bare_vllm"])
    return out


def goals(model_bytes: int, kv: int, vllm: dict[str, Any], bare: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals for a vLLM slot against the bare process (trimmed, as our workers are).

    The bare process holds the model once (vLLM's packed copy stands in for its plain weights)
    and its KV cache; its runtime is what it holds besides. The slot is counted the same way in
    each accounting: `anonymous` (anonymous memory only: no library page on either side; a
    library page only the bare process maps is private to it, one main and shadow share is not)
    and `pss` (libraries' shares included on both sides). The slot is within the budget only if it
    is in both. `mixed_before` is the comparison this benchmark made before (the slot's PSS,
    libraries and a partly resident KV arena included, against the untrimmed bare process's
    private bytes)."""
    slot = vllm["whole slot"]
    budgets = {
        "anonymous": model_bytes + kv + 2 * max(bare["runtime_anonymous"], 0),
        "pss": model_bytes + kv + 2 * max(bare["runtime_pss"], 0),
        "mixed_before": model_bytes + kv + 2 * max(bare["untrimmed"]["private"] - model_bytes - kv, 0),
    }
    within = {
        "anonymous": slot["anonymous_full"] <= budgets["anonymous"],
        "pss": slot["pss_full"] <= budgets["pss"],
        "mixed_before": slot["pss"] <= budgets["mixed_before"],
    }
    main, shadow = vllm["main"]["private_own"], vllm["shadow"]["private_own"]
    return {
        "slot_within_model_kv_and_2x_bare_runtime": within["anonymous"] and within["pss"],
        "slot_within_by_accounting": within,
        "budget_bytes": budgets,
        "slot_bytes": {
            "anonymous": slot["anonymous_full"],
            "pss": slot["pss_full"],
            "mixed_before": slot["pss"],
        },
        "shadow_private_at_most_half_main": shadow <= main / 2,
        "shadow_over_main_private": round(shadow / main, 3),
        "worker_anonymous_over_bare_runtime": {
            "main": vllm["main"]["anonymous"] - bare["runtime_anonymous"],
            "shadow": vllm["shadow"]["anonymous"] - bare["runtime_anonymous"],
        },
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| size | engine | process | PSS MB | shared MB | private MB | own private MB |",
        "|---|---|---|---:|---:|---:|---:|",
    ]

    def cell(p: dict[str, Any], key: str) -> str:
        return f"{p[key] / MB:,.0f}" if key in p else ""

    for r in results:
        for engine_name, processes in r["slots"].items():
            for role, p in processes.items():
                lines.append(
                    f"| {r['size']} | {engine_name} | {role} | {cell(p, 'pss')} | {cell(p, 'shared')} | "
                    f"{cell(p, 'private')} | {cell(p, 'private_own')} |"
                )
        if "bare_vllm" in r:
            b = r["bare_vllm"]
            lines.append(
                f"| {r['size']} | bare vLLM | one process | {cell(b, 'pss')} | {cell(b, 'shared')} | "
                f"{cell(b, 'private')} | {cell(b, 'private_own')} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--engines", nargs="+", default=["belayer", "vllm"], choices=["belayer", "vllm"])
    parser.add_argument("--no-bare", action="store_true", help="skip the bare vLLM process")
    parser.add_argument("--breakdown", action="store_true", help="largest private mappings per process")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-slot-memory-") as tmp:
        for size in args.sizes:
            folder = Path(tmp) / size
            model_bytes = write_model(size, folder)
            kv = kv_bytes(model_config(size))
            slots = {}
            for engine in args.engines:
                run_dir = Path(tmp) / f"{size}-{engine}"
                slots[engine] = anyio.run(measure_slot, engine, folder, run_dir, args.breakdown)
                print(
                    f"{size} {engine}: {json.dumps({r: round(p['pss'] / MB) for r, p in slots[engine].items()})}"
                )
            bare = None if args.no_bare else measure_bare(folder, kv, args.breakdown)
            results.append(summarise(size, model_bytes, kv, slots, bare))
    floor = None if args.no_bare else measure_import_floor()
    record = {
        "command": "python benchmarks/bench_slot_memory.py " + " ".join(sys.argv[1:]),
        "vllm_import_floor": floor,
        "load_before": [round(x, 1) for x in load_before],
        "load_after": [round(x, 1) for x in os.getloadavg()],
        "results": results,
    }
    print(table(results))
    for r in results:
        if "goals" in r:
            print(r["size"], json.dumps(r["goals"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
