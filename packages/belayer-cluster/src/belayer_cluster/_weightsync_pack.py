"""One weight version as bytes: packed in the weight server's slot layout, and its checksum.

The trainer packs its tensors at the offsets of the weight server's table (belayer-gpumem's
`WeightLayout`), so a node receives the version straight into its server's inactive slot, byte
for byte, and every node's checksum of that slot must equal the trainer's.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from belayer_cluster._errors import WeightSyncError
from belayer_gpumem import WeightLayout

__all__ = ["checksum", "pack", "unpack"]

# crc32 of the slot in pieces: zlib releases the GIL on large buffers; ~2 GB/s here.
_PIECE_BYTES = 64 << 20


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"weight layout dtype {name!r} is not a torch dtype")
    return dtype


def checksum(flat: torch.Tensor) -> str:
    """`crc32:<8 hex>` of a flat uint8 tensor (a whole slot, padding included)."""
    data = flat.contiguous().numpy()
    value = 0
    for start in range(0, data.size, _PIECE_BYTES):
        value = zlib.crc32(data[start : start + _PIECE_BYTES].data, value)
    return f"crc32:{value:08x}"


def pack(
    tensors: Mapping[str, torch.Tensor], layout: WeightLayout, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The slot's bytes for `tensors` (cast to the table's dtypes; padding zero).

    Every tensor of the table must be given with its shape; extra names (a tied `lm_head.weight`)
    are ignored. `out` (a uint8 tensor of `layout.slot_bytes`) is reused when given.
    Raises WeightSyncError naming the first missing or misshapen tensor.
    """
    table = layout.by_name
    missing = sorted(set(table) - set(tensors))
    if missing:
        raise WeightSyncError(
            f"the weights lack {len(missing)} tensors of the server's table, e.g. {missing[:3]}"
        )
    flat = torch.zeros(layout.slot_bytes, dtype=torch.uint8) if out is None else out
    if flat.numel() != layout.slot_bytes or flat.dtype != torch.uint8:
        raise WeightSyncError(f"the pack buffer must be {layout.slot_bytes} uint8 bytes")
    if out is not None:
        flat.zero_()
    for spec in layout.tensors:
        source = tensors[spec.name]
        if tuple(source.shape) != spec.shape:
            raise WeightSyncError(
                f"{spec.name} has shape {tuple(source.shape)}, the server's table {spec.shape}"
            )
        view = flat[spec.offset : spec.offset + spec.nbytes].view(_dtype(spec.dtype)).view(spec.shape)
        view.copy_(source.detach())
    return flat


def unpack(flat: torch.Tensor, layout: WeightLayout) -> dict[str, torch.Tensor]:
    """{name: tensor} views of a packed slot (zero copy)."""
    return {
        spec.name: flat[spec.offset : spec.offset + spec.nbytes].view(_dtype(spec.dtype)).view(spec.shape)
        for spec in layout.tensors
    }


def gloo_group(store: Any, rank: int, timeout: timedelta, address: str) -> Any:
    """A two-member gloo group whose member listens on `address` (an address of its machine that
    the other reaches). Gloo's default is the address the hostname resolves to, which a node that
    shares nothing with this machine need not reach (nor resolve: an isolated node's name)."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]  # type: ignore[attr-defined]
    return dist.ProcessGroupGloo(store, rank, 2, options)  # type: ignore[attr-defined]
