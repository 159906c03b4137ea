"""`belayer-shadow serve` under a framework's load (issue 30): what a trainer waits for.

    python benchmarks/bench_serve.py [--reps 3] [--streams 8] [--kill-size 1M] [--update-size 164M]

1. Kill: a GRPO-like batch (`--streams` concurrent streaming `/v1/completions`, sampled, 400
   tokens each, one slot) runs; the slot's main worker is SIGKILLed mid-batch; measured: from the
   kill to the first token each stream receives after it (the first resumed token), median over
   streams, then over reps. Belayer (`--recovery shadow`: the standby shadow takes over) against the
   strongest restart baseline in the same run (`--recovery restart`: the supervisor sees the exit
   at once, restarts the slot from scratch, new memory, weights reloaded, new main, and the router
   resumes each stream token-exact). Every stream must complete with one logprob per token.
2. Update: `POST /update_weights {"weight_dir"}` of a seeded `--update-size` model folder on an idle
   server (a trainer updates between steps), then one completion: measured from the update request
   to the first token of that completion, which is checked to be on the new version (the greedy
   tokens equal those of a server started on the new folder). Baseline in the same run: restarting
   the server on the new folder (SIGTERM, start `serve` again, first token).

The machine is shared: its load average is recorded before and after each part. Results:
`benchmarks/results/bench_serve.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from belayer_router.testing import write_chat_tokenizer
from belayer_shadow import ModelConfig, init_weights, save_safetensors

RESULTS = Path(__file__).parent / "results" / "bench_serve.json"
SIZES: dict[str, dict[str, int]] = {
    "1M": {},  # the default model
    "164M": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 13, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 64},
}  # fmt: skip


def write_model(size: str, folder: Path, seed: int) -> int:
    """A seeded model folder (config.json, model.safetensors, a chat tokenizer); its parameter count."""
    config = ModelConfig.from_dict({**ModelConfig.default().to_dict(), **SIZES[size]})
    folder.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf().to_dict()
    hf["architectures"] = ["Qwen3ForCausalLM"]
    (folder / "config.json").write_text(json.dumps(hf))
    weights = init_weights(config, seed=seed)
    save_safetensors(weights, folder / "model.safetensors")
    write_chat_tokenizer(folder)
    return sum(t.numel() for t in weights.values())


def load() -> float:
    return os.getloadavg()[0]


class Serve:
    """`belayer-shadow serve MODEL --json --port 0 ...` as a process."""

    def __init__(self, model: Path, *flags: str) -> None:
        command = [
            sys.executable,
            "-m",
            "belayer_shadow",
            "serve",
            str(model),
            "--json",
            "--port",
            "0",
            *flags,
        ]
        self.started = time.monotonic()
        self.log = tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise RuntimeError(
                f"serve ended with {code} before serving: {Path(self.log.name).read_text()[-2000:]}"
            )
        self.ready = json.loads(line)
        self.url: str = self.ready["url"]
        self.run_dir = Path(self.ready["run_dir"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _main_pid(run_dir: Path) -> int:
    """The slot's current main worker: the newest `*-main` entry of its process table."""
    table = json.loads((run_dir / "slots" / "slot0" / "processes.json").read_text())
    entries = table["processes"] if isinstance(table, dict) else table
    mains = [e for e in entries if e.get("role") == "main"]
    return int(mains[-1]["pid"])


def _stream(url: str, index: int, max_tokens: int, out: list[Any]) -> None:
    """One streaming completion: the arrival time of every token; its logprobs counted."""
    body = {"prompt": [1 + index, 2, 3], "max_tokens": max_tokens, "temperature": 1.0, "seed": 1000 + index,
            "stream": True, "logprobs": 1}  # fmt: skip
    times: list[float] = []
    num_logprobs = 0
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens = choice.get("token_ids") or []
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            now = time.monotonic()
            times += [now] * len(tokens)
            num_logprobs += len(logprobs)
    out[index] = (times, num_logprobs)


