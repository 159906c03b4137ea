"""Region layouts: the weight table (name -> offset, dtype, shape) and the paged KV arena.

Pure bookkeeping, no torch: layouts travel over the wire as JSON and are validated on both ends.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from belayer_gpumem._errors import LayoutError

__all__ = [
    "DTYPE_SIZES",
    "REGION_ALIGNMENT",
    "TENSOR_ALIGNMENT",
    "FusedSpec",
    "KVLayout",
    "TensorSpec",
    "WeightLayout",
    "round_up",
]

# Element sizes of the dtypes a region may hold, by torch's name for them.
DTYPE_SIZES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# Every tensor starts on a 256-byte boundary (coalesced GPU loads, any dtype view is legal).
TENSOR_ALIGNMENT = 256
# Slots and arenas are whole multiples of 2 MiB: the CUDA VMM granularity and a huge page.
REGION_ALIGNMENT = 2 * 1024 * 1024


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple`."""
    return -(-value // multiple) * multiple


def _check_dtype(_inst: object, _attr: object, value: str) -> None:
    if value not in DTYPE_SIZES:
        raise LayoutError(f"unsupported dtype {value!r}; use one of {sorted(DTYPE_SIZES)}")


def _check_shape(_inst: object, _attr: object, value: tuple[int, ...]) -> None:
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in value):
        raise LayoutError(f"shape {value!r} must be a tuple of non-negative ints")


