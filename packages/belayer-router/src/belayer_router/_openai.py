"""``POST /v1/completions``: the OpenAI completions API on top of the router's generate path.

Prompts are token ids, or text when the router has a tokenizer.  Responses carry the text
(empty without a tokenizer) and, as an extension, ``token_ids`` on every choice.
"""

from __future__ import annotations

import json
import time
from typing import Any

import attrs

from belayer_router._errors import BelayerRouterError, InvalidRequestError
from belayer_router._protocol import FinishEvent, TokenEvent, parse_generate_request
from belayer_router._tokenizer import Tokenizer

__all__ = ["CompletionOptions", "CompletionRenderer", "parse_completion_request"]

_UNSUPPORTED = {"echo": False, "best_of": 1, "suffix": None}


@attrs.frozen
class CompletionOptions:
    """The OpenAI-only parts of a completions request."""

    model: str
    logprobs: int | None
    include_usage: bool


def _prompt_ids(prompt: Any, tokenizer: Tokenizer | None) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "'prompt' is text but the router has no tokenizer; send token ids or start the "
                "router with --tokenizer"
            )
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise InvalidRequestError(
            "'prompt' must be a single prompt; send batched prompts as separate requests"
        )
    return prompt  # type: ignore[no-any-return]  # validated by parse_generate_request


def parse_completion_request(body: Any, tokenizer: Tokenizer | None) -> tuple[Any, CompletionOptions]:
    """Validate an OpenAI completions body; return the generate request and the OpenAI options."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if "prompt" not in body:
        raise InvalidRequestError("field 'prompt' is required (token ids, or text with a tokenizer)")
    if body.get("n", 1) not in (1, None):
        raise InvalidRequestError("only n=1 is supported; send one request per sample")
    for name, default in _UNSUPPORTED.items():
        if body.get(name, default) not in (default, None):
            raise InvalidRequestError(f"field {name!r} is not supported by this router")
    if body.get("stop"):
        raise InvalidRequestError("stop strings are not supported; pass token ids in 'stop_token_ids'")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise InvalidRequestError(f"field 'logprobs' must be a non-negative integer, got {logprobs!r}")
    stream_options = body.get("stream_options") or {}
    generate_body = {
        "prompt_token_ids": _prompt_ids(body["prompt"], tokenizer),
        "max_tokens": body.get("max_tokens") or 16,
        "stream": bool(body.get("stream", False)),
        **{k: body.get(k) for k in ("temperature", "top_p", "seed", "stop_token_ids", "request_id")},
    }
    options = CompletionOptions(
        model=str(body.get("model") or "belayer"),
        logprobs=logprobs,
        include_usage=bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
    )
    return parse_generate_request(generate_body), options


@attrs.define
class CompletionRenderer:
    """Turns router events into OpenAI completion objects (whole, or as SSE chunks)."""

    options: CompletionOptions
    tokenizer: Tokenizer | None
    completion_id: str
    created: int = attrs.field(factory=lambda: int(time.time()))
    token_ids: list[int] = attrs.field(factory=list)
    text: str = ""

    def _token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprobs(self, tokens: list[TokenEvent]) -> dict[str, Any] | None:
        if self.options.logprobs is None:
            return None
        texts = [self._token_text(t.token_id) for t in tokens]
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{text: t.logprob} for text, t in zip(texts, tokens, strict=True)],
            "text_offset": [0] * len(tokens),
        }

    def _advance_text(self, tokens: list[TokenEvent]) -> str:
        self.token_ids.extend(t.token_id for t in tokens)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.token_ids)
        delta, self.text = text[len(self.text) :], text
        return delta

    def _object(self, choice: dict[str, Any], usage: dict[str, int] | None) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.options.model,
            "choices": [choice] if choice else [],
            "usage": usage,
        }

    @staticmethod
    def _usage(finish: FinishEvent) -> dict[str, int]:
        total = finish.num_prompt_tokens + finish.num_generated_tokens
        return {
            "prompt_tokens": finish.num_prompt_tokens,
            "completion_tokens": finish.num_generated_tokens,
            "total_tokens": total,
        }

    def whole(self, events: list[TokenEvent | FinishEvent]) -> dict[str, Any]:
        """The non-streaming response."""
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        finish = next(e for e in events if isinstance(e, FinishEvent))
        choice = {
            "index": 0,
            "text": self._advance_text(tokens),
            "logprobs": self._logprobs(tokens),
            "finish_reason": finish.finish_reason,
            "token_ids": [t.token_id for t in tokens],
        }
        return self._object(choice, self._usage(finish))

    def chunks(self, events: list[TokenEvent | FinishEvent]) -> bytes:
        """SSE lines for a batch of events; the finish event ends with ``data: [DONE]``."""
        out: list[bytes] = []
        for event in events:
            if isinstance(event, TokenEvent):
                choice = {
                    "index": 0,
                    "text": self._advance_text([event]),
                    "logprobs": self._logprobs([event]),
                    "finish_reason": None,
                    "token_ids": [event.token_id],
                }
                out.append(_sse(self._object(choice, None)))
                continue
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": event.finish_reason,
                "token_ids": [],
            }
            out.append(_sse(self._object(choice, None)))
            if self.options.include_usage:
                out.append(_sse(self._object({}, self._usage(event))))
            out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    @staticmethod
    def error_chunk(error: BelayerRouterError) -> bytes:
        """An SSE error object (the stream ends after it)."""
        return _sse({"error": {"message": str(error), "code": error.status}})


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
