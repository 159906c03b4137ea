"""Math rollouts: one turn per sample through the router, rewarded against the verifiable answer."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import anyio
import attrs

from belayer_grpo._config import RolloutConfig
from belayer_grpo._data import PolicyTokenizer, Problem, math_reward
from belayer_grpo._errors import RolloutError
from belayer_router import RouterClient

__all__ = ["Sample", "greedy_accuracy", "run_math_rollouts"]


@attrs.frozen
class Sample:
    """One sampled completion of a GRPO group, as the trainer consumes it.

    ``logprobs`` are the rollout (behaviour) logprobs the router streamed, one per completion
    token; ``loss_mask`` is 1 where the policy generated the token (all of a math completion;
    tool observations in agentic trajectories are 0).
    """

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    reward: float
    finish_reason: str
    num_resumes: int = 0
    text: str = ""


async def run_math_rollouts(
    problems: Sequence[Problem],
    router: RouterClient,
    tokenizer: PolicyTokenizer,
    rollout: RolloutConfig,
    *,
    seed: int,
    on_sample: Callable[[int, Sample], None] | None = None,
    done: Mapping[int, Sample] | None = None,
    request_ids: Callable[[int], str] | None = None,
) -> list[Sample]:
    """``rollout.samples_per_prompt`` completions per problem, concurrently; groups in problem order.

    Each request gets its own seed (derived from ``seed`` and its index ``group * n + sample``),
    so a request the router resumes on another worker continues exactly as it would have.
    ``on_sample(index, sample)`` runs as each one finishes.  ``done`` (index -> sample, those a
    killed run had finished: `belayer_grpo._rollout_log`) are taken as they are, not generated.
    ``request_ids(index)``: each request's id at the router (a random one when None); the same id
    again re-attaches to what the router holds of it (`belayer_grpo._rollout_host`).
    """
    n = rollout.samples_per_prompt
    results: list[Sample | None] = [None] * (len(problems) * n)
    for index, sample in (done or {}).items():
        results[index] = sample
    limiter = anyio.CapacityLimiter(rollout.concurrency)
    stop = [tokenizer.eos_token_id]

    async def one(index: int) -> None:
        problem = problems[index // n]
        prompt_ids = tokenizer.encode_prompt(problem.prompt)
        async with limiter:
            try:
                completion = await router.generate(
                    prompt_ids,
                    rollout.max_tokens,
                    temperature=rollout.temperature,
                    top_p=rollout.top_p,
                    seed=seed * 1_000_003 + index,
                    stop_token_ids=stop,
                    request_id=None if request_ids is None else request_ids(index),
                )
            except Exception as error:
                raise RolloutError(
                    f"generation for problem {problem.problem_id!r} failed: {error}"
                ) from error
        text = tokenizer.decode(completion.token_ids)
        sample = Sample(
            group=index // n,
            prompt_ids=prompt_ids,
            completion_ids=list(completion.token_ids),
            logprobs=list(completion.logprobs),
            loss_mask=[1] * len(completion.token_ids),
            reward=math_reward(text, problem.answer),
            finish_reason=completion.finish_reason,
            num_resumes=completion.num_resumes,
            text=text,
        )
        results[index] = sample
        if on_sample is not None:
            on_sample(index, sample)

    async with anyio.create_task_group() as group:
        for index in range(len(results)):
            if results[index] is None:
                group.start_soon(one, index)
    return [sample for sample in results if sample is not None]


async def greedy_accuracy(
    problems: Sequence[Problem], router: RouterClient, tokenizer: PolicyTokenizer, rollout: RolloutConfig
) -> float:
    """The share of ``problems`` the served policy answers right when decoding greedily."""
    eos = [tokenizer.eos_token_id]
    rewards = [0.0] * len(problems)
    limiter = anyio.CapacityLimiter(rollout.concurrency)

    async def one(index: int) -> None:
        async with limiter:
            prompt = tokenizer.encode_prompt(problems[index].prompt)
            done = await router.generate(prompt, rollout.max_tokens, temperature=0.0, stop_token_ids=eos)
        rewards[index] = math_reward(tokenizer.decode(done.token_ids), problems[index].answer)

    async with anyio.create_task_group() as group:
        for index in range(len(problems)):
            group.start_soon(one, index)
    return sum(rewards) / len(rewards) if rewards else 0.0