def _check_offset(_inst: object, _attr: object, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise LayoutError(f"offset {value!r} must be an int")


def _to_shape(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _to_specs(value: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    return tuple(value)


@attrs.frozen
class TensorSpec:
    """One named tensor in a weight slot: `nbytes` bytes at `offset` from the slot's start."""

    name: str
    dtype: str = attrs.field(validator=_check_dtype)
    shape: tuple[int, ...] = attrs.field(converter=_to_shape, validator=_check_shape)
    offset: int = attrs.field(default=0, validator=_check_offset)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.numel * DTYPE_SIZES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        """The wire form."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}


def _to_names(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


@attrs.frozen
class FusedSpec:
    """A merged tensor: table tensors `parts` that lie back to back along their first dimension,
    with no gap, seen as one tensor `name` (e.g. vLLM's `qkv_proj` over q, k and v). Writers
    write the parts by their own names; readers of the merged name get one view of all of them."""

    name: str
    parts: tuple[str, ...] = attrs.field(converter=_to_names)

    def to_json(self) -> dict[str, Any]:
        """The wire form."""
        return {"name": self.name, "parts": list(self.parts)}


def _to_fused(value: Iterable[FusedSpec]) -> tuple[FusedSpec, ...]:
    return tuple(value)


@attrs.frozen
class WeightLayout:
    """The weight table of one slot; the weight region holds two slots (a double buffer).

    `fused` names merged regions over table tensors (see `FusedSpec`): the layout the engine
    reads, so that a merged parameter is one view of the region, never a copy.
    """

    tensors: tuple[TensorSpec, ...] = attrs.field(converter=_to_specs)
    slot_bytes: int
    fused: tuple[FusedSpec, ...] = attrs.field(default=(), converter=_to_fused)

    def __attrs_post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise LayoutError("tensor names in a weight layout must be unique")
        if (
            not isinstance(self.slot_bytes, int)
            or isinstance(self.slot_bytes, bool)
            or self.slot_bytes <= 0
            or self.slot_bytes % REGION_ALIGNMENT
        ):
            raise LayoutError(f"slot_bytes must be a positive multiple of {REGION_ALIGNMENT}")
        # A part after the first of a merged region starts where the previous part ends: only its
        # element size aligns it.
        continued = {part for group in self.fused for part in group.parts[1:]}
        for spec in self.tensors:
            alignment = DTYPE_SIZES[spec.dtype] if spec.name in continued else TENSOR_ALIGNMENT
            if spec.offset % alignment or spec.offset < 0 or spec.offset + spec.nbytes > self.slot_bytes:
                raise LayoutError(f"tensor {spec.name!r} at offset {spec.offset} does not fit the slot")
        self._check_fused()

    def _check_fused(self) -> None:
        table = self.by_name
        seen: set[str] = set()
        for group in self.fused:
            if group.name in table or group.name in seen:
                raise LayoutError(f"merged tensor {group.name!r} repeats a name of the weight table")
            seen.add(group.name)
            if len(group.parts) < 2:
                raise LayoutError(f"merged tensor {group.name!r} needs at least two parts")
            missing = [p for p in group.parts if p not in table]
            if missing:
                raise LayoutError(f"merged tensor {group.name!r}: parts {missing[:3]} are not in the table")
            taken = seen & set(group.parts)
            if taken or len(set(group.parts)) != len(group.parts):
                raise LayoutError(f"merged tensor {group.name!r}: a part belongs to one merged tensor only")
            seen.update(group.parts)
            specs = [table[p] for p in group.parts]
            first = specs[0]
            for before, spec in itertools.pairwise(specs):
                if (
                    spec.dtype != first.dtype
                    or len(spec.shape) < 1
                    or spec.shape[1:] != first.shape[1:]
                    or spec.offset != before.offset + before.nbytes
                ):
                    raise LayoutError(
                        f"merged tensor {group.name!r}: {spec.name!r} does not follow {before.name!r} "
                        "back to back with the same dtype and trailing shape"
                    )

    @classmethod
    def pack(
        cls, entries: Iterable[tuple[str, str, Iterable[int]]], fused: Iterable[FusedSpec] = ()
    ) -> WeightLayout:
        """Lay out `(name, dtype, shape)` entries back to back, each on a TENSOR_ALIGNMENT boundary,
        except that the parts of each merged tensor of `fused` (consecutive entries, in order)
        follow each other with no gap."""
        groups = tuple(fused)
        follows = {g.parts[i + 1]: g.parts[i] for g in groups for i in range(len(g.parts) - 1)}
        specs: list[TensorSpec] = []
        offset = 0
        previous = ""
        for name, dtype, shape in entries:
            spec = TensorSpec(name=name, dtype=dtype, shape=tuple(shape), offset=offset)
            if specs and follows.get(name) == previous:
                spec = attrs.evolve(spec, offset=specs[-1].offset + specs[-1].nbytes)
            else:
                spec = attrs.evolve(spec, offset=round_up(offset, TENSOR_ALIGNMENT))
            specs.append(spec)
            offset = spec.offset + spec.nbytes
            previous = name
        slot_bytes = max(REGION_ALIGNMENT, round_up(offset, REGION_ALIGNMENT))
        return cls(tensors=tuple(specs), slot_bytes=slot_bytes, fused=groups)

    def fused_spec(self, name: str) -> TensorSpec:
        """The merged tensor `name` as one spec: its first part's offset and dtype, the parts' rows
        summed. Raises LayoutError if the layout has no merged tensor of that name."""
        for group in self.fused:
            if group.name == name:
                table = self.by_name
                specs = [table[p] for p in group.parts]
                rows = sum(s.shape[0] for s in specs)
                first = specs[0]
                return TensorSpec(
                    name=name, dtype=first.dtype, shape=(rows, *first.shape[1:]), offset=first.offset
                )
        raise LayoutError(f"the weight layout has no merged tensor {name!r}")

    @property
    def region_bytes(self) -> int:
        """Bytes of the whole region: two slots."""
        return 2 * self.slot_bytes

    @property
    def by_name(self) -> dict[str, TensorSpec]:
        """The table as a dict."""
        return {t.name: t for t in self.tensors}

    def to_json(self) -> dict[str, Any]:
        """The wire form."""
        data: dict[str, Any] = {"slot_bytes": self.slot_bytes, "tensors": [t.to_json() for t in self.tensors]}
        if self.fused:
            data["fused"] = [g.to_json() for g in self.fused]
        return data

    @classmethod
    def from_json(cls, data: Any) -> WeightLayout:
        """Parse the wire (or layout-file) form; raises LayoutError on anything malformed."""
        try:
            tensors = [
                TensorSpec(
                    name=str(t["name"]), dtype=t["dtype"], shape=tuple(t["shape"]), offset=t.get("offset", -1)
                )
                for t in data["tensors"]
            ]
            slot_bytes = data.get("slot_bytes")
            fused = [
                FusedSpec(name=str(g["name"]), parts=[str(p) for p in g["parts"]])
                for g in data.get("fused", ())
            ]
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"malformed weight layout ({exc!r}); expected {{'tensors': [...]}}") from exc
        if slot_bytes is None or any(t.offset == -1 for t in tensors):
            # A layout file may list only names, dtypes and shapes: pack them.
            return cls.pack(((t.name, t.dtype, t.shape) for t in tensors), fused)
        return cls(tensors=tuple(tensors), slot_bytes=slot_bytes, fused=fused)


def _positive(_inst: object, attr: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{attr.name} must be a positive int, got {value!r}")


@attrs.frozen
class KVLayout:
    """A paged KV arena of shape (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim).

    A *block* is `block_size` token positions across all layers, keys and values: block `b` is
    `arena[:, :, b]`. Layer-major order keeps each layer's K and V caches contiguous.
    """

    num_blocks: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    block_size: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(default="bfloat16", validator=_check_dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the arena tensor."""
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes across all layers, K and V."""
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * DTYPE_SIZES[self.dtype]
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the arena tensor."""
        return self.num_blocks * self.block_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes of the region (the arena rounded up to REGION_ALIGNMENT)."""
        return round_up(self.nbytes, REGION_ALIGNMENT)

    def to_json(self) -> dict[str, Any]:
        """The wire form."""
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> KVLayout:
        """Parse the wire form; raises LayoutError on anything malformed."""
        try:
            return cls(**{f.name: data[f.name] for f in attrs.fields(cls)})
        except (KeyError, TypeError) as exc:
            raise LayoutError(f"malformed KV layout ({exc!r})") from exc
