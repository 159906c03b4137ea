"""Private buffers that give their memory back while a worker idles, at a stable address.

A shadow worker keeps its CUDA-graph placeholder and scratch buffers as `IdleBuffer`s: `release()`
while standing by, `restore()` at handover. The tensor keeps its address throughout (so captured
graphs stay valid); its contents are zero after `restore()`, and it must not be used in between.

- host: an anonymous private mapping; release = madvise(MADV_DONTNEED), restore = touch every page.
- cuda: a reserved virtual range; release = cuMemUnmap + cuMemRelease, restore = cuMemCreate +
  cuMemMap + cuMemSetAccess at the same address.
"""

from __future__ import annotations

import contextlib
import mmap
import weakref
from typing import TYPE_CHECKING, Any

import attrs
import torch

from belayer_gpumem._backends import BACKENDS
from belayer_gpumem._errors import BackendUnavailableError, BelayerGpumemError
from belayer_gpumem._layout import round_up

if TYPE_CHECKING:
    from belayer_gpumem._backends.cuda import CudaVmm

__all__ = ["IdleBuffer"]


class _VirtualRange:
    """A reserved CUDA address range whose backing can come and go (torch holds it via CAI).

    It is created backed: a tensor may only ever be made over mapped memory.
    """

    def __init__(self, nbytes: int, device: int, *, driver: Any = None) -> None:
        from belayer_gpumem._backends.cuda import CudaVmm, cuda_array_interface

        self.vmm = CudaVmm.open(device, driver=driver)
        self.nbytes = round_up(nbytes, self.vmm.granularity())
        self.ptr = self.vmm.reserve(self.nbytes)
        # The backing now: zero or one handle, in a list the finalizer shares (it must not hold `self`).
        self.handles: list[Any] = []
        self.back()
        self.__cuda_array_interface__ = cuda_array_interface(self.ptr, self.nbytes)
        # Freed when torch drops its last reference, never at interpreter exit (tensors may live on).
        self.finalizer = weakref.finalize(self, _free_range, self.vmm, self.ptr, self.nbytes, self.handles)
        self.finalizer.atexit = False

    def back(self) -> None:
        handle = self.vmm.create(self.nbytes)
        self.vmm.map(self.ptr, self.nbytes, handle)
        self.handles.append(handle)

    def unback(self) -> None:
        self.vmm.synchronize()  # no kernel may still be using the memory
        handle = self.handles.pop()
        self.vmm.unmap(self.ptr, self.nbytes)
        self.vmm.release(handle)


def _free_range(vmm: CudaVmm, ptr: int, nbytes: int, handles: list[Any]) -> None:
    with contextlib.suppress(BelayerGpumemError):
        vmm.synchronize()
        if handles:
            vmm.unmap(ptr, nbytes)
            vmm.release(handles.pop())
        vmm.free_address(ptr, nbytes)


@attrs.define
class IdleBuffer:
    """A flat uint8 buffer whose memory can be released and restored without moving it."""

    backend: str
    tensor: torch.Tensor
    resident: bool
    _host: mmap.mmap | None = None
    _cuda: _VirtualRange | None = None

    @classmethod
    def allocate(cls, nbytes: int, *, backend: str = "host", device: int = 0) -> IdleBuffer:
        """A resident, zero-filled buffer of at least `nbytes` bytes."""
        if backend not in BACKENDS:
            raise BackendUnavailableError(f"unknown backend {backend!r}; use one of {BACKENDS}")
        if backend == "host":
            size = round_up(max(nbytes, 1), mmap.PAGESIZE)
            private = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            tensor = torch.frombuffer(private, dtype=torch.uint8)
            buffer = cls(backend=backend, tensor=tensor, resident=False, host=private)
            buffer.restore()
            return buffer
        virtual = _VirtualRange(max(nbytes, 1), device)  # mapped before torch ever sees the address
        tensor = torch.as_tensor(virtual, device=f"cuda:{device}")
        tensor.zero_()
        return cls(backend=backend, tensor=tensor, resident=True, cuda=virtual)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.tensor.numel()

    def release(self) -> None:
        """Give the memory back to the OS / the GPU; the address stays reserved."""
        if not self.resident:
            return
        if self._host is not None:
            self._host.madvise(mmap.MADV_DONTNEED)
        elif self._cuda is not None:
            self._cuda.unback()
        self.resident = False

    def restore(self) -> None:
        """Back the buffer with memory again (zero-filled, pages populated now, not on first use)."""
        if self.resident:
            return
        if self._cuda is not None:
            self._cuda.back()
        self.tensor.zero_()
        self.resident = True
