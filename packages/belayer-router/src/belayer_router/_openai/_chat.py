"""``POST /v1/chat/completions``: chat messages rendered with the tokenizer's own chat template.

The prompt is the router tokenizer's ``chat_template`` applied to ``messages`` (and ``tools``);
generation stops at the template's end-of-turn tokens.  Tool calls in Qwen3's format (one JSON
object ``{"name": ..., "arguments": ...}`` between ``<tool_call>`` and ``</tool_call>``) are
parsed into ``tool_calls`` when the request has ``tools``; tool results (``role: tool``) go back
through the template.  Each choice also carries ``token_ids``, ``prompt_token_ids``,
``request_id`` and ``num_resumes`` (extensions), and with ``logprobs`` the sampled tokens'
logprobs (``top_logprobs`` stays empty: workers report only the sampled token).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import attrs

from belayer_router._core._tokenizer import ChatTokenizer, Tokenizer
from belayer_router._errors import InvalidRequestError
from belayer_router._openai._choices import ChoiceText
from belayer_router._openai._completions import ChoiceEvent, sse, usage_of
from belayer_router._openai._completions import CompletionRenderer as _Completion
from belayer_router._openai._params import OpenAIParams, off_the_loop, parse_openai_params
from belayer_router._wire._protocol import GenerateRequest

__all__ = ["ChatRenderer", "parse_chat_request", "parse_tool_calls"]

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)" + re.escape(TOOL_CLOSE), re.DOTALL)
_ROLES = ("system", "developer", "user", "assistant", "tool")


def _content(message: dict[str, Any], index: int) -> str | None:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"messages[{index}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"messages[{index}].content must be a string, a list of text parts, or null")


def _tool_calls(message: dict[str, Any], index: int) -> list[dict[str, Any]] | None:
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        raise InvalidRequestError(f"messages[{index}].tool_calls must be a list")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"messages[{index}].tool_calls[{k}] needs function.name (a string)")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            # OpenAI clients send the arguments back as JSON text; templates expect the object
            # (many apply ``tojson``, which would encode the text a second time), as vLLM does.
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise InvalidRequestError(
                    f"messages[{index}].tool_calls[{k}].function.arguments is not valid JSON text"
                ) from None
        elif not isinstance(arguments, dict):
            raise InvalidRequestError(
                f"messages[{index}].tool_calls[{k}].function.arguments must be JSON text"
            )
        out.append(
            {
                "id": call.get("id"),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("field 'messages' must be a non-empty list of {'role', 'content'} objects")
    out = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise InvalidRequestError(f"messages[{index}] needs a 'role', one of {', '.join(_ROLES)}")
        role = "system" if message["role"] == "developer" else message["role"]
        clean: dict[str, Any] = {"role": role, "content": _content(message, index)}
        if role == "assistant":
            clean["tool_calls"] = _tool_calls(message, index)
        elif clean["content"] is None:
            raise InvalidRequestError(f"messages[{index}] ({role}) needs 'content'")
        if role == "tool" and message.get("tool_call_id") is not None:
            clean["tool_call_id"] = str(message["tool_call_id"])
        out.append(clean)
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("field 'tools' must be a list of {'type': 'function', 'function': {...}}")
    for k, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise InvalidRequestError(
                f"tools[{k}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}"
            )
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise InvalidRequestError(
            f"tool_choice {choice!r} is not supported (the router cannot constrain decoding); use 'auto' or 'none'"
        )
    return None if choice == "none" else tools


async def parse_chat_request(
    body: Any, tokenizer: Tokenizer | None, *, default_model: str, default_max_tokens: int
) -> tuple[OpenAIParams, list[int], list[dict[str, Any]] | None, bool]:
    """Validate a chat body: parameters, the rendered prompt, the tools, and ``logprobs``."""
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    if not isinstance(tokenizer, ChatTokenizer):
        raise InvalidRequestError(
            "/v1/chat/completions needs a router started with --tokenizer DIR, a tokenizer folder "
            "whose tokenizer_config.json has a chat_template"
        )
    messages = _messages(body.get("messages"))
    tools = _tools(body)
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool | None):
        raise InvalidRequestError(f"field 'logprobs' must be true or false, got {logprobs!r}")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise InvalidRequestError(
            "field 'top_logprobs' is not supported (workers report the sampled token only)"
        )
    params = parse_openai_params(
        body,
        default_model=default_model,
        default_max_tokens=default_max_tokens,
        default_stop_token_ids=tokenizer.end_token_ids,
    )
    num_chars = sum(len(m["content"] or "") for m in messages)
    try:
        num_chars += len(json.dumps([tools, [m.get("tool_calls") for m in messages]]))
    except RecursionError:
        raise InvalidRequestError("field 'tools' or a message's 'tool_calls' is nested too deeply") from None
    prompt = await off_the_loop(num_chars, lambda: tokenizer.render_chat(messages, tools))
    return params, prompt, tools, bool(logprobs)


def parse_tool_calls(text: str, call_id: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split a Qwen3-format reply into its content and tool calls (vLLM's ``hermes`` rules).

    If any ``<tool_call>`` block is not a JSON object with a string ``name``, the reply is all
    content and has no tool calls.
    """
    calls = []
    for k, match in enumerate(_TOOL_CALL.finditer(text)):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{call_id}_{k}",
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
    if not calls:
        return text, []
    # Trailing whitespace only (the line break before the block): a stream cannot take back
    # leading whitespace it has already sent, and streamed and whole content must be equal.
    content = text[: text.index(TOOL_OPEN)].rstrip()
    return content or None, calls


