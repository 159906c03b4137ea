"""The cuda backend on `FakeCudaDriver`: argument building, call order and error mapping, no GPU needed."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cuda import GRANULARITY, CUdevice_attribute, CUresult, FakeCudaDriver

from belayer_gpumem import BackendUnavailableError, IdleBuffer, ServerConfig
from belayer_gpumem._backends import cuda
from belayer_gpumem._backends.cuda import CudaRegion, CudaVmm, import_mapping
from belayer_gpumem._errors import CudaDriverError
from belayer_gpumem._regionstate import RegionState
from belayer_gpumem._safetensors_io import read_safetensors


@pytest.fixture
def fake() -> FakeCudaDriver:
    return FakeCudaDriver()


@pytest.fixture
def installed_fake(fake: FakeCudaDriver, monkeypatch: pytest.MonkeyPatch) -> FakeCudaDriver:
    """The fake as the driver that cuda-bindings would give the backend."""
    monkeypatch.setattr(cuda, "load_driver", lambda: fake)
    return fake


def test_region_is_built_with_exportable_pinned_memory_and_read_write_access(fake: FakeCudaDriver) -> None:
    region = CudaRegion.create(3 * 1024 * 1024, driver=fake)
    assert region.nbytes == 2 * GRANULARITY  # rounded up to the granularity
    (_, (size, prop, _)) = next(call for call in fake.calls if call[0] == "cuMemCreate")
    assert size == region.nbytes
    assert prop.type == fake.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert (prop.location.type, prop.location.id) == (fake.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 0)
    assert (
        prop.requestedHandleTypes == fake.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    (_, (ptr, nbytes, descs, count)) = next(call for call in fake.calls if call[0] == "cuMemSetAccess")
    assert (ptr, nbytes, count) == (region.ptr, region.nbytes, 1)
    assert descs[0].flags == fake.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert fake.exported[region.export_fd()] == region.handle
    region.write(5, memoryview(b"belayer"))
    region.synchronize()
    assert region.read(0, 16) == b"\0" * 5 + b"belayer" + b"\0" * 4  # zeroed at creation
    region.close()
    assert not fake.mappings
    assert not fake.reserved
    assert fake.names()[-1] == "cuMemRelease"


def test_a_failed_driver_call_is_a_typed_error_that_names_the_call(fake: FakeCudaDriver) -> None:
    fake.fail["cuMemCreate"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaDriverError, match="cuMemCreate failed with CUDA error 2") as caught:
        CudaRegion.create(GRANULARITY, driver=fake)
    assert caught.value.code == 2
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(caught.value)


def test_a_missing_driver_library_is_backend_unavailable(fake: FakeCudaDriver) -> None:
    fake.missing_library = True
    with pytest.raises(BackendUnavailableError, match=r"driver library is not usable.*--backend host"):
        CudaVmm.open(0, driver=fake)


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ({"fail": {"cuInit": CUresult.CUDA_ERROR_NO_DEVICE}}, "GPU 0 cannot be used.*NO_DEVICE"),
        ({"device": 3}, "GPU 3 cannot be used.*INVALID_DEVICE"),
        (
            {"attributes": {CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 0}},
            "virtual memory management",
        ),
        (
            {
                "attributes": {
                    CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 0
                }
            },
            "POSIX file descriptors",
        ),
    ],
)
def test_a_device_the_backend_cannot_use_is_backend_unavailable(setup: dict[str, Any], match: str) -> None:
    fake = FakeCudaDriver()
    fake.fail.update(setup.get("fail", {}))
    for attribute, value in setup.get("attributes", {}).items():
        fake.attributes[attribute] = value
    with pytest.raises(BackendUnavailableError, match=match):
        CudaVmm.open(setup.get("device", 0), driver=fake)
    assert "cuMemCreate" not in fake.names()


def test_without_cuda_bindings_or_a_gpu_the_real_backend_is_unavailable() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the cuda backend is available here")
    from belayer_gpumem._backends import create_region

    with pytest.raises(BackendUnavailableError):
        create_region("cuda", GRANULARITY)


def test_weights_are_on_the_device_before_the_server_reports_ready(
    installed_fake: FakeCudaDriver, weights_file: Path, tmp_path: Path
) -> None:
    config = ServerConfig(
        kind="weights", socket=tmp_path / "w.sock", backend="cuda", safetensors=weights_file
    )
    state = RegionState.allocate(config)  # the server announces readiness right after this returns
    names = installed_fake.names()
    last_copy = max(i for i, name in enumerate(names) if name == "cuMemcpyHtoD")
    assert "cuCtxSynchronize" in names[last_copy:]
    assert installed_fake.pending == 0
    layout = read_safetensors(weights_file).layout
    spec = layout.by_name["step"]
    assert state.region.read(spec.offset, spec.nbytes) == (7).to_bytes(8, "little")
    state.close()


def test_idle_buffer_maps_its_range_before_torch_sees_it(
    installed_fake: FakeCudaDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []

    def as_tensor(obj: Any, device: str) -> torch.Tensor:  # a CPU stand-in for torch's CUDA tensor
        ptr, _ = obj.__cuda_array_interface__["data"]
        assert ptr in installed_fake.mappings, "a tensor over a range that is not mapped"
        made.append(ptr)
        return torch.zeros(obj.__cuda_array_interface__["shape"][0], dtype=torch.uint8)

    monkeypatch.setattr(torch, "as_tensor", as_tensor)
    buffer = IdleBuffer.allocate(GRANULARITY + 1, backend="cuda")
    assert buffer.resident
    assert made
    assert made[0] in installed_fake.mappings
    buffer.release()
    assert not installed_fake.mappings
    assert made[0] in installed_fake.reserved  # the address stays ours
    buffer.restore()
    assert made[0] in installed_fake.mappings
    assert installed_fake.names().count("cuMemCreate") == 2


_EXIT_SCRIPT = """
import gc, sys
sys.path.insert(0, {tests!r})
from fake_cuda import FakeCudaDriver, GRANULARITY
from belayer_gpumem._backends.cuda import CudaRegion, CudaVmm, import_mapping
from belayer_gpumem._idle import _VirtualRange

