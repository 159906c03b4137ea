"""The host backend: a sealed memfd owned by the server, mapped MAP_SHARED by every client."""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import TYPE_CHECKING

import attrs

from belayer_gpumem._errors import BackendUnavailableError

if TYPE_CHECKING:
    import torch

__all__ = ["HostRegion", "map_host_fd"]

_ZERO_CHUNK = 16 * 1024 * 1024
# Seals stop any client from shrinking the memfd under everyone else (which would SIGBUS them).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@attrs.define
class HostRegion:
    """A memfd of `nbytes` plus the server's own shared mapping of it."""

    nbytes: int
    fd: int
    _map: mmap.mmap

    @classmethod
    def create(cls, nbytes: int, *, name: str = "belayer-gpumem") -> HostRegion:
        """memfd_create + ftruncate + seal + mmap; the memory starts zero-filled."""
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError) as exc:
            raise BackendUnavailableError(f"memfd_create is not available here: {exc}") from exc
        try:
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            raise
        return cls(nbytes=nbytes, fd=fd, map=region)

    def export_fd(self) -> int:
        """The memfd itself."""
        return self.fd

    def write(self, offset: int, data: memoryview) -> None:
        """Copy bytes in."""
        self._map[offset : offset + len(data)] = data

    def copy(self, src: int, dst: int, nbytes: int) -> None:
        """memmove within the region."""
        self._map.move(dst, src, nbytes)

    def zero(self, offset: int, nbytes: int) -> None:
        """Zero a range chunk by chunk (no region-sized temporary)."""
        zeros = bytes(min(_ZERO_CHUNK, nbytes))
        end = offset + nbytes
        while offset < end:
            step = min(len(zeros), end - offset)
            self._map[offset : offset + step] = zeros[:step]
            offset += step

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy bytes out."""
        return self._map[offset : offset + nbytes]

    def synchronize(self) -> None:
        """Nothing to wait for: host writes are done when `write` returns."""

    def close(self) -> None:
        """Unmap and close the memfd; the memory is freed once no client maps it."""
        if self.fd >= 0:
            self._map.close()
            os.close(self.fd)
            self.fd = -1


def map_host_fd(fd: int, nbytes: int, *, populate: bool = False) -> torch.Tensor:
    """Map a received memfd as a flat uint8 tensor; closes `fd` (the mapping keeps the memory).

    With `populate` (MAP_POPULATE) the first touch of each page is paid now, not on first use.
    """
    import torch

    try:
        if os.fstat(fd).st_size < nbytes:
            raise BackendUnavailableError(f"received region fd is smaller than the announced {nbytes} bytes")
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        region = mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    # frombuffer holds a reference to the mmap: it is unmapped when the last view is gone.
    return torch.frombuffer(region, dtype=torch.uint8)
