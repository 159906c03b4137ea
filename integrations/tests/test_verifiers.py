"""verifiers' own multi-turn environment code (verifiers 0.3.1, `verifiers.legacy`) rolling out
through `belayer-shadow serve`'s chat route, with weights loaded by folder between two rollouts.

The environment is a `MultiTurnEnv` whose `env_response` answers every model turn with a new user
message (three model turns, `max_turns`); `env.rollout` gets a `ClientConfig` (verifiers'
`OpenAIChatCompletionsClient`, the service's `/v1` as `api_base_url`, `X-Session-ID` from the
rollout's `trajectory_id`) and sends each turn to `/v1/chat/completions` with `logprobs`. verifiers
keeps a turn's token ids for training only when the answer carries `prompt_token_ids` at its top
level and `token_ids` and `logprobs.content` on its choice (vLLM's `return_token_ids` answer).
Between the two rollouts the trainer's step is a `save_pretrained` folder loaded with `POST
/update_weights {"weight_dir"}` (prime-rl's route).

Checked: each rollout stops at `max_turns_reached` after three turns, each with its prompt and
completion token ids and one logprob per completion token; each turn's prompt holds the one before
it and the environment's message; the version went 0 -> 1; the logprobs are those of the weights
served at the time (transformers on the same tokens: the initial folder before the load, the
loaded folder after it, and not the initial one after it).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import belayer_serve, policy_logprobs, write_model_folder

pytestmark = [pytest.mark.timeout(600)]

MODEL = "verifiers-policy"
TURNS = 3


def _environment() -> Any:
    import verifiers.legacy as vf
    from datasets import Dataset

    class CountingGame(vf.MultiTurnEnv):  # type: ignore[misc]
        """Each model turn is answered with the next number to continue from."""

        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            return [vf.UserMessage(content=f"Go on from {len(state['trajectory']) + 1}.")]

    def answered(completion: Any, **kwargs: Any) -> float:
        return float(len(completion) > 0)

    dataset = Dataset.from_dict({"question": ["Count with me, one number a turn."], "answer": ["3"]})
    return CountingGame(dataset=dataset, rubric=vf.Rubric(funcs=[answered]), max_turns=TURNS)


async def _rollout(env: Any, url: str) -> Any:
    import verifiers.legacy as vf

    config = vf.ClientConfig(
        api_base_url=f"{url}/v1",
        api_key_var="BELAYER_TEST_KEY",
        extra_headers_from_state={"X-Session-ID": "trajectory_id"},  # one slot per rollout
        max_retries=0,
    )
    rollout_input = env.get_dataset(n=1)[0]  # the row as verifiers formats it (prompt, example_id)
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 11, "logprobs": True}
    return await env.rollout(rollout_input, config, MODEL, sampling)


def _turns(state: Any) -> list[dict[str, Any]]:
    assert state.get("error") is None, state.get("error")
    assert state["stop_condition"] == "max_turns_reached"
    turns = []
    for step in state["trajectory"]:
        tokens = step["tokens"]
        assert tokens is not None, "the chat answer carried no token ids and logprobs"
        turns.append(
            {
                "prompt_ids": list(tokens["prompt_ids"]),
                "completion_ids": list(tokens["completion_ids"]),
                "logprobs": list(tokens["completion_logprobs"]),
            }
        )
    return turns


def _largest_gap(model: Any, turns: list[dict[str, Any]]) -> float:
    """The largest difference between the served logprobs and `model`'s on the same tokens."""
    gaps = []
    for turn in turns:
        own = policy_logprobs(model, turn["prompt_ids"], turn["completion_ids"])
        gaps += [abs(a - b) for a, b in zip(own, turn["logprobs"], strict=True)]
    return max(gaps)


def test_a_multi_turn_environment_rolls_out_before_and_after_a_weight_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    monkeypatch.setenv("BELAYER_TEST_KEY", "unused")  # the service takes no key
    folder = write_model_folder(tmp_path / "model", seed=0)
    step = write_model_folder(tmp_path / "step_1", seed=1)
    flags = ("--slots", "2", "--num-kv-blocks", "128", "--served-model-name", MODEL)
    env = _environment()
    with belayer_serve(folder, tmp_path / "serve", *flags) as ready:
        url = ready["url"]
        before = _turns(asyncio.run(_rollout(env, url)))
        with httpx.Client(base_url=url, timeout=300) as http:
            update = http.post("/update_weights", json={"weight_dir": str(step)})
            assert update.status_code == 200, update.text
            assert update.json()["version"] == 1
            after = _turns(asyncio.run(_rollout(env, url)))
            metrics = http.get("/metrics").text

    tokenizer = AutoTokenizer.from_pretrained(folder)
    for turns in (before, after):
        assert len(turns) == TURNS
        for turn in turns:
            assert len(turn["completion_ids"]) == len(turn["logprobs"]) >= 1
            assert all(math.isfinite(lp) and lp <= 0 for lp in turn["logprobs"])
        # One conversation: each turn's prompt starts with the one before and holds the
        # environment's answer to the turn before.
        for number, (earlier, later) in enumerate(itertools.pairwise(turns), start=2):
            assert later["prompt_ids"][: len(earlier["prompt_ids"])] == earlier["prompt_ids"]
            assert len(later["prompt_ids"]) > len(earlier["prompt_ids"]) + len(earlier["completion_ids"])
            assert f"Go on from {number}." in tokenizer.decode(later["prompt_ids"])
    assert before[0]["prompt_ids"] == after[0]["prompt_ids"]  # the same first prompt

    # Each rollout's logprobs are those of the weights served at the time.
    initial, loaded = Qwen3ForCausalLM.from_pretrained(folder), Qwen3ForCausalLM.from_pretrained(step)
    before_gap, after_gap = _largest_gap(initial, before), _largest_gap(loaded, after)
    stale_gap = _largest_gap(initial, after)
    print(f"served vs served weights: {before_gap:.2e} before, {after_gap:.2e} after the load")
    print(f"after the load vs the initial weights: {stale_gap:.2e}")
    assert before_gap < 0.02  # float32 kernels of two engines: not bit-equal
    assert after_gap < 0.02
    assert stale_gap > 10 * max(before_gap, after_gap)
    assert "belayer_router_required_weight_version 1" in metrics
    assert "belayer_router_weight_updates_total 1" in metrics
