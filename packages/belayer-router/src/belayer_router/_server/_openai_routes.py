"""The OpenAI routes of the router app: every choice of a request is one resumable request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from belayer_router._core._config import RouterConfig
from belayer_router._core._emit import Emit, EventEmit
from belayer_router._core._journal import Journal, RequestRecord
from belayer_router._core._seeds import SeedSource
from belayer_router._core._tokenizer import ChatTokenizer
from belayer_router._errors import BelayerRouterError
from belayer_router._openai._chat import ChatRenderer, parse_chat_request
from belayer_router._openai._completions import ChoiceEvent, CompletionRenderer, parse_completion_request
from belayer_router._openai._params import OpenAIParams, split_choices
from belayer_router._server._asgi import (
    Receive,
    Send,
    direct_writer,
    run_unless_disconnected,
    send_json,
    session_header,
    stream_response,
)
from belayer_router._wire._protocol import GenerateRequest

__all__ = ["OpenAIRoutes"]


class OpenAIRoutes:
    """``/v1/completions`` and ``/v1/chat/completions``, mixed into `RouterApp`."""

    config: RouterConfig
    journal: Journal
    seeds: SeedSource

    def _begin(self, request: GenerateRequest) -> RequestRecord:
        raise NotImplementedError

    async def _run(self, record: RequestRecord, emit: Emit, num_received: int) -> None:
        raise NotImplementedError

    def _seeded(self, body: Any) -> Any:
        """The body with the server's seed for it (`RouterConfig.seed`) when it names none."""
        if self.config.seed is None or not isinstance(body, dict) or body.get("seed") is not None:
            return body
        return {**body, "seed": self.seeds.next(body)}

    async def _completions(self, body: Any, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        body = self._seeded(body)
        tokenizer = self.config.tokenizer
        params, prompts, logprobs = await parse_completion_request(
            body, tokenizer, default_model=self.config.model_name
        )
        requests = self._choices(params, prompts)
        renderer = CompletionRenderer(params, requests, tokenizer, logprobs, f"cmpl-{params.request_id}")
        await self._openai(requests, renderer, params.stream, scope, receive, send)

    async def _chat_completions(self, body: Any, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        body = self._seeded(body)
        tokenizer = self.config.tokenizer
        params, prompt, tools, logprobs = await parse_chat_request(
            body,
            tokenizer,
            default_model=self.config.model_name,
            default_max_tokens=self.config.default_max_tokens,
        )
        assert isinstance(tokenizer, ChatTokenizer)  # parse_chat_request refuses any other
        requests = self._choices(params, [prompt])
        renderer = ChatRenderer(params, requests, tokenizer, tools, logprobs, f"chatcmpl-{params.request_id}")
        await self._openai(requests, renderer, params.stream, scope, receive, send)

    def _choices(self, params: OpenAIParams, prompts: list[list[int]]) -> list[GenerateRequest]:
        return split_choices(
            params,
            prompts,
            max_choices=self.config.max_choices,
            max_prompt_tokens=self.config.max_prompt_tokens,
        )

    async def _openai(
        self,
        requests: list[GenerateRequest],
        renderer: CompletionRenderer | ChatRenderer,
        stream: bool,
        scope: dict[str, Any],
        receive: Receive,
        send: Send,
    ) -> None:
        records: list[RequestRecord] = []
        try:
            session = session_header(scope)
            for request in requests:
                records.append(self._begin(request))
                records[-1].session_id = session
        except BelayerRouterError:
            for record in records:  # e.g. choice 2's request id conflicts: free choices 0 and 1
                self.journal.release(record)
            raise

        async def produce(emit: Callable[[ChoiceEvent], None]) -> None:
            await self._run_choices(records, emit)

        if not stream:
            events: list[ChoiceEvent] = []
            if await run_unless_disconnected(receive, lambda: produce(events.append)):
                await send_json(send, 200, renderer.whole(events))
            return
        await stream_response(
            receive,
            send,
            produce,
            renderer.chunks,
            renderer.error_chunk,
            "text/event-stream",
            direct_writer(scope),
        )

    async def _run_choices(self, records: list[RequestRecord], emit: Callable[[ChoiceEvent], None]) -> None:
        """Run every choice's request at once; the first error cancels the rest and is raised."""
        if len(records) == 1:
            await self._run(records[0], _choice_emit(emit, 0, records[0]), 0)
            return
        failures: list[BelayerRouterError] = []

        async def one(index: int, record: RequestRecord, scope: anyio.CancelScope) -> None:
            try:
                await self._run(record, _choice_emit(emit, index, record), 0)
            except BelayerRouterError as error:
                failures.append(error)
                scope.cancel()

        async with anyio.create_task_group() as group:
            for index, record in enumerate(records):
                group.start_soon(one, index, record, group.cancel_scope)
        if failures:
            raise failures[0]


def _choice_emit(emit: Callable[[ChoiceEvent], None], index: int, record: RequestRecord) -> Emit:
    """Choice ``index``'s `Emit`: its events, tagged with the index, go to the renderer's stream."""
    return EventEmit(lambda event: emit((index, event)), record.request.frames)
