"""LLMEngine on a plain dict of weights: paging, preemption, resume, flush, stop and length."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from belayer_shadow import (
    LLMEngine,
    ModelConfig,
    SamplingParams,
    StepOutput,
    allocate_kv_arena,
    init_weights,
)

CONFIG = ModelConfig.default()
WEIGHTS = init_weights(CONFIG, seed=0)
PROMPTS = {f"r{i}": [(7 * i + j * 13) % 256 for j in range(5 + 3 * i)] for i in range(8)}


def make_engine(num_blocks: int = 128, block_size: int = 8, **kwargs: Any) -> LLMEngine:
    return LLMEngine(CONFIG, WEIGHTS, allocate_kv_arena(CONFIG, num_blocks, block_size), **kwargs)


def run(engine: LLMEngine) -> dict[str, list[StepOutput]]:
    outputs: dict[str, list[StepOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens(outputs: dict[str, list[StepOutput]]) -> dict[str, list[int]]:
    return {rid: [o.token_id for o in outs] for rid, outs in outputs.items()}


def sampled(seed: int, max_tokens: int = 20, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.9, seed=seed, **kwargs)  # type: ignore[arg-type]


def test_paged_decode_equals_full_recompute() -> None:
    engine = make_engine(block_size=4)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0.0))
    paged = run(engine)
    # Full recompute: a fresh engine re-prefills prompt + everything generated for every token.
    for rid, prompt in PROMPTS.items():
        generated: list[int] = []
        for k in range(12):
            fresh = make_engine(block_size=4)
            fresh.add_request(
                rid,
                prompt,
                SamplingParams(max_tokens=1, temperature=0.0, generated_token_ids=tuple(generated)),
            )
            (out,) = fresh.step()
            assert out.index == k
            assert out.token_id == paged[rid][k].token_id
            assert out.logprob == pytest.approx(paged[rid][k].logprob, abs=1e-4)
            generated.append(out.token_id)


def test_batched_decode_equals_one_request_at_a_time() -> None:
    engine = make_engine()
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        engine.add_request(rid, prompt, sampled(seed=i))
    together = tokens(run(engine))
    for i, (rid, prompt) in enumerate(PROMPTS.items()):
        alone = make_engine()
        alone.add_request(rid, prompt, sampled(seed=i))
        assert tokens(run(alone))[rid] == together[rid]


def test_preemption_keeps_outputs_identical() -> None:
    roomy = make_engine(num_blocks=128, block_size=4)
    tight = make_engine(num_blocks=24, block_size=4)
    for engine in (roomy, tight):
        for i, (rid, prompt) in enumerate(PROMPTS.items()):
            params = (
                sampled(seed=100 + i, max_tokens=30)
                if i % 2
                else SamplingParams(max_tokens=30, temperature=0)
            )
            engine.add_request(rid, prompt, params)
    expected, got = run(roomy), run(tight)
    assert roomy.num_preemptions == 0
    assert tight.num_preemptions > 0
    assert tokens(got) == tokens(expected)
    for rid in expected:
        assert [o.index for o in got[rid]] == list(range(30))
        assert [o.logprob for o in got[rid]] == pytest.approx([o.logprob for o in expected[rid]], abs=1e-4)
    assert tight.block_manager.num_free_blocks == 24


def test_resumed_request_continues_like_the_uninterrupted_one() -> None:
    prompt = PROMPTS["r3"]
    full = make_engine()
    full.add_request("x", prompt, sampled(seed=42, max_tokens=25))
    uninterrupted = run(full)["x"]
    assert len({o.token_id for o in uninterrupted}) > 3  # really sampled, not a constant

    first = make_engine()
    first.add_request("x", prompt, sampled(seed=42, max_tokens=25))
    head = [out for _ in range(9) for out in first.step()]
    first.abort("x")
    resumed = make_engine()
    done = [o.token_id for o in head]
    resumed.add_request("x", prompt, sampled(seed=42, max_tokens=25 - len(done), generated_token_ids=done))
    tail = run(resumed)["x"]
    assert [o.index for o in tail] == list(range(len(done), 25))
    assert [(o.token_id, o.finish_reason) for o in head + tail] == [
        (o.token_id, o.finish_reason) for o in uninterrupted
    ]

    other_seed = make_engine()
    other_seed.add_request("x", prompt, sampled(seed=43, max_tokens=25))
    assert tokens(run(other_seed))["x"] != [o.token_id for o in uninterrupted]


def test_flush_kv_then_continue_gives_identical_outputs() -> None:
    reference = make_engine()
    flushed = make_engine()
    for engine in (reference, flushed):
        for i, (rid, prompt) in enumerate(PROMPTS.items()):
            engine.add_request(rid, prompt, sampled(seed=i))
    before = [out for _ in range(6) for out in flushed.step()]
    flushed.flush_kv()
    # The flush really dropped the cache: zero it, so stale K/V could not be reused by accident.
    flushed.runner.kv_caches[0][0].zero_()
    assert flushed.block_manager.num_free_blocks == 128
    after = run(flushed)
    got: dict[str, list[int]] = {}
    for out in before + [o for outs in after.values() for o in outs]:
        got.setdefault(out.request_id, []).append(out.token_id)
    assert got == tokens(run(reference))


def test_stop_token_ends_the_request_and_is_returned() -> None:
    engine = make_engine()
    engine.add_request("g", PROMPTS["r1"], SamplingParams(max_tokens=10, temperature=0))
    free_run = tokens(run(engine))["g"]
    stop = free_run[4]
    first = free_run.index(stop)
    engine.add_request(
        "s", PROMPTS["r1"], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop,))
    )
    outs = run(engine)["s"]
    assert [o.token_id for o in outs] == free_run[: first + 1]
    assert [o.finish_reason for o in outs] == [None] * first + ["stop"]
    assert not engine.has_unfinished()


def test_max_tokens_and_max_model_len_end_with_length() -> None:
    engine = make_engine(max_model_len=12)
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    engine.add_request("capped", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=100, temperature=0))
    outs = run(engine)
    assert [o.finish_reason for o in outs["short"]] == [None] * 3 + ["length"]
    assert len(outs["capped"]) == 4
    assert outs["capped"][-1].finish_reason == "length"


def test_abort_frees_blocks_and_forgets_the_request() -> None:
    engine = make_engine(num_blocks=16, block_size=4)
    engine.add_request("a", PROMPTS["r5"], SamplingParams(max_tokens=30, temperature=0))
    engine.step()
    assert engine.block_manager.num_free_blocks < 16
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert engine.block_manager.num_free_blocks == 16
    assert not engine.has_unfinished()
    engine.add_request("a", PROMPTS["r5"], SamplingParams(max_tokens=2, temperature=0))  # id reusable
    assert len(run(engine)["a"]) == 2


def test_greedy_and_top_p_edge_cases_sample_the_argmax() -> None:
    engine = make_engine()
    engine.add_request("greedy", PROMPTS["r2"], SamplingParams(max_tokens=8, temperature=0))
    engine.add_request(
        "tiny-top-p", PROMPTS["r2"], SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-9, seed=1)
    )
    outs = tokens(run(engine))
    assert outs["greedy"] == outs["tiny-top-p"]


def test_sampling_frequencies_follow_the_distribution() -> None:
    # Over many seeds, the first sampled token's frequency matches its softmax probability.
    engine = make_engine(num_blocks=256)
    prompt = PROMPTS["r0"]
    for seed in range(400):
        engine.add_request(f"s{seed}", prompt, SamplingParams(max_tokens=1, temperature=1.5, seed=seed))
    outs = [o for outs in run(engine).values() for o in outs]
    counts: dict[int, int] = {}
    for o in outs:
        counts[o.token_id] = counts.get(o.token_id, 0) + 1
    top, n = max(counts.items(), key=lambda kv: kv[1])
    probability = torch.tensor(next(o.logprob for o in outs if o.token_id == top)).exp().item()
    assert len(counts) > 5
    assert abs(n / 400 - probability) < 4 * (probability * (1 - probability) / 400) ** 0.5 + 0.01


def test_warmup_touches_neither_the_arena_nor_running_requests() -> None:
    # A shadow warms up while the main worker serves from the same arena: warm-up must not write it.
    arena = allocate_kv_arena(CONFIG, 32, 8)
    engine = LLMEngine(CONFIG, WEIGHTS, arena)
    engine.add_request("a", PROMPTS["r4"], sampled(seed=5))
    head = engine.step()
    snapshot = arena.clone()
    free = engine.block_manager.num_free_blocks
    engine.warmup()
    assert torch.equal(arena, snapshot)
    assert engine.block_manager.num_free_blocks == free
    assert engine.has_unfinished()
    rest = run(engine)["a"]
    alone = make_engine()
    alone.add_request("a", PROMPTS["r4"], sampled(seed=5))
    assert [o.token_id for o in head + rest] == tokens(run(alone))["a"]