@attrs.define
class ChatRenderer:
    """Turns the choices' router events into chat completion objects (whole, or SSE chunks)."""

    params: OpenAIParams
    requests: list[GenerateRequest]
    tokenizer: ChatTokenizer
    tools: list[dict[str, Any]] | None
    logprobs: bool
    completion_id: str
    created: int = attrs.field(factory=lambda: int(time.time()))
    choices: list[ChoiceText] = attrs.field(init=False)
    started: set[int] = attrs.field(factory=set)

    def __attrs_post_init__(self) -> None:
        hold = len(TOOL_OPEN) - 1 if self.tools else 0
        decode = self.tokenizer.decode_reply
        self.choices = [ChoiceText(self.tokenizer, r.stop, hold, decode) for r in self.requests]

    def _logprobs(self, choice: ChoiceText, start: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for token_id, value in zip(choice.token_ids[start:], choice.logprobs[start:], strict=True):
            text = choice.token_text(token_id)
            content.append(
                {"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []}
            )
        return {"content": content}

    def _object(
        self, kind: str, choices: list[dict[str, Any]], usage: dict[str, int] | None
    ) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": kind,
            "created": self.created,
            "model": self.params.model,
            "choices": choices,
            "usage": usage,
        }

    def _reply(self, index: int) -> tuple[str | None, list[dict[str, Any]]]:
        text = self.choices[index].text()
        if not self.tools:
            return text, []
        return parse_tool_calls(text, self.requests[index].request_id or str(index))

    def _finish_reason(self, index: int, calls: list[dict[str, Any]]) -> str | None:
        finish = self.choices[index].finish
        if finish is None:
            return None
        return "tool_calls" if calls else finish.finish_reason

    def _extensions(self, index: int, start: int) -> dict[str, Any]:
        choice = self.choices[index]
        return {
            "token_ids": choice.token_ids[start:],
            "request_id": self.requests[index].request_id,
            "num_resumes": None if choice.finish is None else choice.finish.num_resumes,
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
            content, calls = self._reply(index)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self._logprobs(choice, 0),
                    "finish_reason": self._finish_reason(index, calls),
                    **self._extensions(index, 0),
                    "prompt_token_ids": list(self.requests[index].prompt_token_ids),
                }
            )
        body = self._object("chat.completion", choices, self._usage())
        # vLLM's place for it (`return_token_ids`), where verifiers reads it: one chat, one prompt.
        body["prompt_token_ids"] = list(self.requests[0].prompt_token_ids)
        return body

    def _chunk(self, index: int, start: int) -> dict[str, Any]:
        choice = self.choices[index]
        delta: dict[str, Any] = {}
        if index not in self.started:
            self.started.add(index)
            delta["role"] = "assistant"
        calls: list[dict[str, Any]] = []
        if choice.finish is None:
            if self.tools:  # held: trailing whitespace is cut from the content before a tool call
                delta["content"] = choice.take(choice.streamable(TOOL_OPEN).rstrip())
            else:
                delta["content"] = choice.take(choice.streamable())
        else:
            content, calls = self._reply(index)
            delta["content"] = choice.take((content or "") if calls else choice.text())
            if calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
        return {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(choice, start),
            "finish_reason": self._finish_reason(index, calls),
            **self._extensions(index, start),
        }

    def chunks(self, events: list[ChoiceEvent]) -> bytes:
        """SSE chunks for a batch of events; after the last choice's finish, ``data: [DONE]``."""
        starts: dict[int, int] = {}
        for index, event in events:
            starts.setdefault(index, len(self.choices[index].token_ids))
            self.choices[index].add(event)
        out = [
            sse(self._object("chat.completion.chunk", [self._chunk(i, s)], None))
            for i, s in sorted(starts.items())
        ]
        if all(c.finish is not None for c in self.choices):
            if self.params.include_usage:
                out.append(sse(self._object("chat.completion.chunk", [], self._usage())))
            out.append(b"data: [DONE]\n\n")
        return b"".join(out)

    error_chunk = staticmethod(_Completion.error_chunk)
