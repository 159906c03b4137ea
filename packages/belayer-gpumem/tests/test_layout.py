"""Pure layout, protocol and slot bookkeeping: fast, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")  # a GPU machine may lack it; these tests are CPU-only anyway

import itertools

from hypothesis import given
from hypothesis import strategies as st

from belayer_gpumem import FusedSpec, KVLayout, LayoutError, ProtocolError, WeightLayout
from belayer_gpumem._double_buffer import DoubleBufferConflictError, WeightDoubleBuffer
from belayer_gpumem._layout import DTYPE_SIZES, REGION_ALIGNMENT, TENSOR_ALIGNMENT
from belayer_gpumem._protocol import decode_body, encode_frame, validate_request

entries = st.lists(
    st.tuples(
        st.sampled_from(sorted(DTYPE_SIZES)), st.lists(st.integers(min_value=0, max_value=40), max_size=3)
    ),
    max_size=12,
)


@given(entries)
def test_pack_aligns_and_never_overlaps(raw: list[tuple[str, list[int]]]) -> None:
    layout = WeightLayout.pack((f"t{i}", dtype, shape) for i, (dtype, shape) in enumerate(raw))
    assert layout.slot_bytes % REGION_ALIGNMENT == 0
    spans = sorted((t.offset, t.offset + t.nbytes) for t in layout.tensors)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    for spec in layout.tensors:
        assert spec.offset % TENSOR_ALIGNMENT == 0
        assert spec.offset + spec.nbytes <= layout.slot_bytes
    assert WeightLayout.from_json(layout.to_json()) == layout


def test_layout_file_without_offsets_is_packed() -> None:
    layout = WeightLayout.from_json({"tensors": [{"name": "w", "dtype": "float16", "shape": [3, 5]}]})
    assert layout.by_name["w"].nbytes == 30
    assert layout.region_bytes == 2 * REGION_ALIGNMENT


def test_merged_parts_lie_back_to_back_and_read_as_one_tensor() -> None:
    # bf16 parts of 3 x 5 elements (30 bytes each): no part but the first on a 256-byte boundary.
    entries = [("norm", "float32", [5]), ("q", "bfloat16", [3, 5]), ("k", "bfloat16", [2, 5])]
    entries += [("v", "bfloat16", [2, 5]), ("o", "bfloat16", [5, 3])]
    layout = WeightLayout.pack(entries, [FusedSpec("qkv", ["q", "k", "v"])])
    table = layout.by_name
    assert table["q"].offset % TENSOR_ALIGNMENT == 0
    assert table["k"].offset == table["q"].offset + 30
    assert table["v"].offset == table["k"].offset + 20
    assert table["o"].offset % TENSOR_ALIGNMENT == 0
    assert table["o"].offset >= table["v"].offset + 20
    merged = layout.fused_spec("qkv")
    assert (merged.offset, merged.shape, merged.dtype) == (table["q"].offset, (7, 5), "bfloat16")
    assert WeightLayout.from_json(layout.to_json()) == layout
    # A layout file without offsets keeps its merged tensors too.
    listed = {"tensors": [{"name": n, "dtype": d, "shape": s} for n, d, s in entries]}
    listed["fused"] = [{"name": "qkv", "parts": ["q", "k", "v"]}]
    assert WeightLayout.from_json(listed) == layout
    with pytest.raises(LayoutError, match="no merged tensor"):
        layout.fused_spec("gate_up")


@pytest.mark.parametrize(
    ("fused", "error"),
    [
        ([{"name": "qkv", "parts": ["q", "x"]}], "not in the table"),
        ([{"name": "qkv", "parts": ["q"]}], "at least two parts"),
        ([{"name": "q", "parts": ["k", "v"]}], "repeats a name"),
        ([{"name": "a", "parts": ["q", "k"]}, {"name": "b", "parts": ["k", "v"]}], "one merged tensor only"),
        ([{"name": "qo", "parts": ["q", "o"]}], "back to back"),  # o is not right after q
        ([{"name": "qv", "parts": ["q", "v"]}], "back to back"),  # k lies between them
    ],
)
def test_bad_merged_tensors_raise_layout_error(fused: list[dict[str, object]], error: str) -> None:
    # 256 bytes each: q, k, v and o lie back to back.
    data = WeightLayout.pack([(name, "float32", [8, 8]) for name in ("q", "k", "v", "o")])
    with pytest.raises(LayoutError, match=error):
        WeightLayout.from_json({**data.to_json(), "fused": fused})


@pytest.mark.parametrize(
    "bad",
    [
        {"tensors": [{"name": "w", "dtype": "complex64", "shape": [1]}]},
        {"tensors": [{"name": "w", "dtype": "float32", "shape": [-1]}]},
        {"tensors": [{"name": "w", "dtype": "float32"}]},
        {
            "tensors": [{"name": "w", "dtype": "float32", "shape": [4], "offset": 0}] * 2,
            "slot_bytes": REGION_ALIGNMENT,
        },
        {
            "tensors": [{"name": "w", "dtype": "float32", "shape": [4], "offset": 100}],
            "slot_bytes": REGION_ALIGNMENT,
        },
        {"tables": []},
        {
            "tensors": [{"name": "w", "dtype": "float32", "shape": [4], "offset": "0"}],
            "slot_bytes": REGION_ALIGNMENT,
        },
        {"tensors": [{"name": "w", "dtype": "float32", "shape": [4], "offset": 0}], "slot_bytes": "2MiB"},
        {"tensors": [{"name": "w", "dtype": "float32", "shape": [4], "offset": 0}], "slot_bytes": 2.0**21},
    ],
)
def test_bad_weight_layouts_raise_layout_error(bad: object) -> None:
    with pytest.raises(LayoutError):
        WeightLayout.from_json(bad)


def test_kv_layout_shape_and_sizes() -> None:
    kv = KVLayout(num_blocks=10, num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    assert kv.shape == (3, 2, 10, 16, 2, 64)
    assert kv.block_bytes == 3 * 2 * 16 * 2 * 64 * 2
    assert kv.nbytes == 10 * kv.block_bytes
    assert kv.region_bytes % REGION_ALIGNMENT == 0
    assert KVLayout.from_json(kv.to_json()) == kv
    with pytest.raises(LayoutError):
        KVLayout(num_blocks=0, num_layers=1, block_size=1, num_kv_heads=1, head_dim=1)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({}, "needs a string field 'op'"),
        ({"op": 3}, "needs a string field 'op'"),
        ({"op": "explode"}, "unknown op"),
        ({"op": "ping", "extra": 1}, "takes no field"),
        ({"op": "update_begin", "copy_current": "yes"}, "wrong type"),
        ({"op": "update_begin", "timeout_s": True}, "wrong type"),
    ],
)
def test_schema_refuses_bad_requests(message: dict[str, object], error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        validate_request(message)


def test_frames_round_trip_and_reject_non_objects() -> None:
    frame = encode_frame({"op": "update_begin", "copy_current": True, "timeout_s": 1.5})
    assert validate_request(decode_body(frame[4:])) == "update_begin"
    for body in (b"[1, 2]", b"\xff\xfe", b"{nope"):
        with pytest.raises(ProtocolError):
            decode_body(body)


def test_slots_writer_never_gets_a_pinned_slot() -> None:
    buffer = WeightDoubleBuffer()
    assert buffer.pin(1) == (0, 0)
    slot = buffer.begin(2)
    assert slot == 1
    with pytest.raises(DoubleBufferConflictError, match="already updating"):
        buffer.begin(3)
    assert buffer.pin(3) == (0, 0)  # new readers keep getting the live slot during an update
    assert buffer.commit(2) == 1
    assert buffer.active_slot == 1
    with pytest.raises(DoubleBufferConflictError, match="must call refresh"):
        buffer.begin(2)  # readers 1 and 3 still pin slot 0
    buffer.pin(1)
    buffer.disconnect(3)
    assert buffer.begin(2) == 0
    buffer.disconnect(2)  # a dead writer's update is dropped, never published
    assert (buffer.version, buffer.active_slot, buffer.writer) == (1, 1, None)


@given(
    st.lists(
        st.tuples(st.sampled_from(["pin", "unpin", "begin", "commit", "abort", "gone"]), st.integers(0, 3))
    )
)
def test_slots_invariants_hold_under_any_sequence(ops: list[tuple[str, int]]) -> None:
    buffer = WeightDoubleBuffer()
    last_version = 0
    for op, conn in ops:
        try:
            if op == "pin":
                buffer.pin(conn)
            elif op == "unpin":
                buffer.unpin(conn)
            elif op == "begin":
                buffer.begin(conn)
            elif op == "commit":
                buffer.commit(conn)
            elif op == "abort":
                buffer.abort(conn)
            else:
                buffer.disconnect(conn)
        except DoubleBufferConflictError:
            pass
        if buffer.writer is not None:
            assert buffer.readers_of(buffer.inactive_slot) == 0
        assert buffer.version >= last_version
        last_version = buffer.version
