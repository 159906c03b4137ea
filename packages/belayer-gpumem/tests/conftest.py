"""Shared fixtures: real servers as subprocesses, real client processes."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from belayer_gpumem import KVLayout, ServerConfig, ServerProcess

WORKER = Path(__file__).with_name("worker.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-check on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def resident_bytes(address: int) -> int:
    """Rss of the mapping that contains `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


def run_worker(*args: str, timeout_s: float = 120.0) -> str:
    """Run tests/worker.py in a fresh process; returns its stdout, fails the test on a non-zero exit."""
    done = subprocess.run(
        [sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"worker {args} failed ({done.returncode}):\n{done.stderr}"
    return done.stdout


def start_worker(*args: str) -> subprocess.Popen[str]:
    """Start tests/worker.py without waiting."""
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_line(proc: subprocess.Popen[str], expected: str) -> str:
    """Read the worker's stdout until a line starting with `expected`."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(expected):
            return line.strip()
    raise AssertionError(
        f"worker exited before printing {expected!r}: {proc.stderr.read() if proc.stderr else ''}"
    )


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A directory for sockets (the server makes it 0700)."""
    return tmp_path / "run"


def sample_weights() -> dict[str, torch.Tensor]:
    """The tensors of `weights_file`: mixed dtypes and shapes, a 0-d one included."""
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
        "layers.0.attn.q_proj.weight": torch.randn(32, 32, generator=gen),
        "layers.0.norm.weight": torch.randn(32, generator=gen).half(),
        "step": torch.tensor(7, dtype=torch.int64),
    }


@pytest.fixture
def weights_file(tmp_path: Path) -> Path:
    """A small safetensors checkpoint holding `sample_weights()`."""
    tensors = sample_weights()
    path = tmp_path / "model.safetensors"
    try:
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    except ImportError:  # a GPU machine without safetensors/numpy: write the (simple) format ourselves
        _write_safetensors(path, tensors)
    return path


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    codes = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        blob = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())
        header[name] = {
            "dtype": codes[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


@pytest.fixture
def weights_server(run_dir: Path, weights_file: Path) -> Iterator[ServerProcess]:
    """A host-backend weight server loaded from `weights_file`."""
    config = ServerConfig(kind="weights", socket=run_dir / "weights.sock", safetensors=weights_file)
    server = ServerProcess.start(config)
    yield server
    server.stop()


KV_LAYOUT = KVLayout(num_blocks=16, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")


@pytest.fixture
def kv_server(run_dir: Path) -> Iterator[ServerProcess]:
    """A host-backend KV server with a small arena."""
    server = ServerProcess.start(ServerConfig(kind="kv", socket=run_dir / "kv.sock", kv_layout=KV_LAYOUT))
    yield server
    server.stop()
