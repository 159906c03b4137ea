"""Bad input gets a typed error from the BelayerShadowError hierarchy that says what to do."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from belayer_shadow import (
    BelayerShadowError,
    InvalidSamplingParamsError,
    LLMEngine,
    LLMEngineError,
    ModelConfig,
    RequestError,
    SamplingParams,
    WeightsError,
    allocate_kv_arena,
    init_weights,
    load_safetensors,
)

CONFIG = ModelConfig.default()
WEIGHTS = init_weights(CONFIG, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 4, "temperature": -0.1}, "temperature"),
        ({"max_tokens": 4, "temperature": float("nan")}, "temperature"),
        ({"max_tokens": 4, "temperature": "hot"}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"max_tokens": 4, "seed": -1}, "seed"),
        ({"max_tokens": 4, "seed": 2**64}, "seed"),
        ({"max_tokens": 4, "seed": "7"}, "seed"),
        ({"max_tokens": 4, "stop_token_ids": [-3]}, "stop_token_ids"),
        ({"max_tokens": 4, "stop_token_ids": 5}, "stop_token_ids"),
        ({"max_tokens": 4, "generated_token_ids": [1, "x"]}, "generated_token_ids"),
    ],
)
def test_bad_sampling_params_raise_a_typed_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, BelayerShadowError)
    assert isinstance(info.value, ValueError)


def test_sampling_params_normalise_token_id_lists() -> None:
    params = SamplingParams(max_tokens=3, stop_token_ids=[1, 2], generated_token_ids=[4])  # type: ignore[arg-type]
    assert params.stop_token_ids == (1, 2)
    assert params.generated_token_ids == (4,)
    assert SamplingParams(max_tokens=1, temperature=0).greedy


def engine(num_blocks: int = 8, block_size: int = 4, **kwargs: Any) -> LLMEngine:
    return LLMEngine(CONFIG, WEIGHTS, allocate_kv_arena(CONFIG, num_blocks, block_size), **kwargs)


@pytest.mark.parametrize(
    ("request_id", "prompt", "params", "message"),
    [
        ("", [1], SamplingParams(max_tokens=1), "request_id"),
        ("a", [], SamplingParams(max_tokens=1), "empty"),
        ("a", [1, 512], SamplingParams(max_tokens=1), "token ids"),
        ("a", [1, -1], SamplingParams(max_tokens=1), "token ids"),
        ("a", [1], SamplingParams(max_tokens=1, generated_token_ids=(600,)), "token ids"),
        ("a", [1], {"max_tokens": 1}, "SamplingParams"),
        ("a", [1] * 20, SamplingParams(max_tokens=20), "KV blocks"),
        ("a", [1] * 70, SamplingParams(max_tokens=1), "max_model_len"),
    ],
)
def test_bad_requests_raise_request_error(
    request_id: str, prompt: list[int], params: Any, message: str
) -> None:
    e = engine(max_model_len=64)
    with pytest.raises(RequestError, match=message):
        e.add_request(request_id, prompt, params)
    assert not e.has_unfinished()


def test_duplicate_request_id_and_token_budget() -> None:
    e = engine(num_blocks=64, max_num_batched_tokens=16)
    e.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="already running"):
        e.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(RequestError, match="max_num_batched_tokens"):
        e.add_request("b", [1] * 17, SamplingParams(max_tokens=2))


def test_arena_and_weights_that_do_not_fit_the_model() -> None:
    with pytest.raises(LLMEngineError, match="does not fit"):
        LLMEngine(CONFIG, WEIGHTS, torch.zeros(2, 2, 4, 4, 2, 32))
    with pytest.raises(LLMEngineError, match="float32"):
        LLMEngine(CONFIG, WEIGHTS, allocate_kv_arena(CONFIG, 4, 4).half())
    missing = dict(WEIGHTS)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightsError, match="missing"):
        LLMEngine(CONFIG, missing, allocate_kv_arena(CONFIG, 4, 4))
    wrong = dict(WEIGHTS) | {"model.norm.weight": torch.ones(3)}
    with pytest.raises(WeightsError, match="shape"):
        LLMEngine(CONFIG, wrong, allocate_kv_arena(CONFIG, 4, 4))
    extra = dict(WEIGHTS) | {"model.extra.weight": torch.ones(3)}
    with pytest.raises(WeightsError, match="unexpected"):
        LLMEngine(CONFIG, extra, allocate_kv_arena(CONFIG, 4, 4))
    half = {k: v.half() for k, v in WEIGHTS.items()}
    with pytest.raises(WeightsError, match="float32"):
        LLMEngine(CONFIG, half, allocate_kv_arena(CONFIG, 4, 4))


def test_load_safetensors_of_a_missing_or_broken_file(tmp_path: Any) -> None:
    with pytest.raises(WeightsError, match="no safetensors"):
        load_safetensors(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match="cannot read"):
        load_safetensors(bad)
