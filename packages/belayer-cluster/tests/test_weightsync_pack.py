"""Weight sync without Ray: the slot packing, its checksum and the typed errors of bad input."""

from __future__ import annotations

import pytest
import torch

from belayer_cluster import WeightSync, WeightSyncError
from belayer_cluster._weightsync_pack import checksum, pack, unpack
from belayer_gpumem import WeightLayout

LAYOUT = WeightLayout.pack(
    [("embed", "float32", (7, 3)), ("norm", "bfloat16", (5,)), ("head", "float16", (3, 2))]
)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {spec.name: torch.randn(spec.shape, generator=generator) for spec in LAYOUT.tensors}


def test_pack_lays_tensors_at_the_table_offsets_and_round_trips() -> None:
    source = tensors(0)
    flat = pack({**source, "lm_head.weight": torch.zeros(1)}, LAYOUT)  # extra names are ignored
    assert flat.dtype == torch.uint8
    assert flat.numel() == LAYOUT.slot_bytes
    views = unpack(flat, LAYOUT)
    for spec in LAYOUT.tensors:
        assert views[spec.name].dtype == getattr(torch, spec.dtype)
        assert torch.equal(views[spec.name], source[spec.name].to(views[spec.name].dtype))
    end = max(spec.offset + spec.nbytes for spec in LAYOUT.tensors)
    assert int(flat[end:].count_nonzero()) == 0  # padding is zero on every node


def test_checksum_sees_one_changed_byte_and_reused_buffers_give_the_same_bytes() -> None:
    first = pack(tensors(1), LAYOUT)
    again = pack(tensors(1), LAYOUT, out=pack(tensors(2), LAYOUT))
    assert checksum(first) == checksum(again)
    assert checksum(first).startswith("crc32:")
    first[3] ^= 1
    assert checksum(first) != checksum(again)


def test_missing_or_misshapen_tensors_and_a_wrong_buffer_are_typed_errors() -> None:
    source = tensors(3)
    with pytest.raises(WeightSyncError, match="lack 1 tensors"):
        pack({k: v for k, v in source.items() if k != "norm"}, LAYOUT)
    with pytest.raises(WeightSyncError, match="has shape"):
        pack({**source, "head": torch.zeros(2, 3)}, LAYOUT)
    with pytest.raises(WeightSyncError, match="uint8 bytes"):
        pack(source, LAYOUT, out=torch.zeros(8, dtype=torch.uint8))


def test_settings_and_an_update_without_nodes_are_typed_errors() -> None:
    with pytest.raises(WeightSyncError, match="must be > 0"):
        WeightSync(timeout_s=0)
    with pytest.raises(WeightSyncError, match="must be > 0"):
        WeightSync(chunk_bytes=0)
    sync = WeightSync(layout=LAYOUT)
    with pytest.raises(WeightSyncError, match="add_node first"):
        sync.update(tensors(4))
    with pytest.raises(WeightSyncError, match="not a member"):
        sync.drop_node("f" * 56)
    assert sync.status()["version"] == 0
    assert sync.metrics()["weights_nodes"] == 0.0
