"""Reading a safetensors file straight into a weight slot (no torch, no full copy in memory)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import attrs

from belayer_gpumem._errors import LayoutError
from belayer_gpumem._layout import DTYPE_SIZES, WeightLayout

__all__ = ["SafetensorsFile", "read_safetensors"]

_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_CHUNK_BYTES = 64 * 1024 * 1024


@attrs.frozen
class SafetensorsFile:
    """A parsed safetensors header: our packed layout plus where each tensor's bytes lie in the file."""

    path: Path
    layout: WeightLayout
    file_ranges: dict[str, tuple[int, int]]

    def copy_into(self, write: Callable[[int, memoryview], None]) -> None:
        """Stream every tensor's bytes to `write(slot_offset, chunk)` in bounded chunks."""
        with self.path.open("rb") as handle:
            for spec in self.layout.tensors:
                start, end = self.file_ranges[spec.name]
                handle.seek(start)
                done = 0
                while done < end - start:
                    chunk = handle.read(min(_CHUNK_BYTES, end - start - done))
                    if not chunk:
                        raise LayoutError(f"{self.path}: truncated data for tensor {spec.name!r}")
                    write(spec.offset + done, memoryview(chunk))
                    done += len(chunk)


def read_safetensors(path: str | Path) -> SafetensorsFile:
    """Parse the header of a safetensors file; raises LayoutError if it is malformed or unsupported."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise LayoutError(f"{path}: too short to be a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES:
                raise LayoutError(f"{path}: header of {header_len} bytes is implausibly large")
            header = json.loads(handle.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LayoutError(f"cannot read safetensors file {path}: {exc}") from exc
    if not isinstance(header, dict):
        raise LayoutError(f"{path}: header is not a JSON object")
    data_start = 8 + header_len
    entries: list[tuple[str, str, list[int]]] = []
    ranges: dict[str, tuple[int, int]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise LayoutError(f"{path}: tensor {name!r} has an unsupported or malformed entry") from exc
        nbytes = DTYPE_SIZES[dtype]
        for dim in shape:
            nbytes *= dim
        if end - begin != nbytes:
            raise LayoutError(f"{path}: tensor {name!r} has {end - begin} bytes, its shape needs {nbytes}")
        entries.append((name, dtype, shape))
        ranges[name] = (data_start + begin, data_start + end)
    return SafetensorsFile(path=path, layout=WeightLayout.pack(entries), file_ranges=ranges)