fake = FakeCudaDriver(log_path={log!r})
region = CudaRegion.create(GRANULARITY, driver=fake)
vmm = CudaVmm.open(0, driver=fake)
dropped = import_mapping(vmm, fake.cuMemExportToShareableHandle(region.handle, 1, 0)[1], GRANULARITY)
del dropped
gc.collect()
with open({log!r}, "a") as log:
    log.write("DROPPED\\n")
KEPT = import_mapping(vmm, fake.cuMemExportToShareableHandle(region.handle, 1, 0)[1], GRANULARITY)
RANGE = _VirtualRange(GRANULARITY, 0, driver=fake)
"""


def test_live_mappings_are_not_unmapped_at_interpreter_exit(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    script = _EXIT_SCRIPT.format(tests=str(Path(__file__).parent), log=str(log))
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=120)
    before, after = log.read_text().split("DROPPED\n")
    assert before.split().count("cuMemUnmap") == 1  # a mapping nobody uses goes when it is collected
    assert "cuMemMap" in after.split()
    assert not {"cuMemUnmap", "cuMemRelease", "cuMemAddressFree"} & set(after.split())


def test_the_cuda_extra_brings_numpy() -> None:
    requirements = importlib.metadata.requires("belayer-gpumem") or []
    cuda_extra = [r for r in requirements if 'extra == "cuda"' in r]
    assert any(r.startswith("numpy") for r in cuda_extra)
    assert any(r.startswith("cuda-bindings") for r in cuda_extra)


def test_import_mapping_closes_the_fd_even_when_import_fails(fake: FakeCudaDriver) -> None:
    vmm = CudaVmm.open(0, driver=fake)
    fake.fail["cuMemImportFromShareableHandle"] = CUresult.CUDA_ERROR_INVALID_VALUE
    fd = os.memfd_create("received")
    with pytest.raises(CudaDriverError, match="cuMemImportFromShareableHandle"):
        import_mapping(vmm, fd, GRANULARITY)
    with pytest.raises(OSError):
        os.fstat(fd)
