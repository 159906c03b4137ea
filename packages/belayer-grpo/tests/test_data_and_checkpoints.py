"""Data sets, tokenizer, rewards, the resumable sampler, and checkpoints with resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from belayer_grpo._checkpointing import find_latest, load_checkpoint, save_checkpoint
from belayer_grpo._config import load_config
from belayer_grpo._data import (
    CharTokenizer,
    PromptSampler,
    extract_answer,
    generate_arithmetic,
    load_math_file,
    math_reward,
)
from belayer_grpo._errors import BelayerGrpoError, CheckpointError, DataError
from belayer_grpo._model import build_policy, engine_model_config
from belayer_grpo._rollout_math import Sample
from belayer_grpo._trainer import GRPOTrainer


def test_arithmetic_problems_are_complete_and_correct() -> None:
    problems = generate_arithmetic(["+", "*"], 0, 9, seed=3)
    assert len(problems) == 200
    assert len({p.problem_id for p in problems}) == 200
    by_id = {p.problem_id: p for p in problems}
    assert by_id["7+8"].prompt == "7+8="
    assert by_id["7+8"].answer == "15"
    assert by_id["6*7"].answer == "42"
    assert generate_arithmetic(["+"], 0, 9, seed=3) == generate_arithmetic(["+"], 0, 9, seed=3)


def test_char_tokenizer_round_trip_and_errors() -> None:
    tok = CharTokenizer()
    ids = tok.encode_prompt("12+3=")
    assert ids[0] == tok.bos_token_id
    assert tok.decode([*ids, tok.eos_token_id]) == "12+3="
    with pytest.raises(DataError, match="alphabet"):
        tok.encode("x")


def test_rewards() -> None:
    assert math_reward("15", "15") == 1.0
    assert math_reward("16", "15") == 0.0
    assert math_reward("so\nAnswer: 15.0", "15") == 1.0
    assert extract_answer("we get \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert math_reward("", "0") == 0.0


def test_dapo_math_jsonl_and_parquet(tmp_path: Path) -> None:
    records = [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "reward_model": {"ground_truth": "4"},
         "extra_info": {"index": "a"}},
        {"prompt": "What is 3*3?", "answer": 9},
    ]  # fmt: skip
    jsonl = tmp_path / "math.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    problems = load_math_file(jsonl)
    assert [(p.problem_id, p.prompt, p.answer) for p in problems] == [
        ("a", "What is 2+2?", "4"),
        ("1", "What is 3*3?", "9"),
    ]
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1?", "answer": "2"}]), parquet)
    assert load_math_file(parquet)[0].answer == "2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no answer"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: no answer"):
        load_math_file(bad)
    with pytest.raises(DataError, match="no such data file"):
        load_math_file(tmp_path / "missing.jsonl")


def test_sampler_resumes_exactly() -> None:
    problems = generate_arithmetic(["+"], 0, 4, seed=0)
    first = PromptSampler(problems, seed=1)
    first.next_batch(17)
    state = first.state_dict()
    expected = first.next_batch(20)
    second = PromptSampler(problems, seed=1)
    second.load_state_dict(state)
    assert second.next_batch(20) == expected
    with pytest.raises(CheckpointError, match="same data"):
        PromptSampler(problems[:5], seed=1).load_state_dict(state)


def _samples() -> list[Sample]:
    tok = CharTokenizer()
    out = []
    for group, (prompt, answers) in enumerate([("1+1=", ["2", "3"]), ("2+2=", ["4", "5"])]):
        for answer in answers:
            ids = [*tok.encode(answer), tok.eos_token_id]
            reward = 1.0 if answer in ("2", "4") else 0.0
            out.append(
                Sample(
                    group, tok.encode_prompt(prompt), ids, [0.0] * len(ids), [1] * len(ids), reward, "stop"
                )
            )
    return out


def test_update_raises_the_likelihood_of_rewarded_samples_and_checkpoints_resume(tmp_path: Path) -> None:
    config = load_config(None, ["algorithm.num_minibatches=1", "algorithm.learning_rate=0.01"])
    model_config = engine_model_config(config.model, CharTokenizer())
    trainer = GRPOTrainer(build_policy(model_config, seed=0), config.algorithm, group_size=2)
    samples = _samples()
    before = trainer._logprobs(trainer.model, samples)[0].sum(dim=1)
    result = trainer.update(samples)
    after = trainer._logprobs(trainer.model, samples)[0].sum(dim=1)
    assert result.num_tokens == 8
    assert result.num_zero_signal_groups == 0
    assert bool(after[0] > before[0])
    assert bool(after[2] > before[2])
    assert bool(after[1] < before[1])
    assert bool(after[3] < before[3])
    # Checkpoint, then resume into a fresh trainer: the same next update.
    path = save_checkpoint(tmp_path, 1, {**trainer.state_dict(), "sampler": {}})
    assert find_latest(tmp_path) == path
    resumed = GRPOTrainer(build_policy(model_config, seed=5), config.algorithm, group_size=2)
    resumed.load_state_dict(load_checkpoint(path))
    trainer.update(samples)
    resumed.update(samples)
    for (name, a), b in zip(
        trainer.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name
    (tmp_path / "step_000009.pt").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_checkpoint(tmp_path / "step_000009.pt")


def test_a_resumed_run_uses_the_same_kl_reference_as_an_uninterrupted_one(tmp_path: Path) -> None:
    # KL on (beta > 0); the reference is the policy after a warm-up, which a resumed run skips:
    # it rebuilds the model from the seed, so only the checkpoint can give it the same reference.
    config = load_config(
        None, ["algorithm.num_minibatches=1", "algorithm.learning_rate=0.01", "algorithm.beta=0.5"]
    )
    model_config = engine_model_config(config.model, CharTokenizer())
    samples = _samples()

    def warmed_up() -> torch.nn.Module:
        model = build_policy(model_config, seed=0)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.mul_(1.5)  # stands in for the supervised warm-up
        return model

    uninterrupted = GRPOTrainer(warmed_up(), config.algorithm, group_size=2)
    interrupted = GRPOTrainer(warmed_up(), config.algorithm, group_size=2)
    uninterrupted.update(samples)
    interrupted.update(samples)
    path = save_checkpoint(tmp_path, 1, {**interrupted.state_dict(), "sampler": {}})
    resumed = GRPOTrainer(build_policy(model_config, seed=0), config.algorithm, group_size=2)
    resumed.load_state_dict(load_checkpoint(path))
    for _ in range(2):
        expected = uninterrupted.update(samples)
        got = resumed.update(samples)
        assert got.kl == pytest.approx(expected.kl, rel=1e-5, abs=1e-7)
        assert got.loss == pytest.approx(expected.loss, rel=1e-5, abs=1e-7)
    assert expected.kl > 0
    for (name, a), b in zip(
        uninterrupted.model.state_dict().items(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name
    # A checkpoint without a reference cannot silently resume a KL run with the wrong one.
    state = load_checkpoint(path)
    state["reference"] = None
    with pytest.raises(CheckpointError, match="no KL reference"):
        GRPOTrainer(build_policy(model_config, seed=0), config.algorithm, group_size=2).load_state_dict(state)


def test_a_batch_without_signal_leaves_the_weights_alone_despite_adam_momentum() -> None:
    config = load_config(None, ["algorithm.num_minibatches=1", "algorithm.learning_rate=0.01"])
    model_config = engine_model_config(config.model, CharTokenizer())
    trainer = GRPOTrainer(build_policy(model_config, seed=0), config.algorithm, group_size=2)
    trainer.update(_samples())  # a real step: Adam now carries momentum
    flat = [attrs_evolve_reward(s, 1.0) for s in _samples()]  # every group scored alike
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = trainer.update(flat)
    assert result.num_zero_signal_groups == 2
    for old, new in zip(before, trainer.model.parameters(), strict=True):
        assert torch.equal(old, new)


def attrs_evolve_reward(sample: Sample, reward: float) -> Sample:
    import attrs

    return attrs.evolve(sample, reward=reward)


def test_update_takes_a_batch_with_fewer_groups_and_refuses_a_partial_group() -> None:
    """Dropped groups leave fewer whole groups than a full step (4 minibatches of 4 samples
    planned, 1 group of 2 left): the update takes them; a group missing a sample is refused."""
    config = load_config(None, ["algorithm.num_minibatches=4", "algorithm.learning_rate=0.01"])
    model_config = engine_model_config(config.model, CharTokenizer())
    trainer = GRPOTrainer(build_policy(model_config, seed=0), config.algorithm, group_size=2)
    samples = _samples()
    before = trainer._logprobs(trainer.model, samples[:2])[0].sum(dim=1)
    result = trainer.update(samples[:2])  # group 0 alone
    after = trainer._logprobs(trainer.model, samples[:2])[0].sum(dim=1)
    assert result.num_tokens == 4
    assert bool(after[0] - after[1] > before[0] - before[1])  # the rewarded answer gained on the other
    with pytest.raises(BelayerGrpoError, match="whole groups of 2 samples, got 3"):
        trainer.update(samples[:3])
