"""The sampling parameters both OpenAI endpoints share, and how one request becomes n choices.

A request with ``n`` samples (and, on ``/v1/completions``, several prompts) becomes one router
request per choice: each is journaled and resumed on its own, with the request id
``<id>-<choice>`` and a seed derived from the request's seed, so every choice is reproducible and
a resumed choice continues exactly.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio.to_thread
import attrs

from belayer_router._core._dispatch import new_seed
from belayer_router._errors import InvalidRequestError
from belayer_router._wire._protocol import MAX_TOKENS, GenerateRequest, parse_generate_request

__all__ = ["OpenAIParams", "derive_seed", "off_the_loop", "parse_openai_params", "split_choices"]

_T = TypeVar("_T")
# Text above this many characters is templated / tokenized in a worker thread: a few MB of prompt
# took seconds of CPU that froze every other request (and /health); small prompts stay inline,
# where a thread hop would cost more than the work.
OFF_LOOP_CHARS = 64 * 1024

_MAX_SEED = 2**63 - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MAX_STOP_STRINGS = 16
_MAX_STOP_CHARS = 256
# OpenAI parameters the workers cannot honour: refused unless they have their neutral value.
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "best_of": 1,
    "echo": False,
    "suffix": None,
}


@attrs.frozen
class OpenAIParams:
    """The validated parameters of an OpenAI request that the router itself acts on."""

    model: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    n: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    stream: bool
    include_usage: bool
    request_id: str
    explicit_request_id: bool


async def off_the_loop(num_chars: int, work: Callable[[], _T]) -> _T:
    """``work()`` (a template render, an encode) for a text of ``num_chars`` characters: inline
    when small, in a worker thread (the event loop goes on serving) when over `OFF_LOOP_CHARS`."""
    if num_chars <= OFF_LOOP_CHARS:
        return work()
    return await anyio.to_thread.run_sync(work)


def derive_seed(seed: int, choice: int) -> int:
    """The seed of choice ``choice`` (choice 0 keeps ``seed``, so ``n=1`` is the plain request)."""
    return (seed + choice * _GOLDEN) % _MAX_SEED


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise InvalidRequestError("field 'stop' must be a non-empty string or a list of them")
    if len(strings) > _MAX_STOP_STRINGS or any(len(s) > _MAX_STOP_CHARS for s in strings):
        raise InvalidRequestError(
            f"field 'stop' allows at most {_MAX_STOP_STRINGS} strings of at most {_MAX_STOP_CHARS} chars"
        )
    return tuple(strings)


def _positive(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequestError(f"field {name!r} must be a positive integer, got {value!r}")
    if value > MAX_TOKENS:  # past any context; unbounded, it would not fit the workers' wire format
        raise InvalidRequestError(f"field {name!r} must be at most {MAX_TOKENS}, got {value}")
    return value


def parse_openai_params(
    body: dict[str, Any],
    *,
    default_model: str,
    default_max_tokens: int,
    default_stop_token_ids: Sequence[int],
) -> OpenAIParams:
    """Validate the shared fields; `InvalidRequestError` names the field and what to send."""
    for name, neutral in _NEUTRAL.items():
        if body.get(name) not in (neutral, None):
            raise InvalidRequestError(f"field {name!r} is not supported by this router; leave it out")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(f"field 'model' must be a string, got {model!r}")
    max_tokens = _positive(body, "max_completion_tokens", 0) or _positive(
        body, "max_tokens", default_max_tokens
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError(f"field 'stream' must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("field 'stream_options' must be an object")
    stop_token_ids = body.get("stop_token_ids")
    probe = parse_generate_request(  # the shared range checks of the generate path
        {
            "prompt_token_ids": [0],
            "max_tokens": max_tokens,
            **{k: body.get(k) for k in ("temperature", "top_p", "seed", "request_id")},
            "stop_token_ids": list(default_stop_token_ids) if stop_token_ids is None else stop_token_ids,
        }
    )
    return OpenAIParams(
        model=model or default_model,
        max_tokens=max_tokens,
        temperature=probe.temperature,
        top_p=probe.top_p,
        seed=new_seed() if probe.seed is None else probe.seed,
        n=_positive(body, "n", 1),
        stop=_stop_strings(body.get("stop")),
        stop_token_ids=probe.stop_token_ids,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        request_id=probe.request_id or uuid.uuid4().hex,
        explicit_request_id=probe.request_id is not None,
    )


def split_choices(
    params: OpenAIParams, prompts: Sequence[Sequence[int]], *, max_choices: int, max_prompt_tokens: int
) -> list[GenerateRequest]:
    """One router request per choice: prompt ``p``'s ``n`` samples are choices ``p*n .. p*n+n-1``."""
    if len(prompts) * params.n > max_choices:
        raise InvalidRequestError(
            f"{len(prompts)} prompt(s) x n={params.n} exceeds the limit of {max_choices} choices per "
            "request (router option max_choices); split the request"
        )
    requests: list[GenerateRequest] = []
    for p, prompt in enumerate(prompts):
        if len(prompt) > max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt {p} has {len(prompt)} tokens, over the limit of {max_prompt_tokens} "
                "(router option max_prompt_tokens); shorten it"
            )
        if not prompt:
            raise InvalidRequestError(f"prompt {p} is empty; send at least one token")
        for j in range(params.n):
            choice = p * params.n + j
            single = len(prompts) * params.n == 1
            requests.append(
                GenerateRequest(
                    prompt_token_ids=tuple(prompt),
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    seed=derive_seed(params.seed, j),
                    stop_token_ids=params.stop_token_ids,
                    stop=params.stop,
                    request_id=params.request_id if single else f"{params.request_id}-{choice}",
                    stream=params.stream,
                )
            )
    return requests
