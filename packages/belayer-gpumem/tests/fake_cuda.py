"""`FakeCudaDriver`: the slice of ``cuda.bindings.driver`` the cuda backend calls, on host memory.

It stands in for the NVIDIA driver (outside this package) so that the cuda backend's argument
building, call order and error mapping run on machines without a GPU. Physical allocations are
host buffers, "device" addresses are made up, copies really move bytes, and every call is logged.
Copies and memsets stay *pending* until cuCtxSynchronize, as on a real GPU. Inject failures with
`fail` (call name -> CUresult), `attributes` (device attributes) or `missing_library`.
"""

from __future__ import annotations

import ctypes
import enum
import os
import types
from typing import Any

import attrs

GRANULARITY = 2 * 1024 * 1024
_ADDRESS_BASE = 0x7F00_0000_0000


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103


_NAMESPACES = {
    "CUmemAllocationType": {"CU_MEM_ALLOCATION_TYPE_PINNED": 1},
    "CUmemLocationType": {"CU_MEM_LOCATION_TYPE_DEVICE": 1},
    "CUmemAllocationHandleType": {"CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR": 1},
    "CUmemAllocationGranularity_flags": {"CU_MEM_ALLOC_GRANULARITY_MINIMUM": 0},
    "CUmemAccess_flags": {"CU_MEM_ACCESS_FLAGS_PROT_READWRITE": 3},
}


class _Location:
    def __init__(self) -> None:
        self.type: int | None = None
        self.id: int | None = None


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type: int | None = None
        self.location = _Location()
        self.requestedHandleTypes: int | None = None


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = _Location()
        self.flags: int | None = None


# Annotations in FakeCudaDriver use these names: its class attributes `CUresult` & co. (the
# driver module's names) shadow the classes in the class body.
_Result = CUresult
_AllocationProp = CUmemAllocationProp
_AccessDesc = CUmemAccessDesc


