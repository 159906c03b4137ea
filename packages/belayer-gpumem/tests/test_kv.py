"""KV server with the host backend."""

from __future__ import annotations

import pytest
from conftest import KV_LAYOUT, resident_bytes, run_worker

from belayer_gpumem import KVClient, RemoteError, ServerProcess, WeightClient


def test_arena_layout_and_cross_process_writes(kv_server: ServerProcess) -> None:
    socket = str(kv_server.config.socket)
    with KVClient.attach(socket) as kv:
        assert kv.arena.shape == KV_LAYOUT.shape
        assert str(kv.arena.dtype) == "torch.float16"
        k_cache, v_cache = kv.layer(1)
        assert k_cache.shape == (KV_LAYOUT.num_blocks, KV_LAYOUT.block_size, KV_LAYOUT.num_kv_heads, 8)
        assert k_cache.is_contiguous()
        assert v_cache.is_contiguous()
        assert float(kv.arena.abs().sum()) == 0
        run_worker("kv-write", socket, "3", "2.0")
        per_block = KV_LAYOUT.block_bytes // 2  # float16 elements per block
        assert float(kv.arena[:, :, 3].double().sum()) == 2.0 * per_block
        assert float(kv.arena[:, :, 4].double().sum()) == 0
        kv.arena[:, :, 5].fill_(1.0)
    assert f"BLOCK {float(per_block)} GENERATION 0" in run_worker("kv-read", socket, "5")


def test_flush_zeroes_the_arena_for_everyone_and_bumps_the_generation(kv_server: ServerProcess) -> None:
    socket = str(kv_server.config.socket)
    run_worker("kv-write", socket, "0", "5.0")
    with KVClient.attach(socket) as a, KVClient.attach(socket, populate=True) as b:
        assert float(b.arena.double().sum()) > 0
        assert a.flush() == 1
        assert float(b.arena.double().sum()) == 0
        assert b.describe()["generation"] == 1
    assert "BLOCK 0.0 GENERATION 1" in run_worker("kv-read", socket, "0")


def test_populate_maps_every_page_at_attach(kv_server: ServerProcess) -> None:
    socket = kv_server.config.socket
    with KVClient.attach(socket) as lazy, KVClient.attach(socket, populate=True) as eager:
        region_bytes = KV_LAYOUT.region_bytes
        # Nobody has touched the arena: a lazy mapping has no page of it yet, a populated one all.
        assert resident_bytes(lazy.region.data_ptr()) < region_bytes // 4
        assert resident_bytes(eager.region.data_ptr()) >= region_bytes


def test_ops_of_the_other_kind_are_refused(kv_server: ServerProcess) -> None:
    with KVClient.attach(kv_server.config.socket) as kv:
        with pytest.raises(RemoteError, match="wrong_kind"):
            kv._att.conn.request("update_begin")
        assert kv.ping()["kind"] == "kv"
    with pytest.raises(Exception, match="serves 'kv'"):
        WeightClient.attach(kv_server.config.socket)