def kill_rep(model: Path, recovery: str, streams: int, max_tokens: int) -> dict[str, Any]:
    serve = Serve(model, "--recovery", recovery, "--num-kv-blocks", "512", "--max-num-seqs", str(streams))
    try:
        results: list[Any] = [None] * streams
        threads = [
            threading.Thread(target=_stream, args=(serve.url, i, max_tokens, results)) for i in range(streams)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # mid-batch: every stream past 25% of its tokens
            metrics = httpx.get(serve.url + "/metrics", timeout=30).text
            done = [len(r[0]) for r in results if r is not None]
            if _tokens_streamed(metrics) >= streams * max_tokens // 4 or done:
                break
            time.sleep(0.05)
        victim = _main_pid(serve.run_dir)
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=600)
        firsts = []
        for times, num_logprobs in results:
            assert len(times) == max_tokens == num_logprobs, (len(times), num_logprobs)
            # The first resumed token ends the stream's longest stall after the kill (tokens the
            # dead worker had sent still arrive just after it: they are not resumed ones).
            gaps = [(b - a, b) for a, b in itertools.pairwise(times) if b > killed]
            if gaps:
                firsts.append(max(gaps)[1] - killed)
        return {"recovery": recovery, "kill_to_first_resumed_token_s": statistics.median(firsts),
                "streams_resumed": len(firsts), "streams": streams}  # fmt: skip
    finally:
        serve.stop()


def _tokens_streamed(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith("belayer_router_tokens_total"):
            return int(float(line.split()[-1]))
    return 0


def _first_token(url: str, prompt: list[int], max_tokens: int = 8) -> tuple[float, list[int]]:
    """A greedy completion: when its first token arrived, and its tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    first, tokens = 0.0, []
    with (
        httpx.Client(timeout=600) as client,
        client.stream("POST", url + "/v1/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                new = json.loads(line[6:])["choices"][0].get("token_ids") or []
                if new and not tokens:
                    first = time.monotonic()
                tokens += new
    return first, tokens


def update_reps(first: Path, second: Path, reps: int) -> dict[str, Any]:
    prompt = [5, 6, 7, 8]
    flags = ("--num-kv-blocks", "128")
    reference = Serve(second, *flags)
    try:
        _, expected = _first_token(reference.url, prompt)
    finally:
        reference.stop()
    by_update, by_restart = [], []
    for _ in range(reps):
        serve = Serve(first, *flags)
        try:
            _first_token(serve.url, prompt)  # warm
            began = time.monotonic()
            answer = httpx.post(serve.url + "/update_weights", json={"weight_dir": str(second)}, timeout=600)
            assert answer.status_code == 200, answer.text
            arrived, tokens = _first_token(serve.url, prompt)
            assert tokens == expected, "the first completion after the update is not on the new weights"
            by_update.append(arrived - began)
            # Back to the first folder for the next rep's baseline start.
        finally:
            began = time.monotonic()
            serve.stop()
        restarted = Serve(second, *flags)
        try:
            arrived, tokens = _first_token(restarted.url, prompt)
            assert tokens == expected
            by_restart.append(arrived - began)
        finally:
            restarted.stop()
    return {
        "update_to_first_new_token_s": statistics.median(by_update),
        "restart_to_first_new_token_s": statistics.median(by_restart),
        "update_reps_s": by_update,
        "restart_reps_s": by_restart,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--kill-size", default="1M", choices=sorted(SIZES))
    parser.add_argument("--update-size", default="164M", choices=sorted(SIZES))
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument("--skip-update", action="store_true", help="keep the update results of the file")
    args = parser.parse_args()
    result: dict[str, Any] = {"command": " ".join(["python", "benchmarks/bench_serve.py", *sys.argv[1:]]),
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "cpus": os.cpu_count()}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as scratch:
        root = Path(scratch)
        if not args.skip_kill:
            model = root / "kill"
            result["kill_params"] = write_model(args.kill_size, model, seed=0)
            result["kill_load_before"] = load()
            kills: dict[str, list[dict[str, Any]]] = {"shadow": [], "restart": []}
            for _ in range(args.reps):
                for recovery in kills:
                    kills[recovery].append(kill_rep(model, recovery, args.streams, args.max_tokens))
                    print(recovery, kills[recovery][-1], f"load {load():.1f}", flush=True)
            result["kill"] = {
                recovery: {
                    "median_s": statistics.median(r["kill_to_first_resumed_token_s"] for r in reps),
                    "reps": reps,
                }
                for recovery, reps in kills.items()
            }
            result["kill_load_after"] = load()
        if args.skip_update:
            kept = json.loads(RESULTS.read_text())
            result.update({k: v for k, v in kept.items() if k.startswith("update")})
            result["update_command"] = kept["command"]
            RESULTS.write_text(json.dumps(result, indent=2) + "\n")
            print(json.dumps(result, indent=2))
            return
        first, second = root / "first", root / "second"
        result["update_params"] = write_model(args.update_size, first, seed=0)
        write_model(args.update_size, second, seed=1)
        result["update_size"] = args.update_size
        result["update_load_before"] = load()
        result["update"] = update_reps(first, second, args.reps)
        result["update_load_after"] = load()
        print(result["update"], flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
