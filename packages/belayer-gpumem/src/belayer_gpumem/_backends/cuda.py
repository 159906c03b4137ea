"""The cuda backend: CUDA VMM allocations exported as POSIX file descriptors.

Server: cuMemCreate (requesting a POSIX fd handle) -> cuMemExportToShareableHandle -> its own
cuMemAddressReserve + cuMemMap + cuMemSetAccess mapping (for loading, copying and zeroing).
Client: cuMemImportFromShareableHandle on the received fd -> reserve + map + set access -> a torch
tensor over the device pointer through ``__cuda_array_interface__``. The physical memory lives as
long as any process holds a handle or a mapping, so it outlives whichever process dies first.

Everything here imports cuda-bindings lazily; only the cuda backend needs it. `CudaVmm` takes the
driver module as a value, so tests drive all of this with a fake driver on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import weakref
from typing import TYPE_CHECKING, Any

import attrs

from belayer_gpumem._errors import BackendUnavailableError, BelayerGpumemError, CudaDriverError

if TYPE_CHECKING:
    import torch

__all__ = ["CudaRegion", "CudaVmm", "cuda_array_interface", "load_driver", "map_cuda_fd"]

_NO_GPU_HINT = "check `nvidia-smi`, or use the host backend (--backend host)"


def load_driver() -> Any:
    """The cuda-bindings driver module (``cuda.bindings.driver``, or ``cuda.cuda`` on old releases)."""
    try:
        from cuda.bindings import driver

        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver_legacy  # type: ignore[attr-defined]

        return driver_legacy
    except ImportError as exc:
        raise BackendUnavailableError(
            "the cuda backend needs cuda-bindings and numpy: pip install 'belayer-gpumem[cuda]'"
        ) from exc


def call_driver(driver: Any, name: str, *args: Any) -> Any:
    """Call a driver function and unwrap its (CUresult, *values) tuple; CudaDriverError on failure."""
    result = getattr(driver, name)(*args)
    err, values = result[0], result[1:]
    if int(err) != 0:
        _, text = driver.cuGetErrorString(err)
        detail = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaDriverError(name, int(err), detail)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def cuda_array_interface(ptr: int, nbytes: int) -> dict[str, Any]:
    """``__cuda_array_interface__`` (version 3) of `nbytes` bytes at device address `ptr`."""
    return {
        "shape": (nbytes,),
        "typestr": "|u1",
        "data": (ptr, False),
        "strides": None,
        "version": 3,
        "stream": None,
    }


def _open_device(driver: Any, device: int) -> tuple[Any, Any]:
    """cuInit, the device and its primary context; every way this fails means "no usable GPU here"."""
    attribute = driver.CUdevice_attribute
    try:
        call_driver(driver, "cuInit", 0)
        dev = call_driver(driver, "cuDeviceGet", device)
        vmm = call_driver(
            driver,
            "cuDeviceGetAttribute",
            attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            dev,
        )
        posix_fd = call_driver(
            driver,
            "cuDeviceGetAttribute",
            attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            dev,
        )
    except CudaDriverError as exc:
        raise BackendUnavailableError(f"GPU {device} cannot be used: {exc}; {_NO_GPU_HINT}") from exc
    except (RuntimeError, OSError) as exc:  # cuda-bindings could not load libcuda.so or a symbol in it
        raise BackendUnavailableError(
            f"the NVIDIA driver library is not usable here ({exc}); {_NO_GPU_HINT}"
        ) from exc
    if not vmm:
        raise BackendUnavailableError(f"GPU {device} does not support CUDA virtual memory management")
    if not posix_fd:
        raise BackendUnavailableError(
            f"GPU {device} cannot export memory as POSIX file descriptors, which the cuda backend hands to workers"
        )
    return dev, call_driver(driver, "cuDevicePrimaryCtxRetain", dev)


@attrs.define
class CudaVmm:
    """The VMM calls of one device, with the device's primary context made current."""

    driver: Any
    device: int
    context: Any

    @classmethod
    def open(cls, device: int = 0, *, driver: Any = None) -> CudaVmm:
        """Initialise the driver and make the device's primary context (torch's too) current.

        Raises BackendUnavailableError when there is no driver, no such device, or the device lacks
        VMM or POSIX fd export.
        """
        driver = load_driver() if driver is None else driver
        _, ctx = _open_device(driver, device)
        call_driver(driver, "cuCtxSetCurrent", ctx)
        return cls(driver=driver, device=device, context=ctx)

    def call(self, name: str, *args: Any) -> Any:
        """A driver call with this device's context current on the calling thread.

        Servers run copies and memsets in worker threads, and finalizers run on any thread: a
        CUDA context is current per thread, so every call makes sure of it.
        """
        call_driver(self.driver, "cuCtxSetCurrent", self.context)
        return call_driver(self.driver, name, *args)

    def allocation_prop(self) -> Any:
        """The CUmemAllocationProp of every allocation: pinned device memory, exportable as a POSIX fd."""
        d = self.driver
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def granularity(self) -> int:
        """The minimum allocation granularity (sizes and offsets must be multiples of it)."""
        flag = self.driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self.call("cuMemGetAllocationGranularity", self.allocation_prop(), flag))

    def create(self, nbytes: int) -> Any:
        """cuMemCreate: physical memory that can be exported as a POSIX fd."""
        return self.call("cuMemCreate", nbytes, self.allocation_prop(), 0)

    def export_fd(self, handle: Any) -> int:
        """cuMemExportToShareableHandle as a POSIX fd (owned by the caller)."""
        kind = self.driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(self.call("cuMemExportToShareableHandle", handle, kind, 0))

    def import_fd(self, fd: int) -> Any:
        """cuMemImportFromShareableHandle; the fd stays the caller's to close."""
        kind = self.driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return self.call("cuMemImportFromShareableHandle", fd, kind)

    def reserve(self, nbytes: int) -> int:
        """cuMemAddressReserve: a virtual address range, not yet backed."""
        return int(self.call("cuMemAddressReserve", nbytes, self.granularity(), 0, 0))

    def map(self, ptr: int, nbytes: int, handle: Any) -> None:
        """cuMemMap + cuMemSetAccess (read-write from this device)."""
        d = self.driver
        self.call("cuMemMap", ptr, nbytes, 0, handle, 0)
        access = d.CUmemAccessDesc()
        access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.call("cuMemSetAccess", ptr, nbytes, [access], 1)

    def unmap(self, ptr: int, nbytes: int) -> None:
        """cuMemUnmap: the address range stays reserved, the backing goes."""
        self.call("cuMemUnmap", ptr, nbytes)

    def release(self, handle: Any) -> None:
        """cuMemRelease: drop this process's handle on the physical memory."""
        self.call("cuMemRelease", handle)

    def free_address(self, ptr: int, nbytes: int) -> None:
        """cuMemAddressFree."""
        self.call("cuMemAddressFree", ptr, nbytes)

    def synchronize(self) -> None:
        """cuCtxSynchronize: wait for every copy, memset and kernel issued so far in the context."""
        self.call("cuCtxSynchronize")


