"""Token routes of vLLM's server that RL frameworks call: ``POST /inference/v1/generate`` (token
ids in, token ids and logprobs out: SkyRL's `RemoteInferenceClient`, verifiers' training client),
``POST /tokenize`` and ``POST /detokenize``.

``/inference/v1/generate`` runs as one resumable request, like ``/generate`` with
``stream: false``: ``{"token_ids", "sampling_params", "model"}`` in; ``{"request_id", "choices":
[{"index": 0, "token_ids", "finish_reason", "logprobs": {"content": [{"token", "token_id",
"logprob"}]} | null}]}`` out. The sampling parameters the engines honour are taken
(``max_tokens`` (vLLM's default 16), ``temperature``, ``top_p``, ``seed``, ``stop_token_ids``,
``logprobs``, ``ignore_eos``); the ones that only shape text are ignored (we return ids); any
other that would change the tokens (``top_k``, ``min_p``, penalties, ``n`` > 1, stop strings) is
a 400 naming it, never silently dropped.
"""

from __future__ import annotations

from typing import Any

from belayer_router._core._config import RouterConfig
from belayer_router._core._emit import Emit, EventEmit
from belayer_router._core._journal import RequestRecord
from belayer_router._errors import InvalidRequestError, TokenizerError
from belayer_router._server._asgi import Receive, Send, run_unless_disconnected, send_json, session_header
from belayer_router._wire._protocol import FinishEvent, GenerateRequest, TokenEvent, TokensEvent

__all__ = ["TokenRoutes"]

_TEXT_ONLY = {
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "output_kind",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "logprob_token_ids",
}
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
}
_NEUTRAL |= {"frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "n": (None, 1)}
_NEUTRAL |= {"stop": (None, [], ""), "bad_words": (None, []), "min_tokens": (None, 0)}
_TAKEN = {"max_tokens", "temperature", "top_p", "seed", "stop_token_ids", "logprobs", "ignore_eos"}


def _generate_body(body: Any, end_token_ids: tuple[int, ...]) -> tuple[dict[str, Any], bool]:
    """A ``/generate`` body (not streamed) from a vLLM generate body; and whether logprobs are asked."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise InvalidRequestError("field 'sampling_params' must be a JSON object")
    for name, value in params.items():
        if name in _TAKEN or name in _TEXT_ONLY:
            continue
        if name in _NEUTRAL and value in _NEUTRAL[name]:
            continue
        raise InvalidRequestError(
            f"sampling parameter {name!r}={value!r} is not supported by Belayer's engines; leave it at its "
            f"default (supported: {sorted(_TAKEN)})"
        )
    stops = list(params.get("stop_token_ids") or [])
    if not params.get("ignore_eos"):
        stops += [t for t in end_token_ids if t not in stops]
    generate: dict[str, Any] = {
        "prompt_token_ids": body.get("token_ids"),
        "max_tokens": params.get("max_tokens") if params.get("max_tokens") is not None else 16,
        "temperature": params.get("temperature", 1.0),
        "top_p": params.get("top_p", 1.0),
        "stop_token_ids": stops,
        "stream": False,
    }
    if params.get("seed") is not None:
        generate["seed"] = params["seed"]
    if isinstance(body.get("request_id"), str):
        generate["request_id"] = body["request_id"]
    if "token_ids" not in body:
        raise InvalidRequestError("field 'token_ids' is required (the prompt's token ids)")
    return generate, params.get("logprobs") is not None


class TokenRoutes:
    """``/inference/v1/generate``, ``/tokenize``, ``/detokenize``, mixed into `RouterApp`."""

    config: RouterConfig

    def parse_generate(self, body: Any) -> GenerateRequest:
        raise NotImplementedError

    def _begin(self, request: GenerateRequest) -> RequestRecord:
        raise NotImplementedError

    async def _run(self, record: RequestRecord, emit: Emit, num_received: int) -> None:
        raise NotImplementedError

    async def _body(self, receive: Receive) -> Any:
        raise NotImplementedError

    async def _inference_generate(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        tokenizer = self.config.tokenizer
        end_token_ids = tuple(getattr(tokenizer, "end_token_ids", ()) or ())
        body, with_logprobs = _generate_body(await self._body(receive), end_token_ids)
        request = self.parse_generate(body)
        record = self._begin(request)
        record.session_id = session_header(scope)
        events: list[TokenEvent | TokensEvent | FinishEvent] = []
        if not await run_unless_disconnected(
            receive, lambda: self._run(record, EventEmit(events.append, False), 0)
        ):
            return
        finish = next(e for e in events if isinstance(e, FinishEvent))
        token_ids, logprobs = list(record.token_ids), list(record.logprobs)
        content = [
            {"token": f"token_id:{t}", "token_id": t, "logprob": lp}
            for t, lp in zip(token_ids, logprobs, strict=True)
        ]
        choice = {
            "index": 0,
            "token_ids": token_ids,
            "finish_reason": finish.finish_reason,
            "logprobs": {"content": content} if with_logprobs else None,
            "num_resumes": record.num_resumes,
        }
        await send_json(send, 200, {"request_id": record.request_id, "choices": [choice]})

    async def _tokenize(self, receive: Receive, send: Send) -> None:
        body = await self._body(receive)
        tokenizer = self._tokenizer()
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        if "messages" in body:
            render = getattr(tokenizer, "render_chat", None)
            if render is None:
                raise TokenizerError("tokenizing messages needs a tokenizer folder with a chat template")
            tokens = list(render(body["messages"], body.get("tools")))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise InvalidRequestError(f"field 'prompt' must be a string, got {type(prompt).__name__}")
            tokens = tokenizer.encode(prompt)
        limit = self.config.max_prompt_tokens
        await send_json(
            send, 200, {"count": len(tokens), "max_model_len": limit, "tokens": tokens, "token_strs": None}
        )

    async def _detokenize(self, receive: Receive, send: Send) -> None:
        body = await self._body(receive)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise InvalidRequestError("field 'tokens' must be a list of token ids")
        await send_json(send, 200, {"prompt": self._tokenizer().decode(tokens)})

    def _tokenizer(self) -> Any:
        tokenizer = self.config.tokenizer
        if tokenizer is None:
            raise TokenizerError(
                "this router has no tokenizer (router option --tokenizer; serve: the model folder's)"
            )
        return tokenizer
