"""Publish checkpoint deltas in SkyRL's format (skyrl 0.4.0, ``weight_sync_backend="delta"``),
written here from its documented layout for the tests (integrations/tests/test_skyrl.py publishes
with SkyRL's own code): ``SYNC_DIR/delta-0000000N/manifest.json`` plus a safetensors payload file of
zstd-compressed XOR patches, one uint8 tensor per changed tensor, each with the checksum of its new
bytes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import xxhash
import zstandard
from safetensors.torch import save_file

PAYLOAD = "delta-rank00000-file000000.safetensors"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def publish_delta(
    sync_dir: Path,
    version: int,
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    checksum_algorithm: str = "xxh3-128",
) -> Path:
    """Write version ``version`` (``new``) as a delta against version - 1 (``old``); returns its
    folder. Unchanged tensors get no record, as SkyRL's publisher does."""
    folder = sync_dir / f"delta-{version:08d}"
    folder.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    payloads: dict[str, torch.Tensor] = {}
    for name, tensor in new.items():
        patch = torch.bitwise_xor(_bytes(tensor), _bytes(old[name]))
        if not bool(patch.any()):
            continue
        compressed = zstandard.ZstdCompressor(level=1).compress(patch.numpy().tobytes())
        payloads[name] = torch.frombuffer(bytearray(compressed), dtype=torch.uint8)
        data = _bytes(tensor).numpy().data
        checksum = (
            xxhash.xxh3_128(data).hexdigest()
            if checksum_algorithm == "xxh3-128"
            else hashlib.sha256(data).hexdigest()
        )
        records.append(
            {
                "name": name,
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "uncompressed_num_bytes": tensor.numel() * tensor.element_size(),
                "compressed_num_bytes": len(compressed),
                "payload_file": PAYLOAD,
                "payload_key": name,
                "checksum": checksum,
                "checksum_algorithm": checksum_algorithm,
            }
        )
    if payloads:
        save_file(payloads, str(folder / PAYLOAD))
    manifest = {
        "version": version,
        "base_version": version - 1,
        "tensors": records,
        "total_uncompressed_num_bytes": sum(r["uncompressed_num_bytes"] for r in records),
        "total_compressed_num_bytes": sum(r["compressed_num_bytes"] for r in records),
        "payload_files": [PAYLOAD] if payloads else [],
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def edit_manifest(folder: Path, change: Any) -> None:
    """Rewrite ``folder``'s manifest through ``change(manifest_dict)`` (in place)."""
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
