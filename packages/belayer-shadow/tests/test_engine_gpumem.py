"""LLMEngine on real belayer-gpumem memory servers (host backend, separate processes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from belayer_gpumem import KVClient, ServerConfig, ServerProcess, WeightClient
from belayer_shadow import (
    LLMEngine,
    ModelConfig,
    SamplingParams,
    StepOutput,
    WeightsError,
    allocate_kv_arena,
    fill_weight_server,
    init_weights,
    kv_layout,
    save_safetensors,
    weight_layout,
)

CONFIG = ModelConfig.default()
NUM_BLOCKS, BLOCK_SIZE = 64, 8


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A weight server (empty table of CONFIG's layout) and a KV server, as real subprocesses."""
    run_dir = tmp_path / "run"
    layout_file = tmp_path / "layout.json"
    layout_file.write_text(json.dumps(weight_layout(CONFIG).to_json()))
    weights = ServerProcess.start(
        ServerConfig(kind="weights", socket=run_dir / "w.sock", layout_file=layout_file)
    )
    try:
        kv = ServerProcess.start(
            ServerConfig(
                kind="kv", socket=run_dir / "kv.sock", kv_layout=kv_layout(CONFIG, NUM_BLOCKS, BLOCK_SIZE)
            )
        )
    except BaseException:
        weights.stop()
        raise
    yield run_dir / "w.sock", run_dir / "kv.sock"
    kv.stop()
    weights.stop()


def add_requests(engine: LLMEngine) -> None:
    for i in range(6):
        prompt = [(11 * i + 5 * j) % 256 for j in range(4 + 2 * i)]
        params = (
            SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=i)
            if i % 2
            else (SamplingParams(max_tokens=16, temperature=0))
        )
        engine.add_request(f"r{i}", prompt, params)


def run(engine: LLMEngine) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def reference(weights: dict[str, torch.Tensor]) -> list[StepOutput]:
    engine = LLMEngine(CONFIG, weights, allocate_kv_arena(CONFIG, NUM_BLOCKS, BLOCK_SIZE))
    add_requests(engine)
    return run(engine)


def test_engine_on_memory_servers_matches_the_plain_dict_engine(servers: tuple[Path, Path]) -> None:
    weights_socket, kv_socket = servers
    weights = init_weights(CONFIG, seed=1)
    assert fill_weight_server(weights_socket, weights) == 1
    engine = LLMEngine.attach(CONFIG, weights_socket, kv_socket)
    try:
        # Zero copy: every parameter and the KV cache lie inside the mapped regions.
        assert engine.weight_client is not None
        assert engine.kv_client is not None
        region = engine.weight_client.region
        lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
        assert all(lo <= t.data_ptr() < hi for t in engine.weight_client.tensors().values())
        assert engine.model.embed.data_ptr() >= lo
        assert engine.model.embed.data_ptr() < hi
        # The server's layout packs q/k/v and gate/up back to back: stacked views, still zero copy.
        layer = engine.model.layers[0]
        assert layer.qkv_proj is not None
        assert layer.gate_up_proj is not None
        assert layer.qkv_proj.data_ptr() == layer.q_proj.data_ptr()
        k_cache = engine.runner.kv_caches[0][0]
        assert k_cache.data_ptr() == engine.kv_client.region.data_ptr()

        add_requests(engine)
        got = run(engine)
        assert _same(got, reference(weights))
        # The K/V really went to the KV server's memory: another client sees it.
        with KVClient.attach(kv_socket) as other:
            assert other.arena.abs().sum().item() > 0
    finally:
        engine.close()


def _same(a: list[StepOutput], b: list[StepOutput]) -> bool:
    assert [(o.request_id, o.index, o.token_id, o.finish_reason) for o in a] == [
        (o.request_id, o.index, o.token_id, o.finish_reason) for o in b
    ]
    assert [o.logprob for o in a] == pytest.approx([o.logprob for o in b], abs=1e-5)
    return True


def test_flush_kv_zeroes_the_server_arena_and_outputs_stay_identical(servers: tuple[Path, Path]) -> None:
    weights_socket, kv_socket = servers
    weights = init_weights(CONFIG, seed=2)
    fill_weight_server(weights_socket, weights)
    engine = LLMEngine.attach(CONFIG, weights_socket, kv_socket)
    try:
        add_requests(engine)
        head = [o for _ in range(5) for o in engine.step()]
        assert engine.kv_client is not None
        generation = engine.kv_client.generation
        engine.flush_kv()
        assert engine.kv_client.generation == generation + 1
        with KVClient.attach(kv_socket) as other:
            assert other.arena.abs().sum().item() == 0
        tail = run(engine)
        key = lambda o: (o.request_id, o.index)  # noqa: E731
        assert _same(sorted(head + tail, key=key), sorted(reference(weights), key=key))
    finally:
        engine.close()


