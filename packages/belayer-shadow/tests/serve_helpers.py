"""Helpers of the `serve` tests: a small seeded Qwen3 model folder, the command as a process, and
a scan of /proc for whatever a run folder's processes left."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from belayer_router.testing import write_chat_tokenizer
from belayer_shadow import ModelConfig


def write_model_folder(folder: Path, seed: int = 0) -> Path:
    """A Hugging Face folder as `save_pretrained` writes it (config, safetensors, generation config)
    for the built-in model's shape, seeded, plus a byte-level tokenizer with a chat template."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(ModelConfig.default().to_hf()).save_pretrained(folder)
    write_chat_tokenizer(folder)
    return folder


def serve_command(model: Path, *flags: str) -> list[str]:
    """`python -m belayer_shadow serve MODEL --json --port 0 ...` (small KV pools)."""
    return [sys.executable, "-m", "belayer_shadow", "serve", str(model), "--json", "--port", "0", *flags]


@contextmanager
def serving_process(
    command: list[str], timeout_s: float = 240.0, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """Start the command; yield it with its one JSON line once it serves; kill it at the end."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # blocks until ready (or the command ends)
        if not line:
            _, stderr = process.communicate(timeout=timeout_s)
            raise AssertionError(f"serve ended with {process.returncode} before serving: {stderr}")
        yield process, json.loads(line)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=60)


def processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if text in cmdline and stat[stat.rindex(")") + 2 :].split()[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_until_gone(text: str, timeout_s: float = 60.0) -> list[int]:
    """Wait until no process mentions `text`; returns the survivors (empty on success)."""
    deadline = time.monotonic() + timeout_s
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