@attrs.define
class FakeCudaDriver:
    """One fake GPU (ordinal 0) and its driver calls; see the module docstring."""

    fail: dict[str, _Result] = attrs.field(factory=dict)
    attributes: dict[int, int] = attrs.field(
        factory=lambda: {attribute: 1 for attribute in CUdevice_attribute}
    )
    missing_library: bool = False
    log_path: str | None = None  # also append each call's name here (for calls made at interpreter exit)
    calls: list[tuple[str, tuple[Any, ...]]] = attrs.field(factory=list)
    pending: int = 0  # copies and memsets issued since the last cuCtxSynchronize
    allocations: dict[int, ctypes.Array[ctypes.c_char]] = attrs.field(factory=dict)
    exported: dict[int, int] = attrs.field(factory=dict)  # fd -> allocation handle
    mappings: dict[int, tuple[int, int]] = attrs.field(factory=dict)  # address -> (nbytes, handle)
    reserved: dict[int, int] = attrs.field(factory=dict)  # address -> nbytes
    _next: int = 1
    _next_address: int = _ADDRESS_BASE

    CUdevice_attribute = CUdevice_attribute
    CUresult = CUresult
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __getattr__(self, name: str) -> Any:
        if name in _NAMESPACES:
            return types.SimpleNamespace(**_NAMESPACES[name])
        raise AttributeError(name)

    def names(self) -> list[str]:
        """The names of the calls made so far, in order."""
        return [name for name, _ in self.calls]

    def _enter(self, name: str, *args: Any) -> _Result:
        if self.missing_library:  # what cuda-bindings raises when it cannot dlopen libcuda
            raise RuntimeError("Failed to dlopen libcuda.so.1")
        self.calls.append((name, args))
        if self.log_path is not None:
            with open(self.log_path, "a") as log:
                log.write(name + "\n")
        return self.fail.get(name, CUresult.CUDA_SUCCESS)

    def _id(self) -> int:
        self._next += 1
        return self._next

    def _host_address(self, address: int, nbytes: int) -> int:
        for start, (size, handle) in self.mappings.items():
            if start <= address and address + nbytes <= start + size:
                return ctypes.addressof(self.allocations[handle]) + address - start
        raise AssertionError(f"fake GPU: {nbytes} bytes at {address:#x} are not mapped")

    def cuGetErrorString(self, err: _Result) -> tuple[_Result, bytes]:
        return CUresult.CUDA_SUCCESS, CUresult(err).name.encode()

    def cuInit(self, flags: int) -> tuple[_Result]:
        return (self._enter("cuInit", flags),)

    def cuDeviceGet(self, ordinal: int) -> tuple[_Result, int]:
        err = self._enter("cuDeviceGet", ordinal)
        return (CUresult.CUDA_ERROR_INVALID_DEVICE if ordinal != 0 and not err else err), ordinal

    def cuDeviceGetAttribute(self, attribute: int, device: int) -> tuple[_Result, int]:
        return self._enter("cuDeviceGetAttribute", attribute, device), self.attributes.get(attribute, 0)

    def cuDevicePrimaryCtxRetain(self, device: int) -> tuple[_Result, str]:
        return self._enter("cuDevicePrimaryCtxRetain", device), f"context-{device}"

    def cuCtxSetCurrent(self, context: str) -> tuple[_Result]:
        return (self._enter("cuCtxSetCurrent", context),)

    def cuCtxSynchronize(self) -> tuple[_Result]:
        err = self._enter("cuCtxSynchronize")
        if not err:
            self.pending = 0
        return (err,)

    def cuMemGetAllocationGranularity(self, prop: _AllocationProp, flag: int) -> tuple[_Result, int]:
        return self._enter("cuMemGetAllocationGranularity", prop, flag), GRANULARITY

    def cuMemCreate(self, nbytes: int, prop: _AllocationProp, flags: int) -> tuple[_Result, int]:
        err = self._enter("cuMemCreate", nbytes, prop, flags)
        if err:
            return err, 0
        assert nbytes % GRANULARITY == 0, "cuMemCreate needs a multiple of the granularity"
        handle = self._id()
        self.allocations[handle] = (ctypes.c_char * nbytes)()
        return err, handle

    def cuMemExportToShareableHandle(self, handle: int, kind: int, flags: int) -> tuple[_Result, int]:
        err = self._enter("cuMemExportToShareableHandle", handle, kind, flags)
        fd = os.memfd_create("fake-cuda-export", os.MFD_CLOEXEC)
        self.exported[fd] = handle
        return err, fd

    def cuMemImportFromShareableHandle(self, fd: int, kind: int) -> tuple[_Result, int]:
        return self._enter("cuMemImportFromShareableHandle", fd, kind), self.exported.get(fd, 0)

    def cuMemAddressReserve(self, nbytes: int, align: int, addr: int, flags: int) -> tuple[_Result, int]:
        err = self._enter("cuMemAddressReserve", nbytes, align, addr, flags)
        address = self._next_address
        self._next_address += nbytes + GRANULARITY
        self.reserved[address] = nbytes
        return err, address

    def cuMemMap(self, address: int, nbytes: int, offset: int, handle: int, flags: int) -> tuple[_Result]:
        err = self._enter("cuMemMap", address, nbytes, offset, handle, flags)
        if not err:
            assert self.reserved.get(address) == nbytes, "cuMemMap outside a reserved range"
            assert address not in self.mappings, "cuMemMap over a mapped range"
            self.mappings[address] = (nbytes, handle)
        return (err,)

    def cuMemSetAccess(
        self, address: int, nbytes: int, descs: list[_AccessDesc], count: int
    ) -> tuple[_Result]:
        return (self._enter("cuMemSetAccess", address, nbytes, descs, count),)

    def cuMemUnmap(self, address: int, nbytes: int) -> tuple[_Result]:
        err = self._enter("cuMemUnmap", address, nbytes)
        if not err:
            assert self.mappings.pop(address)[0] == nbytes
        return (err,)

    def cuMemRelease(self, handle: int) -> tuple[_Result]:
        return (self._enter("cuMemRelease", handle),)

    def cuMemAddressFree(self, address: int, nbytes: int) -> tuple[_Result]:
        err = self._enter("cuMemAddressFree", address, nbytes)
        if not err:
            assert address not in self.mappings, "cuMemAddressFree of a mapped range"
            assert self.reserved.pop(address) == nbytes
        return (err,)

    def cuMemcpyHtoD(self, dst: int, src: int, nbytes: int) -> tuple[_Result]:
        err = self._enter("cuMemcpyHtoD", dst, src, nbytes)
        if not err:
            ctypes.memmove(self._host_address(dst, nbytes), src, nbytes)
            self.pending += 1
        return (err,)

    def cuMemcpyDtoH(self, dst: int, src: int, nbytes: int) -> tuple[_Result]:
        err = self._enter("cuMemcpyDtoH", dst, src, nbytes)
        if not err:
            ctypes.memmove(dst, self._host_address(src, nbytes), nbytes)
        return (err,)

    def cuMemcpyDtoD(self, dst: int, src: int, nbytes: int) -> tuple[_Result]:
        err = self._enter("cuMemcpyDtoD", dst, src, nbytes)
        if not err:
            ctypes.memmove(self._host_address(dst, nbytes), self._host_address(src, nbytes), nbytes)
            self.pending += 1
        return (err,)

    def cuMemsetD8(self, dst: int, value: int, nbytes: int) -> tuple[_Result]:
        err = self._enter("cuMemsetD8", dst, value, nbytes)
        if not err:
            ctypes.memset(self._host_address(dst, nbytes), value, nbytes)
            self.pending += 1
        return (err,)
