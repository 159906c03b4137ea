"""`RouterClient`: the async client for workers (registration) and trainers (generation, ``L_k``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from types import TracebackType
from typing import Any, Self

import anyio
import attrs
import httpx
import orjson

from belayer_router._client._mux import ClientMux
from belayer_router._errors import RouterClientError
from belayer_router._wire._protocol import CLIENT_KEEP_ALIVE_S, FinishEvent, TokenEvent

__all__ = ["Completion", "RouterClient"]


@attrs.frozen
class Completion:
    """A finished generation."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    num_prompt_tokens: int
    num_resumes: int


def _raise_for_status(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    raise RouterClientError(response.status_code, message)


@attrs.define
class RouterClient:
    """Talks to one router over HTTP.  Use as ``async with RouterClient(url) as client:``.

    ``reconnect_timeout_s``: how long a streaming generation keeps reconnecting (with the same
    request id and the number of tokens already received) when the router itself goes away, e.g.
    while it restarts from its persisted journal; counted from the break, however long the
    stream ran before it.  ``timeout_s``: the HTTP timeout of one call (with ``multiplex=True``,
    also the longest a link, or one call on a live link, may go without a token).  ``reconnect_timeout``
    and ``timeout`` are the old spellings, still accepted (they win when given) until the next
    minor release.

    ``multiplex=True``: `generate_stream` and `generate` travel over ONE client link
    (``POST /client-link``, binary frames) shared by every concurrent call of this client, so the
    router writes one frame per event-loop turn for all of them instead of one write per token
    per stream.  Same events, errors and reconnect contract as the HTTP path; the client must be
    entered (``async with``), where the link's reader task runs; ``base_url`` must be http://.
    """

    base_url: str
    admin_token: str | None = None
    reconnect_timeout_s: float = 30.0
    timeout_s: float = 600.0
    reconnect_timeout: float | None = attrs.field(default=None, kw_only=True)
    timeout: float | None = attrs.field(default=None, kw_only=True)
    multiplex: bool = attrs.field(default=False, kw_only=True)
    _http: httpx.AsyncClient = attrs.field(init=False, alias="_http")
    _link: ClientMux | None = attrs.field(init=False, default=None, alias="_link")

    def __attrs_post_init__(self) -> None:
        if self.reconnect_timeout is not None:
            self.reconnect_timeout_s = self.reconnect_timeout
        if self.timeout is not None:
            self.timeout_s = self.timeout
        headers = {} if self.admin_token is None else {"authorization": f"Bearer {self.admin_token}"}
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=1024, keepalive_expiry=CLIENT_KEEP_ALIVE_S
        )
        if self.multiplex:  # before the HTTP client: a bad URL leaves nothing to close
            self._link = ClientMux(
                self.base_url,
                connect_timeout_s=min(30.0, self.timeout_s),
                read_timeout_s=self.timeout_s,
                token=self.admin_token,
            )
        self._http = httpx.AsyncClient(
            base_url=self.base_url.rstrip("/"), headers=headers, timeout=self.timeout_s, limits=limits
        )

    async def __aenter__(self) -> Self:
        if self._link is not None:
            await self._link.__aenter__()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.aclose()
        finally:
            if self._link is not None:
                await self._link.__aexit__(kind, error, tb)

    async def aclose(self) -> None:
        """Close the connections (with ``multiplex=True``, open generations raise
        `RouterClientError` with status 499)."""
        if self._link is not None:
            await self._link.aclose()
        await self._http.aclose()

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        response = await self._http.request(method, path, json=body)
        _raise_for_status(response)
        return response.json()

    # -- workers -------------------------------------------------------------------------------

    async def register(self, slot: str, url: str, epoch: int, link: bool = False) -> None:
        """Make the worker at ``url`` the active one of ``slot`` at ``epoch`` (must exceed older ones).

        ``link=True``: the worker serves the multiplexed link (``POST /link``, README "Worker
        link"); the router then streams all its requests over one connection.
        """
        body: dict[str, Any] = {"slot": slot, "url": url, "epoch": epoch}
        if link:
            body["link"] = True
        await self._call("POST", "/workers/register", body)

    async def unregister(self, slot: str, epoch: int) -> None:
        """Remove the slot's worker of ``epoch``; its in-flight requests are resumed elsewhere."""
        await self._call("POST", "/workers/unregister", {"slot": slot, "epoch": epoch})

    async def mark_unhealthy(self, slot: str) -> None:
        """Take ``slot`` out of service for good; its requests spread over the healthy slots."""
        await self._call("POST", f"/slots/{slot}/unhealthy")

    async def workers(self) -> list[dict[str, Any]]:
        """The slots with their worker, epoch, health, outstanding requests and weight version."""
        return list((await self._call("GET", "/workers"))["slots"])

    # -- weight versions (the stale-version barrier) -------------------------------------------

    async def report_weight_version(self, slot: str, version: int) -> None:
        """Record that ``slot`` has committed weight ``version`` (and serves new requests with it).

        A slot's version only moves forward (a lower one: `RouterClientError` 409; an unknown
        slot: 404).  A slot held out for another version is back in rotation once it reports
        the required one.
        """
        await self._call("POST", f"/slots/{slot}/weights", {"version": version})

    async def require_weight_version(self, version: int) -> None:
        """Serve every new token from slots that reported ``version`` only (the step's version).

        Streams on slots with another version are cut at once and resume on a current slot
        (with every token so far); such slots get no request until they report ``version``.
        The required version only moves forward (a lower one: `RouterClientError` 409).
        """
        await self._call("POST", "/weights/required", {"version": version})

    async def required_weight_version(self) -> int | None:
        """The weight version the router requires, None before `require_weight_version`."""
        required = (await self._call("GET", "/workers"))["required_version"]
        return None if required is None else int(required)

    # -- trainers ------------------------------------------------------------------------------

    async def generate_stream(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        request_id: str | None = None,
        trajectory_id: str | None = None,
        turn: int | None = None,
    ) -> AsyncIterator[TokenEvent | FinishEvent]:
        """Yield each `TokenEvent` as it is generated, then the `FinishEvent`."""
        body: dict[str, Any] = {
            "prompt_token_ids": list(prompt_token_ids),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop_token_ids": list(stop_token_ids),
            "request_id": request_id or uuid.uuid4().hex,
            "trajectory_id": trajectory_id,
            "turn": turn,
        }
        if self._link is not None:
            async with aclosing(self._link.stream(body, self.reconnect_timeout_s)) as events:
                async for event in events:  # aclosing: leaving early CANCELs at once
                    yield event
            return
        body["frames"] = True  # several tokens per line when the worker sends frames
        num_received = 0
        broken_since: float | None = None  # the reconnect window starts at a break, not at the start
        attempts = 0  # reconnects since the last event: each waits twice as long (up to 16 x timeout_s)
        while True:
            body["num_received_tokens"] = num_received
            try:
                # A router that has just restarted on a loaded machine may need longer than
                # timeout_s to answer a resume; an attempt given up on stays in its backlog and
                # is answered (409 to the next) meanwhile, so waiting longer each time ends that.
                timeout = self.timeout_s * 2 ** min(attempts, 4)
                async for event in self._stream_once(body, timeout):
                    broken_since = None
                    attempts = 0
                    if isinstance(event, TokenEvent):
                        num_received += 1
                    yield event
                    if isinstance(event, FinishEvent):
                        return
                raise httpx.RemoteProtocolError("router stream ended without a finish event")
            except RouterClientError as error:
                # A reconnect can find the request still in flight (409) on a connection of ours that
                # the router took from its backlog after a restart and we had already given up on:
                # it ends when the router finds that connection closed, then the resume goes on.
                if error.status != 409 or broken_since is None:
                    raise
                if anyio.current_time() - broken_since >= self.reconnect_timeout_s:
                    raise
                await anyio.sleep(0.05)
            except (httpx.TransportError, OSError):
                now = anyio.current_time()
                if broken_since is None:
                    broken_since = now
                if now - broken_since >= self.reconnect_timeout_s:
                    raise
                attempts += 1
                await anyio.sleep(0.05)

    async def _stream_once(
        self, body: dict[str, Any], timeout_s: float
    ) -> AsyncIterator[TokenEvent | FinishEvent]:
        async with self._http.stream("POST", "/generate", json=body, timeout=timeout_s) as response:
            if response.status_code >= 400:
                await response.aread()
                _raise_for_status(response)
            async for line in response.aiter_lines():
                if not line:
                    continue
                event = orjson.loads(line)
                kind = event.pop("type")
                if kind == "tokens":
                    index, logprobs = event["index"], event["logprobs"]
                    for offset, token_id in enumerate(event["token_ids"]):
                        yield TokenEvent(index + offset, token_id, logprobs[offset])
                elif kind == "token":
                    yield TokenEvent(**event)
                elif kind == "finish":
                    yield FinishEvent(**event)
                else:
                    raise RouterClientError(int(event.get("status", 500)), str(event.get("message")))

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        **options: Any,
    ) -> Completion:
        """Generate to completion (streamed underneath, so it survives router restarts).

        ``options`` are those of `generate_stream`.
        """
        token_ids: list[int] = []
        logprobs: list[float] = []
        async for event in self.generate_stream(prompt_token_ids, max_tokens, **options):
            if isinstance(event, TokenEvent):
                token_ids.append(event.token_id)
                logprobs.append(event.logprob)
            else:
                return Completion(
                    event.request_id,
                    token_ids,
                    logprobs,
                    event.finish_reason,
                    event.num_prompt_tokens,
                    event.num_resumes,
                )
        raise RouterClientError(502, "router stream ended without a finish event")

    async def put_context(self, trajectory_id: str, turn: int, token_ids: Sequence[int]) -> None:
        """Record ``L_turn`` of a trajectory (the full token context after that turn)."""
        await self._call("PUT", f"/contexts/{trajectory_id}/{turn}", {"token_ids": list(token_ids)})

    async def append_context(self, trajectory_id: str, turn: int, token_ids: Sequence[int]) -> int:
        """Append what turn ``turn`` added after its response (an observation) to ``L_turn``, which
        the router recorded when that turn's generation (with ``trajectory_id`` and ``turn``)
        finished: the context crosses the wire once. Returns the length of ``L_turn`` now
        (`RouterClientError` 404 when the router has no ``L_turn``)."""
        answer = await self._call(
            "POST", f"/contexts/{trajectory_id}/{turn}/append", {"token_ids": list(token_ids)}
        )
        return int(answer["num_tokens"])

    async def get_context(self, trajectory_id: str, turn: int | None = None) -> tuple[int, list[int]]:
        """``(turn, L_turn)``; ``turn=None`` gives the latest turn recorded."""
        path = f"/contexts/{trajectory_id}" + ("" if turn is None else f"/{turn}")
        answer = await self._call("GET", path)
        return int(answer["turn"]), list(answer["token_ids"])

    async def drop_trajectory(self, trajectory_id: str) -> None:
        """Forget every context of a finished trajectory."""
        await self._call("DELETE", f"/contexts/{trajectory_id}")

    async def request_record(self, request_id: str) -> dict[str, Any]:
        """The journal record of a request: tokens, logprobs, ``num_preserved``, finish reason."""
        return dict(await self._call("GET", f"/requests/{request_id}"))

    async def health(self) -> dict[str, Any]:
        """``GET /health``."""
        return dict(await self._call("GET", "/health"))

    async def metrics(self) -> str:
        """``GET /metrics`` as Prometheus text."""
        response = await self._http.get("/metrics")
        _raise_for_status(response)
        return response.text