def test_refresh_weights_follows_a_weight_update(servers: tuple[Path, Path]) -> None:
    weights_socket, kv_socket = servers
    old, new = init_weights(CONFIG, seed=3), init_weights(CONFIG, seed=4)
    fill_weight_server(weights_socket, old)
    engine = LLMEngine.attach(CONFIG, weights_socket, kv_socket)
    try:
        assert engine.refresh_weights() is False
        assert fill_weight_server(weights_socket, new) == 2
        assert engine.refresh_weights() is True
        add_requests(engine)
        assert _same(run(engine), reference(new))
    finally:
        engine.close()


def test_attach_refuses_an_empty_weight_server(servers: tuple[Path, Path]) -> None:
    weights_socket, kv_socket = servers
    with pytest.raises(WeightsError, match="fill it first"):
        LLMEngine.attach(CONFIG, weights_socket, kv_socket)


def test_fill_weight_server_rejects_weights_of_another_model(servers: tuple[Path, Path]) -> None:
    weights_socket, _ = servers
    weights = init_weights(CONFIG, seed=0)
    del weights["model.norm.weight"]
    with pytest.raises(WeightsError, match="missing"):
        fill_weight_server(weights_socket, weights)
    wrong = init_weights(CONFIG, seed=0)
    wrong["model.norm.weight"] = torch.ones(7)
    with pytest.raises(WeightsError, match="shape"):
        fill_weight_server(weights_socket, wrong)
    with WeightClient.attach(weights_socket) as client:
        assert client.version == 0  # nothing was published


def test_weight_server_started_from_a_safetensors_checkpoint(tmp_path: Path) -> None:
    weights = init_weights(CONFIG, seed=5)
    path = tmp_path / "model.safetensors"
    save_safetensors(weights, path)
    run_dir = tmp_path / "run"
    with (
        ServerProcess.start(ServerConfig(kind="weights", socket=run_dir / "w.sock", safetensors=path)),
        ServerProcess.start(
            ServerConfig(
                kind="kv", socket=run_dir / "kv.sock", kv_layout=kv_layout(CONFIG, NUM_BLOCKS, BLOCK_SIZE)
            )
        ),
    ):
        engine = LLMEngine.attach(CONFIG, run_dir / "w.sock", run_dir / "kv.sock")
        try:
            add_requests(engine)
            assert _same(run(engine), reference(weights))
        finally:
            engine.close()


def test_every_weight_is_a_view_of_the_server_and_a_private_copy_is_caught(
    servers: tuple[Path, Path],
) -> None:
    weights_socket, kv_socket = servers
    fill_weight_server(weights_socket, init_weights(CONFIG, seed=3))
    engine = LLMEngine.attach(CONFIG, weights_socket, kv_socket)
    try:
        assert engine.weight_client is not None
        # The server holds each layer's q|k|v and gate|up as one merged region (weight_layout):
        # the engine's fused matmuls read exactly those views.
        merged = engine.weight_client.fused_tensors()
        assert len(merged) == 2 * CONFIG.num_hidden_layers
        for i, layer in enumerate(engine.model.layers):
            assert layer.qkv_proj is not None
            assert layer.gate_up_proj is not None
            assert (
                layer.qkv_proj.data_ptr() == merged[f"model.layers.{i}.self_attn.qkv_proj.weight"].data_ptr()
            )
            assert (
                layer.gate_up_proj.data_ptr()
                == merged[f"model.layers.{i}.mlp.gate_up_proj.weight"].data_ptr()
            )
        assert engine.private_weights() == []
        # A private copy of one weight (here: of a layer's q|k|v) is named.
        params = {**engine.weight_client.tensors(), **merged}
        name = "model.layers.1.self_attn.qkv_proj.weight"
        engine.bind_params({**params, name: params[name].clone()})
        assert engine.private_weights() == ["model.layers.1.qkv_proj"]
        name = "model.norm.weight"
        engine.bind_params({**params, name: params[name].clone()})
        assert engine.private_weights() == [name]
    finally:
        engine.close()
