"""The cuda backend (CUDA VMM + POSIX fd export): run by scripts/gpu-check on a GPU machine."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import run_worker, sample_weights, start_worker, wait_line

from belayer_gpumem import (
    IdleBuffer,
    KVClient,
    KVLayout,
    ServerConfig,
    ServerProcess,
    WeightClient,
    check_gpu_health,
)

pytestmark = pytest.mark.gpu

_GPU_KV = KVLayout(num_blocks=64, num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


@pytest.fixture
def cuda_weights(run_dir: Path, weights_file: Path) -> Iterator[ServerProcess]:
    config = ServerConfig(kind="weights", socket=run_dir / "w.sock", backend="cuda", safetensors=weights_file)
    server = ServerProcess.start(config, timeout_s=120)
    yield server
    server.stop()


@pytest.fixture
def cuda_kv(run_dir: Path) -> Iterator[ServerProcess]:
    config = ServerConfig(kind="kv", socket=run_dir / "kv.sock", backend="cuda", kv_layout=_GPU_KV)
    server = ServerProcess.start(config, timeout_s=120)
    yield server
    server.stop()


def test_health_check_passes_on_a_good_gpu() -> None:
    report = check_gpu_health(0)
    assert report.device == 0
    assert "correct" in report.detail


def test_cuda_weights_export_import_across_processes(cuda_weights: ServerProcess, weights_file: Path) -> None:
    expected = sample_weights()
    socket = str(cuda_weights.config.socket)
    with WeightClient.attach(socket) as client:
        assert client.backend == "cuda"
        assert client.region.is_cuda
        for name, tensor in client.tensors().items():
            assert torch.equal(tensor.cpu(), expected[name])
        run_worker("weights-fill", socket, "1.5")  # another process writes through its own mapping
        assert client.refresh()
        assert bool((client.tensors()["layers.0.attn.q_proj.weight"] == 1.5).all())
        assert client.health()["healthy"]


def test_cuda_kill_a_client_and_attach_again(cuda_weights: ServerProcess) -> None:
    socket = str(cuda_weights.config.socket)
    holder = start_worker("weights-write-hold", socket, "4.0")
    assert wait_line(holder, "HOLDING") == "HOLDING 2"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out = run_worker("weights-checksum", socket)
    assert "VERSION 2" in out
    assert f"layers.0.attn.q_proj.weight:{4.0 * 32 * 32:.6f}" in out


def test_cuda_kv_flush_and_cross_process_write(cuda_kv: ServerProcess) -> None:
    socket = str(cuda_kv.config.socket)
    with KVClient.attach(socket) as kv:
        assert kv.arena.is_cuda
        assert kv.arena.shape == _GPU_KV.shape
        run_worker("kv-write", socket, "2", "1.0")
        assert float(kv.arena[:, :, 2].float().sum()) == _GPU_KV.block_bytes // 2
        assert kv.flush() == 1
        assert float(kv.arena.float().abs().sum()) == 0


def test_cuda_idle_buffer_unmap_and_remap_at_the_same_address() -> None:
    buffer = IdleBuffer.allocate(8 * 1024 * 1024, backend="cuda")
    address = buffer.tensor.data_ptr()
    buffer.tensor.fill_(3)
    free_before, _ = torch.cuda.mem_get_info()
    buffer.release()
    free_released, _ = torch.cuda.mem_get_info()
    assert free_released >= free_before + buffer.nbytes // 2
    buffer.restore()
    assert buffer.tensor.data_ptr() == address
    buffer.tensor.add_(5)
    torch.cuda.synchronize()
    assert int(buffer.tensor.max()) == 5
    assert int(buffer.tensor.min()) == 5
