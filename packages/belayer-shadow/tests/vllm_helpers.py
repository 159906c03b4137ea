"""What the vLLM slot tests share: the slot's configuration, starting it, the reference outputs.

Used by tests/test_vllm_slot.py and tests/test_vllm_failures.py (real vLLM main and shadow workers,
real memory servers, a real router).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio

from belayer_shadow import (
    LLMEngine,
    ModelConfig,
    SamplingParams,
    SlotConfig,
    SlotSupervisor,
    allocate_kv_arena,
    init_weights,
)

TOKEN = "test-admin-token"
CONFIG = ModelConfig.default()
START_TIMEOUT_S = 900.0  # a vLLM engine takes 20-70 s to start on a loaded 2-core machine


def vllm_slot_config(router_url: str, run_dir: Path, **overrides: Any) -> SlotConfig:
    """A slot on vLLM (main and shadow) with the seeded default model; `overrides` as SlotConfig's."""
    fields: dict[str, Any] = {
        "slot": "s0",
        "router_url": router_url,
        "run_dir": run_dir,
        "admin_token": TOKEN,
        "engine": "vllm",
        # vLLM's KV cache lives in the KV server's arena: 256 blocks of 16 positions are 31 of
        # vLLM's 128-position blocks, one per request at least, so every test request runs at once.
        "num_kv_blocks": 256,
        "start_timeout_s": START_TIMEOUT_S,
    }
    return SlotConfig(**{**fields, **overrides})


@contextlib.contextmanager
def started_slot(config: SlotConfig) -> Iterator[SlotSupervisor]:
    """The slot started and protected (a shadow standing by); stopped on exit."""
    slot = SlotSupervisor(config)
    slot.start()
    try:
        slot.wait_protected(START_TIMEOUT_S)
        yield slot
    finally:
        slot.stop()


@contextlib.asynccontextmanager
async def running_slot(config: SlotConfig) -> AsyncIterator[SlotSupervisor]:
    """`started_slot` from async code (start and stop block: they run in a worker thread)."""
    slot = SlotSupervisor(config)
    await anyio.to_thread.run_sync(slot.start)
    try:
        await anyio.to_thread.run_sync(lambda: slot.wait_protected(START_TIMEOUT_S))
        yield slot
    finally:
        await anyio.to_thread.run_sync(slot.stop)


def builtin_greedy(prompts: list[list[int]], max_tokens: int, seed: int = 0) -> list[list[int]]:
    """The failure-free greedy outputs of the built-in engine on the slot's seeded weights
    (`init_weights(CONFIG, seed)`): the same model, another engine."""
    blocks = len(prompts) * (-(-(max(map(len, prompts)) + max_tokens) // 16)) + 1
    engine = LLMEngine(CONFIG, init_weights(CONFIG, seed), allocate_kv_arena(CONFIG, blocks, 16))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    outputs: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished():
        for out in engine.step():
            outputs[int(out.request_id)].append(out.token_id)
    return outputs


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (vLLM starts a few)."""
    fields = _stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gone(pid: int) -> bool:
    """The process has exited (or is a zombie nobody reaped yet) and its process group is empty:
    a worker leads its own group, so nothing vLLM started is left either."""
    fields = _stat_fields(pid)
    if fields is not None and fields[0] != "Z":
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        other = _stat_fields(int(stat.parent.name))
        if other is not None and other[0] != "Z" and int(other[2]) == pid:
            return False
    return True
