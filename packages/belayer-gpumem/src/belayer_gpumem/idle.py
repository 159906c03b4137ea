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
from typing import Any

import attrs
import torch

from belayer_gpumem.backends import BACKENDS
from belayer_gpumem.errors import BackendUnavailableError, BelayerGpumemError
from belayer_gpumem.layout import round_up

__all__ = ["IdleBuffer"]


class _VirtualRange:
    """A reserved CUDA address range whose backing can come and go (torch holds it via CAI)."""

    def __init__(self, nbytes: int, device: int) -> None:
        from belayer_gpumem.backends.cuda import CudaVmm

        self.vmm = CudaVmm.open(device)
        self.nbytes = round_up(nbytes, self.vmm.granularity())
        self.ptr = self.vmm.reserve(self.nbytes)
        self.handle: Any = None
        self.__cuda_array_interface__ = {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def back(self) -> None:
        self.handle = self.vmm.create(self.nbytes)
        self.vmm.map(self.ptr, self.nbytes, self.handle)
        self.vmm.synchronize()

    def unback(self) -> None:
        self.vmm.synchronize()
        self.vmm.unmap(self.ptr, self.nbytes)
        self.vmm.release(self.handle)
        self.handle = None

    def __del__(self) -> None:
        # torch drops its reference when the last view is gone, possibly at interpreter exit.
        with contextlib.suppress(BelayerGpumemError):
            if self.handle is not None:
                self.unback()
            self.vmm.free_address(self.ptr, self.nbytes)


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
        else:
            virtual = _VirtualRange(max(nbytes, 1), device)
            tensor = torch.as_tensor(virtual, device=f"cuda:{device}")
            buffer = cls(backend=backend, tensor=tensor, resident=False, cuda=virtual)
        buffer.restore()
        return buffer

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
