"""The engine on CUDA (skipped without a GPU): same outputs as on the CPU, also on cuda memory servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from belayer_gpumem import ServerConfig, ServerProcess
from belayer_shadow import (
    LLMEngine,
    ModelConfig,
    SamplingParams,
    StepOutput,
    allocate_kv_arena,
    fill_weight_server,
    init_weights,
    kv_layout,
    weight_layout,
)

pytestmark = pytest.mark.gpu

CONFIG = ModelConfig.default()


def run(engine: LLMEngine) -> list[StepOutput]:
    for i in range(8):
        prompt = [(13 * i + 3 * j) % 256 for j in range(5 + 4 * i)]
        params = SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, top_p=0.9, seed=i)
        engine.add_request(f"r{i}", prompt, params)
    outputs: list[StepOutput] = []
    while engine.has_unfinished():
        outputs += engine.step()
    return sorted(outputs, key=lambda o: (o.request_id, o.index))


def assert_close_outputs(got: list[StepOutput], expected: list[StepOutput]) -> None:
    # Different kernels round differently: allow rare late divergence in sampled requests only
    # by comparing the greedy requests exactly and every logprob loosely.
    greedy = {f"r{i}" for i in range(1, 8, 2)}
    assert [(o.request_id, o.index, o.token_id) for o in got if o.request_id in greedy] == [
        (o.request_id, o.index, o.token_id) for o in expected if o.request_id in greedy
    ]
    first = {o.request_id: o for o in got if o.index == 0}
    for o in expected:
        if o.index == 0:
            assert first[o.request_id].logprob == pytest.approx(o.logprob, abs=1e-3)


def test_cuda_engine_matches_the_cpu_engine() -> None:
    weights = init_weights(CONFIG, seed=0)
    cpu = run(LLMEngine(CONFIG, weights, allocate_kv_arena(CONFIG, 64, 16)))
    cuda_weights = {name: t.cuda() for name, t in weights.items()}
    engine = LLMEngine(CONFIG, cuda_weights, allocate_kv_arena(CONFIG, 64, 16, device="cuda"), device="cuda")
    assert_close_outputs(run(engine), cpu)


def test_cuda_engine_on_cuda_memory_servers(tmp_path: Path) -> None:
    weights = init_weights(CONFIG, seed=1)
    cpu = run(LLMEngine(CONFIG, weights, allocate_kv_arena(CONFIG, 64, 16)))
    layout_file = tmp_path / "layout.json"
    layout_file.write_text(json.dumps(weight_layout(CONFIG).to_json()))
    run_dir = tmp_path / "run"
    with (
        ServerProcess.start(
            ServerConfig(kind="weights", socket=run_dir / "w.sock", layout_file=layout_file, backend="cuda")
        ),
        ServerProcess.start(
            ServerConfig(
                kind="kv", socket=run_dir / "kv.sock", kv_layout=kv_layout(CONFIG, 64, 16), backend="cuda"
            )
        ),
    ):
        fill_weight_server(run_dir / "w.sock", weights)
        engine = LLMEngine.attach(CONFIG, run_dir / "w.sock", run_dir / "kv.sock")
        try:
            assert engine.device.type == "cuda"
            assert engine.model.embed.is_cuda
            assert_close_outputs(run(engine), cpu)
            engine.flush_kv()
        finally:
            engine.close()
