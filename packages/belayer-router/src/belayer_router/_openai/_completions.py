"""``POST /v1/completions``: the OpenAI completions API on top of the router's generate path.

Prompts are token ids or text (with a tokenizer), one or a batch; ``n`` samples per prompt.
Every choice is its own resumable router request (see `split_choices`).  Responses carry the
text (empty without a tokenizer) and, as extensions on every choice, ``token_ids``,
``prompt_token_ids``, ``request_id`` and ``num_resumes``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from belayer_router._core._tokenizer import Tokenizer
from belayer_router._errors import BelayerRouterError, InvalidRequestError, error_payload
from belayer_router._openai._choices import ChoiceText
from belayer_router._openai._params import OpenAIParams, off_the_loop, parse_openai_params
from belayer_router._wire._protocol import MAX_TOKEN_ID, FinishEvent, GenerateRequest, TokenEvent, TokensEvent

__all__ = ["ChoiceEvent", "CompletionRenderer", "parse_completion_request", "sse", "usage_of"]

ChoiceEvent = tuple[int, TokenEvent | TokensEvent | FinishEvent]


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


async def _prompts(prompt: Any, tokenizer: Tokenizer | None) -> list[list[int]]:
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(
            "field 'prompt' must be text, a list of token ids, or a non-empty list of either"
        )
    texts = [item for item in prompt if isinstance(item, str)]
    encoded: Iterator[list[int]] = iter(())
    if texts:
        if tokenizer is None:
            raise InvalidRequestError(
                "'prompt' is text but the router has no tokenizer; send token ids or start the "
                "router with --tokenizer"
            )
        encode = tokenizer.encode
        encoded = iter(await off_the_loop(sum(map(len, texts)), lambda: [encode(t) for t in texts]))
    prompts: list[list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(next(encoded))
        elif _is_ids(item):
            if any(t > MAX_TOKEN_ID for t in item):
                raise InvalidRequestError(f"field 'prompt' holds a token id over {MAX_TOKEN_ID}")
            prompts.append(list(item))
        else:
            raise InvalidRequestError(
                f"field 'prompt' holds {type(item).__name__}; each prompt must be text or a list of "
                "non-negative integer token ids"
            )
    return prompts


async def parse_completion_request(
    body: Any, tokenizer: Tokenizer | None, *, default_model: str
) -> tuple[OpenAIParams, list[list[int]], int | None]:
    """Validate an OpenAI completions body: its parameters, prompts and ``logprobs``."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if "prompt" not in body:
        raise InvalidRequestError("field 'prompt' is required (token ids, or text with a tokenizer)")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise InvalidRequestError(f"field 'logprobs' must be a non-negative integer, got {logprobs!r}")
    params = parse_openai_params(
        body, default_model=default_model, default_max_tokens=16, default_stop_token_ids=()
    )
    if params.stop and tokenizer is None:
        raise InvalidRequestError(
            "stop strings need a router started with --tokenizer; or use 'stop_token_ids'"
        )
    return params, await _prompts(body["prompt"], tokenizer), logprobs


def usage_of(requests: Sequence[GenerateRequest], finishes: Sequence[FinishEvent], n: int) -> dict[str, int]:
    """OpenAI usage: each prompt counted once, every choice's completion tokens."""
    prompt = sum(len(r.prompt_token_ids) for r in requests[::n])
    completion = sum(f.num_generated_tokens for f in finishes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event line."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _error_chunk(error: BelayerRouterError) -> bytes:
    return sse(error_payload(error))


@attrs.define
class CompletionRenderer:
    """Turns the choices' router events into OpenAI completion objects (whole, or SSE chunks)."""

    params: OpenAIParams
    requests: list[GenerateRequest]
    tokenizer: Tokenizer | None
    logprobs: int | None
    completion_id: str
    created: int = attrs.field(factory=lambda: int(time.time()))
    choices: list[ChoiceText] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.choices = [ChoiceText(self.tokenizer, r.stop) for r in self.requests]

    def _logprobs(self, choice: ChoiceText, start: int) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        ids, values = choice.token_ids[start:], choice.logprobs[start:]
        texts = [choice.token_text(t) for t in ids]
        return {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": [{text: value} for text, value in zip(texts, values, strict=True)],
            "text_offset": [0] * len(ids),
        }

    def _object(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.params.model,
            "choices": choices,
            "usage": usage,
        }

    def _choice(self, index: int, text: str, start: int) -> dict[str, Any]:
        choice = self.choices[index]
        finish = choice.finish
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(choice, start),
            "finish_reason": None if finish is None else finish.finish_reason,
            "token_ids": choice.token_ids[start:],
            "request_id": self.requests[index].request_id,
            "num_resumes": None if finish is None else finish.num_resumes,
        }

    def _usage(self) -> dict[str, int]:
        finishes = [c.finish for c in self.choices if c.finish is not None]
        return usage_of(self.requests, finishes, self.params.n)

    def whole(self, events: list[ChoiceEvent]) -> dict[str, Any]:
        """The non-streaming response."""
        for index, event in events:
            self.choices[index].add(event)
        choices = []
        for index, choice in enumerate(self.choices):
            body = self._choice(index, choice.text(), 0)
            body["prompt_token_ids"] = list(self.requests[index].prompt_token_ids)
            choices.append(body)
        return self._object(choices, self._usage())

    def chunks(self, events: list[ChoiceEvent]) -> bytes:
        """SSE chunks for a batch of events; after the last choice's finish, ``data: [DONE]``."""
        starts: dict[int, int] = {}
        for index, event in events:
            starts.setdefault(index, len(self.choices[index].token_ids))
            self.choices[index].add(event)
        out = []
        for index, start in sorted(starts.items()):
            choice = self.choices[index]
            out.append(
                sse(self._object([self._choice(index, choice.take(choice.streamable()), start)], None))
            )
        if all(c.finish is not None for c in self.choices):
            if self.params.include_usage:
                out.append(sse(self._object([], self._usage())))
            out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    error_chunk = staticmethod(_error_chunk)
