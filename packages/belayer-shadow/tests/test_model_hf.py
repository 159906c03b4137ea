"""The engine's Qwen3 decoder against transformers' Qwen3ForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from belayer_shadow import LLMEngine, ModelConfig, SamplingParams, allocate_kv_arena, init_weights
from belayer_shadow._engine._block_manager import num_blocks_for
from belayer_shadow._engine._layers import AttentionMetadata
from belayer_shadow._engine._model import Qwen3Model

UNTIED = ModelConfig(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
)


def hf_model(config: ModelConfig, weights: dict[str, torch.Tensor]) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM(config.to_hf()).eval()
    state = dict(weights)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model  # type: ignore[no-any-return]  # transformers' eval() is untyped


def engine_logits(config: ModelConfig, weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Logits at every position from one prefill over a paged arena of 4-position blocks."""
    block_size = 4
    arena = allocate_kv_arena(config, num_blocks_for(len(tokens), block_size) + 3, block_size)
    model = Qwen3Model(config, weights, torch.device("cpu"))
    # Blocks deliberately out of order: the paging must not assume contiguity.
    table = list(reversed(range(arena.shape[2])))
    slots = [table[p // block_size] * block_size + p % block_size for p in range(len(tokens))]
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.tensor(slots), seq_lens=(len(tokens),))
    caches = [(arena[i, 0], arena[i, 1]) for i in range(config.num_hidden_layers)]
    ids = torch.tensor(tokens)
    with torch.inference_mode():
        return model.forward(ids, torch.arange(len(tokens)), caches, meta, torch.arange(len(tokens)))


@pytest.mark.parametrize("config", [ModelConfig.default(), UNTIED], ids=["default", "untied-3groups"])
def test_prefill_logits_match_transformers(config: ModelConfig) -> None:
    weights = init_weights(config, seed=3)
    tokens = torch.randint(0, config.vocab_size, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = engine_logits(config, weights, tokens)
    with torch.inference_mode():
        theirs = hf_model(config, weights)(torch.tensor([tokens])).logits[0]
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    # The check has teeth: a different init gives clearly different logits.
    other = engine_logits(config, init_weights(config, seed=4), tokens)
    assert (other - theirs).abs().max() > 0.1


def test_greedy_outputs_match_transformers_generate() -> None:
    config = ModelConfig.default()
    weights = init_weights(config, seed=11)
    model = hf_model(config, weights)
    prompts = [[5, 6, 7], list(range(40, 61)), [300, 2, 99, 17, 4, 4, 4, 8], [1]]
    max_tokens = 24
    engine = LLMEngine(config, weights, allocate_kv_arena(config, 64, 8))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    ours: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for out in engine.step():
            ours[out.request_id].append(out.token_id)
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert ours[f"r{i}"] == generated[0, len(prompt) :].tolist(), f"prompt {i}"
    # Not a degenerate model: the outputs differ between prompts.
    assert len({tuple(v) for v in ours.values()}) == len(prompts)


def test_greedy_logprobs_are_transformers_log_softmax() -> None:
    config = ModelConfig.default()
    weights = init_weights(config, seed=5)
    prompt = [10, 20, 30, 40]
    engine = LLMEngine(config, weights, allocate_kv_arena(config, 16, 8))
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = prompt + [o.token_id for o in outs]
    with torch.inference_mode():
        logits = hf_model(config, weights)(torch.tensor([tokens])).logits[0]
    expected = torch.log_softmax(logits, dim=-1)
    for k, out in enumerate(outs):
        position = len(prompt) - 1 + k
        assert out.index == k
        assert out.logprob == pytest.approx(expected[position, out.token_id].item(), abs=1e-4)


def test_stacked_projection_views_give_the_same_logits() -> None:
    # The weight server packs q/k/v (and gate/up) back to back; the model then multiplies once
    # through a stacked view. Lay a plain dict out the same way and compare with the unstacked run.
    config = ModelConfig.default()
    weights = init_weights(config, seed=8)
    names = list(weights)
    flat = torch.cat([weights[n].reshape(-1) for n in names])
    packed, offset = {}, 0
    for n in names:
        packed[n] = flat[offset : offset + weights[n].numel()].view(weights[n].shape)
        offset += weights[n].numel()
    stacked = Qwen3Model(config, packed, torch.device("cpu"))
    assert stacked.layers[0].qkv_proj is not None
    assert stacked.layers[0].gate_up_proj is not None
    assert Qwen3Model(config, weights, torch.device("cpu")).layers[0].qkv_proj is None
    tokens = list(range(3, 40))
    torch.testing.assert_close(
        engine_logits(config, packed, tokens), engine_logits(config, weights, tokens), atol=1e-5, rtol=1e-5
    )