@attrs.define
class CudaRegion:
    """Server-owned VMM memory: the allocation handle, its exported fd and a server-side mapping."""

    nbytes: int
    vmm: CudaVmm
    handle: Any
    fd: int
    ptr: int

    @classmethod
    def create(cls, nbytes: int, *, device: int = 0, driver: Any = None) -> CudaRegion:
        """Allocate `nbytes` (rounded up to the granularity), export it, map it here, zero it."""
        vmm = CudaVmm.open(device, driver=driver)
        granularity = vmm.granularity()
        nbytes = -(-nbytes // granularity) * granularity
        handle = vmm.create(nbytes)
        fd = vmm.export_fd(handle)
        ptr = vmm.reserve(nbytes)
        vmm.map(ptr, nbytes, handle)
        region = cls(nbytes=nbytes, vmm=vmm, handle=handle, fd=fd, ptr=ptr)
        region.zero(0, nbytes)
        return region

    def export_fd(self) -> int:
        """The exported POSIX fd."""
        return self.fd

    def write(self, offset: int, data: memoryview) -> None:
        """cuMemcpyHtoD from a host buffer (complete on the device only after `synchronize()`)."""
        staging = (ctypes.c_char * len(data)).from_buffer_copy(data)
        self.vmm.call("cuMemcpyHtoD", self.ptr + offset, ctypes.addressof(staging), len(data))

    def copy(self, src: int, dst: int, nbytes: int) -> None:
        """cuMemcpyDtoD within the region, then wait for it."""
        self.vmm.call("cuMemcpyDtoD", self.ptr + dst, self.ptr + src, nbytes)
        self.vmm.synchronize()

    def zero(self, offset: int, nbytes: int) -> None:
        """cuMemsetD8, then wait for it."""
        self.vmm.call("cuMemsetD8", self.ptr + offset, 0, nbytes)
        self.vmm.synchronize()

    def read(self, offset: int, nbytes: int) -> bytes:
        """cuMemcpyDtoH into a host buffer."""
        staging = (ctypes.c_char * nbytes)()
        self.vmm.call("cuMemcpyDtoH", ctypes.addressof(staging), self.ptr + offset, nbytes)
        return bytes(staging)

    def synchronize(self) -> None:
        """Wait until every write issued so far has landed in device memory."""
        self.vmm.synchronize()

    def close(self) -> None:
        """Unmap, free the address range, release the handle, close the fd."""
        if self.fd < 0:
            return
        self.vmm.synchronize()
        self.vmm.unmap(self.ptr, self.nbytes)
        self.vmm.free_address(self.ptr, self.nbytes)
        self.vmm.release(self.handle)
        os.close(self.fd)
        self.fd = -1


class DeviceMemory:
    """Holds one client mapping; torch keeps it alive through ``__cuda_array_interface__``.

    The mapping goes when the last tensor over it is garbage-collected, and never at interpreter
    exit: tensors (and torch's own teardown) may still use it then, and the driver frees a dying
    process's mappings anyway.
    """

    def __init__(self, vmm: CudaVmm, handle: Any, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = cuda_array_interface(ptr, nbytes)
        self.finalizer = weakref.finalize(self, _unmap_client, vmm, handle, ptr, nbytes)
        self.finalizer.atexit = False


def _unmap_client(vmm: CudaVmm, handle: Any, ptr: int, nbytes: int) -> None:
    # Runs when the last view is collected, on whatever thread that happens.
    with contextlib.suppress(BelayerGpumemError):
        vmm.synchronize()  # no kernel may still use the range
        vmm.unmap(ptr, nbytes)
        vmm.free_address(ptr, nbytes)
        vmm.release(handle)


def import_mapping(vmm: CudaVmm, fd: int, nbytes: int) -> DeviceMemory:
    """Import a VMM fd, map it read-write here; closes `fd`."""
    try:
        handle = vmm.import_fd(fd)
    finally:
        os.close(fd)
    ptr = vmm.reserve(nbytes)
    vmm.map(ptr, nbytes, handle)
    return DeviceMemory(vmm, handle, ptr, nbytes)


def map_cuda_fd(fd: int, nbytes: int, *, device: int = 0) -> torch.Tensor:
    """Import a VMM fd and map it as a flat uint8 CUDA tensor; closes `fd`."""
    import torch

    try:
        torch.cuda.set_device(device)
        torch.cuda.init()  # type: ignore[no-untyped-call]
        vmm = CudaVmm.open(device)
    except BaseException:
        os.close(fd)
        raise
    return torch.as_tensor(import_mapping(vmm, fd, nbytes), device=f"cuda:{device}")
