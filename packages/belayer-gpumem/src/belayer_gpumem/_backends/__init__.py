"""Backends that own (server side) and map (client side) a region: `host` (memfd) and `cuda` (VMM).

Both hand the region around as one file descriptor, so one protocol serves both. The cuda backend
is imported lazily: the host backend never needs CUDA or cuda-bindings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from belayer_gpumem._errors import BackendUnavailableError

if TYPE_CHECKING:
    import torch

__all__ = ["BACKENDS", "Backend", "ServerRegion", "create_region", "map_region"]

Backend = Literal["host", "cuda"]
BACKENDS: tuple[Backend, ...] = ("host", "cuda")


class ServerRegion(Protocol):
    """The memory a server owns: exported as an fd, written through the server's own mapping."""

    nbytes: int

    def export_fd(self) -> int:
        """An fd that a client can map; owned by the region (send a copy, never close it)."""
        ...

    def write(self, offset: int, data: memoryview) -> None:
        """Copy host bytes into the region at `offset`."""
        ...

    def copy(self, src: int, dst: int, nbytes: int) -> None:
        """Copy `nbytes` within the region from offset `src` to offset `dst`."""
        ...

    def zero(self, offset: int, nbytes: int) -> None:
        """Set `nbytes` bytes at `offset` to zero and wait until that is done."""
        ...

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy bytes out of the region (for health probes and tests)."""
        ...

    def synchronize(self) -> None:
        """Wait until every `write` so far has landed (the server calls it before it reports ready)."""
        ...

    def close(self) -> None:
        """Release the server's hold on the memory (clients that mapped it keep theirs)."""
        ...


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise BackendUnavailableError(f"unknown backend {backend!r}; use one of {BACKENDS}")


def create_region(
    backend: str, nbytes: int, *, device: int = 0, name: str = "belayer-gpumem"
) -> ServerRegion:
    """Allocate a new exportable region of `nbytes` (zero-filled) with the chosen backend."""
    _check_backend(backend)
    if backend == "host":
        from belayer_gpumem._backends.host import HostRegion

        return HostRegion.create(nbytes, name=name)
    from belayer_gpumem._backends.cuda import CudaRegion

    return CudaRegion.create(nbytes, device=device)


def map_region(
    backend: str, fd: int, nbytes: int, *, device: int = 0, populate: bool = False
) -> torch.Tensor:
    """Map an exported region fd into this process as a flat uint8 tensor (zero copy).

    The fd is consumed (closed). The mapping lives as long as any view of the returned tensor.
    `populate` (host) fills the page tables now instead of at first touch (cuda maps eagerly anyway).
    """
    _check_backend(backend)
    if backend == "host":
        from belayer_gpumem._backends.host import map_host_fd

        return map_host_fd(fd, nbytes, populate=populate)
    from belayer_gpumem._backends.cuda import map_cuda_fd

    return map_cuda_fd(fd, nbytes, device=device)
