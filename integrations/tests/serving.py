"""A small seeded Qwen3 folder and a `belayer-shadow serve` process for the integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from belayer_router.testing import write_chat_tokenizer
from belayer_shadow import ModelConfig


def write_model_folder(folder: Path, seed: int = 0) -> Path:
    """A Hugging Face folder (transformers' `save_pretrained`) of belayer-shadow's small built-in
    shape, seeded, with a byte-level tokenizer and a Qwen3-style chat template."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(ModelConfig.default().to_hf()).save_pretrained(folder)
    write_chat_tokenizer(folder)
    return folder


def policy_logprobs(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """The policy's log-probability of each completion token (temperature 1), with transformers."""
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion_ids)[:, None])
    return [float(x) for x in picked[:, 0]]


@contextmanager
def belayer_serve(model: Path, run_dir: Path, *flags: str) -> Iterator[dict[str, Any]]:
    """`belayer-shadow serve MODEL --json` until the block ends (SIGTERM, then SIGKILL)."""
    command = [sys.executable, "-m", "belayer_shadow", "serve", str(model), "--json", "--port", "0"]
    command += ["--run-dir", str(run_dir), *flags]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"belayer-shadow serve ended with {process.wait()} before serving")
        yield json.loads(line)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main_worker_pids(run_dir: Path) -> list[int]:
    """The main workers of the service's slots (from each slot's processes.json)."""
    pids = []
    for table in sorted(run_dir.glob("slots/*/processes.json")):
        for entry in json.loads(table.read_text())["processes"]:
            if entry["role"] == "main":
                pids.append(int(entry["pid"]))
    return pids


def kill(pid: int) -> None:
    """SIGKILL `pid` (a rollout worker: the chaos of the tests)."""
    os.kill(pid, signal.SIGKILL)
