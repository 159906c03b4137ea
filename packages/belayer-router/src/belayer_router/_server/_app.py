"""The router's ASGI application: routes, admin authentication, request and error plumbing."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
import httpx
import orjson

from belayer_router._core._config import RouterConfig
from belayer_router._core._dispatch import Dispatcher
from belayer_router._core._emit import Emit, Event, EventEmit
from belayer_router._core._journal import Journal, RequestRecord
from belayer_router._core._journal_file import JournalStore
from belayer_router._core._metrics import Metrics
from belayer_router._core._registry import Registry
from belayer_router._core._seeds import SeedSource
from belayer_router._errors import (
    BelayerRouterError,
    InternalRouterError,
    InvalidRequestError,
    JournalError,
    NotFoundError,
    UnauthorizedError,
)
from belayer_router._server._asgi import (
    Receive,
    Send,
    StreamQueue,
    direct_writer,
    read_json,
    run_unless_disconnected,
    send_error,
    send_json,
    send_text,
    session_header,
    stream_response,
)
from belayer_router._server._client_link import ClientLink
from belayer_router._server._control import ControlRoutes, WeightLoader
from belayer_router._server._openai_routes import OpenAIRoutes
from belayer_router._server._token_routes import TokenRoutes
from belayer_router._wire._protocol import (
    CLIENT_KEEP_ALIVE_S,
    MAX_TOKEN_ID,
    FinishEvent,
    GenerateRequest,
    TokenEvent,
    TokensEvent,
    encode_event,
    parse_generate_request,
)

__all__ = ["RouterApp", "RouterConfig"]

_log = logging.getLogger("belayer_router")

_MAX_ADMIN_INT = 2**63 - 1  # epochs travel as u64 on worker links; the journal writes them as JSON


def _int_field(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_ADMIN_INT:
        raise InvalidRequestError(
            f"field {name!r} must be an integer in [0, {_MAX_ADMIN_INT}], got {value!r}"
        )
    return value


def _slot_field(body: dict[str, Any]) -> str:
    slot = body.get("slot")
    if not isinstance(slot, str):
        raise InvalidRequestError(f"field 'slot' must be a string (the slot name), got {slot!r}")
    return slot


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body


def _error_line(error: BelayerRouterError) -> bytes:
    return json.dumps({"type": "error", "message": str(error), "status": error.status}).encode() + b"\n"


@attrs.define
class RouterApp(OpenAIRoutes, ControlRoutes, TokenRoutes):
    """The router as an ASGI app; serve it with `serve_router` or any ASGI server.

    ``weight_loader``: the slots' weight servers, for the control plane's weight updates
    (``POST /update_weights``); without one those routes answer 404.
    """

    config: RouterConfig = attrs.field(factory=RouterConfig)
    registry: Registry = attrs.field(factory=Registry)
    metrics: Metrics = attrs.field(factory=Metrics)
    journal: Journal = attrs.field(init=False)
    dispatcher: Dispatcher = attrs.field(init=False)
    weight_loader: WeightLoader | None = None
    _weights_lock: anyio.Lock = attrs.field(factory=anyio.Lock, init=False)
    seeds: SeedSource = attrs.field(init=False)  # the seed of a request that names none

    def __attrs_post_init__(self) -> None:
        store = None
        if self.config.journal_path is not None:
            durability = "fsync" if self.config.fsync else self.config.durability
            store = JournalStore(self.config.journal_path, durability=durability)
        self.journal = Journal(store, prefix_interval=self.config.prefix_interval)
        self.seeds = SeedSource(self.config.seed)
        for op in self.journal.load():
            try:
                self._apply_admin(op)
            except (BelayerRouterError, KeyError, TypeError) as error:
                raise JournalError(
                    f"journal {self.config.journal_path} holds a registry change that cannot be "
                    f"replayed ({op!r}: {error!r}); move the file away to start with an empty journal"
                ) from error
        timeout = httpx.Timeout(10.0, read=self.config.worker_read_timeout_s)
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=1024, keepalive_expiry=CLIENT_KEEP_ALIVE_S
        )
        client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.dispatcher = Dispatcher(
            self.registry,
            self.journal,
            self.metrics,
            client,
            self.config.resume_wait_s,
            tokenizer=self.config.tokenizer,
            read_timeout_s=self.config.worker_read_timeout_s,
        )

    def _apply_admin(self, op: dict[str, Any]) -> None:
        """Apply one registry change; the same code serves the API and a journal replay."""
        if op["op"] == "register":
            self.registry.register(op["slot"], op["url"], op["epoch"], bool(op.get("link", False)))
        elif op["op"] == "unregister":
            self.registry.unregister(op["slot"], op["epoch"])
        elif op["op"] == "slot_version":
            self.registry.set_slot_version(op["slot"], op["version"])
        elif op["op"] == "require_version":
            self.registry.require_version(op["version"])
        else:
            self.registry.mark_unhealthy(op["slot"])

    async def aclose(self) -> None:
        """Close worker connections and the journal file."""
        await self.dispatcher.client.aclose()
        if self.journal.store is not None:
            self.journal.store.close()

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            self._check_api_key(scope)
            await self._route(scope, receive, tracked)
        except Exception as raised:  # every error a client can get is a JSON body (no bare 500)
            error = _router_error(raised)
            if error is None:
                _log.error("%s %s failed", scope["method"], scope["path"], exc_info=raised)
                error = InternalRouterError(
                    f"internal error on {scope['method']} {scope['path']}: {type(raised).__name__}: "
                    f"{raised} (the router logged the traceback; please report it)"
                )
            if started:  # a streamed response ends without its last chunk; the client sees a cut
                _log.warning(
                    "%s %s failed after its response started: %s", scope["method"], scope["path"], error
                )
                return
            await send_error(send, error)

    @asynccontextmanager
    async def serving_links(self) -> AsyncIterator[None]:
        """Run worker links (one persistent connection per linked worker) for the block.

        The ASGI lifespan and `running_router` enter it; without it, linked workers are served
        one ``POST /generate`` per request, like the others.
        """
        async with anyio.create_task_group() as group:
            self.dispatcher.links.group = group
            try:
                yield
            finally:
                self.dispatcher.links.group = None
                group.cancel_scope.cancel()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        try:
            async with self.serving_links():
                while True:
                    message = await receive()
                    if message["type"] == "lifespan.startup":
                        await send({"type": "lifespan.startup.complete"})
                    elif message["type"] == "lifespan.shutdown":
                        break
        except BaseException:
            with anyio.CancelScope(shield=True):  # the journal is closed (synced) on every way out
                await self.aclose()
            raise
        # Only once the links' tasks have ended: a server treats the lifespan as over at
        # ``shutdown.complete`` and may cancel what is left of it (uvicorn logged the
        # CancelledError of links still closing as a lifespan failure).
        try:
            await self.aclose()
        except Exception as error:
            await send(
                {"type": "lifespan.shutdown.failed", "message": f"closing the router failed: {error!r}"}
            )
            raise
        await send({"type": "lifespan.shutdown.complete"})

    async def _body(self, receive: Receive) -> Any:
        return await read_json(receive, self.config.max_body_bytes)

    def _check_api_key(self, scope: dict[str, Any]) -> None:
        """`--api-key`: every route but ``GET /health`` (and ``OPTIONS``) needs one of the keys, or
        the admin token (the slots' workers hold it), as ``Authorization: Bearer <key>``."""
        keys = self.config.api_keys
        if not keys or scope["method"] == "OPTIONS" or scope["path"].rstrip("/") == "/health":
            return
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, given = header.partition(b" ")
        accepted = [*keys, *([self.config.admin_token] if self.config.admin_token else [])]
        digest = hashlib.sha256(given).digest()
        matched = False
        for key in accepted:  # no early exit: the time does not tell which key nearly matched
            matched |= hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest())
        if scheme.lower() != b"bearer" or not matched:
            raise UnauthorizedError(
                "this server needs an API key: send the header 'Authorization: Bearer <key>' with "
                "the key it was started with (--api-key or VLLM_API_KEY); the OpenAI client's api_key"
            )

    def _authorize(self, scope: dict[str, Any]) -> None:
        token = self.config.admin_token
        if token is None:
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, b"Bearer " + token.encode()):
            raise UnauthorizedError("admin call needs the header 'Authorization: Bearer <admin token>'")

    async def _route(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        method, parts = scope["method"], [p for p in scope["path"].split("/") if p]
        match method, parts:
            case "POST", ["generate"]:
                request = self.parse_generate(await self._body(receive))
                await self._generate(request, scope, receive, send)
            case "POST", ["client-link"]:
                await ClientLink(self, scope, receive, send).serve()
            case "POST", ["v1", "completions"]:
                await self._completions(await self._body(receive), scope, receive, send)
            case "POST", ["v1", "chat", "completions"]:
                await self._chat_completions(await self._body(receive), scope, receive, send)
            case "POST", ["inference", "v1", "generate"]:
                await self._inference_generate(scope, receive, send)
            case "POST", ["tokenize"]:
                await self._tokenize(receive, send)
            case "POST", ["detokenize"]:
                await self._detokenize(receive, send)
            case "GET", ["v1", "models"]:
                await send_json(send, 200, {"object": "list", "data": [self._model()]})
            case "GET", ["v1", "models", *name] if name:  # a model id may hold '/' (org/model)
                model_id = "/".join(name)
                if model_id != self.config.model_name:
                    raise NotFoundError(
                        f"no model {model_id!r}; this router serves {self.config.model_name!r} "
                        "(router option --model-name)"
                    )
                await send_json(send, 200, self._model())
            case "GET", ["health"]:
                healthy = [s for s in self.registry.slots.values() if s.healthy and s.worker is not None]
                await send_json(send, 200, {"status": "ok", "num_active_workers": len(healthy)})
            case "GET", ["metrics"]:
                await send_text(send, 200, self.metrics.render(self.registry), "text/plain; version=0.0.4")
            case "GET", ["requests", request_id]:
                record = self.journal.records.get(request_id)
                if record is None:
                    raise NotFoundError(f"no journal record for request {request_id!r}")
                await send_json(send, 200, record.as_dict())
            case _, ["workers" | "slots" | "weights", *_]:
                self._authorize(scope)
                await self._admin(method, parts, receive, send)
            case _, ["contexts", *_]:
                await self._contexts(method, parts, receive, send)
            case _, [
                "pause"
                | "resume"
                | "is_paused"
                | "get_world_size"
                | "reset_prefix_cache"
                | "update_weights"
                | "update_weights_from_disk"
                | "pause_generation"
                | "continue_generation"
                | "flush_cache"
                | "areal_pause_generation"
                | "areal_continue_generation"
                | "areal_update_weights"
                | "init_weight_transfer_engine"
                | "fetch_weights"
                | "start_weight_update"
                | "finish_weight_update" as route
            ]:
                await self._control(method, route, scope, receive, send)
            case _:
                raise NotFoundError(f"no route {method} {scope['path']}; see the belayer-router README")

    def _model(self) -> dict[str, Any]:
        return {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "belayer"}

    async def _admin(self, method: str, parts: list[str], receive: Receive, send: Send) -> None:
        match method, parts:
            case "GET", ["workers"]:
                required = self.registry.required_version
                await send_json(send, 200, {"slots": self.registry.snapshot(), "required_version": required})
            case "POST", ["workers", "register"]:
                body = _object(await self._body(receive))
                url = body.get("url")
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise InvalidRequestError(f"field 'url' must be an http(s) URL, got {url!r}")
                slot, epoch, link = _slot_field(body), _int_field(body, "epoch"), body.get("link", False)
                if not isinstance(link, bool):
                    raise InvalidRequestError(f"field 'link' must be true or false, got {link!r}")
                op = {"op": "register", "slot": slot, "url": url.rstrip("/"), "epoch": epoch}
                self._admin_change({**op, "link": True} if link else op)
                await send_json(
                    send, 200, {"slot": slot, "url": url.rstrip("/"), "epoch": epoch, "link": link}
                )
            case "POST", ["workers", "unregister"]:
                body = _object(await self._body(receive))
                slot, epoch = _slot_field(body), _int_field(body, "epoch")
                self._admin_change({"op": "unregister", "slot": slot, "epoch": epoch})
                await send_json(send, 200, {"ok": True})
            case "POST", ["slots", slot, "unhealthy"]:
                self._admin_change({"op": "unhealthy", "slot": slot})
                await send_json(send, 200, {"ok": True})
            case "POST", ["slots", slot, "weights"]:
                version = _int_field(_object(await self._body(receive)), "version")
                self._admin_change({"op": "slot_version", "slot": slot, "version": version})
                await send_json(send, 200, {"slot": slot, "weight_version": version})
            case "POST", ["weights", "required"]:
                version = _int_field(_object(await self._body(receive)), "version")
                self._admin_change({"op": "require_version", "version": version})
                await send_json(send, 200, {"required_version": version})
            case _:
                raise NotFoundError(f"no admin route {method} /{'/'.join(parts)}")

    async def _contexts(self, method: str, parts: list[str], receive: Receive, send: Send) -> None:
        match method, parts:
            case "PUT" | "POST", ["contexts", trajectory, turn]:
                token_ids = _token_ids(_object(await self._body(receive)))
                self.journal.put_context(trajectory, _parse_turn(turn), token_ids)
                await send_json(send, 200, {"trajectory_id": trajectory, "turn": _parse_turn(turn)})
            case "POST", ["contexts", trajectory, turn, "append"]:
                token_ids = _token_ids(_object(await self._body(receive)))
                length = self.journal.append_context(trajectory, _parse_turn(turn), token_ids)
                await send_json(
                    send, 200, {"trajectory_id": trajectory, "turn": _parse_turn(turn), "num_tokens": length}
                )
            case "GET", ["contexts", trajectory, *rest] if len(rest) <= 1:
                found, token_ids = self.journal.get_context(
                    trajectory, _parse_turn(rest[0]) if rest else None
                )
                await send_json(
                    send, 200, {"trajectory_id": trajectory, "turn": found, "token_ids": token_ids}
                )
            case "DELETE", ["contexts", trajectory]:
                self.journal.drop_trajectory(trajectory)
                await send_json(send, 200, {"ok": True})
            case _:
                raise NotFoundError(f"no route {method} /{'/'.join(parts)}")

    def _admin_change(self, op: dict[str, Any]) -> None:
        self._apply_admin(op)  # raises before anything is persisted if the change is refused
        self.journal.record_admin(op)

    def parse_generate(self, body: Any) -> GenerateRequest:
        """A ``POST /generate`` body (also a client link's ``OPEN``) validated, prompt length included."""
        request = parse_generate_request(body)
        if len(request.prompt_token_ids) > self.config.max_prompt_tokens:
            raise InvalidRequestError(
                f"prompt has {len(request.prompt_token_ids)} tokens, over the limit of "
                f"{self.config.max_prompt_tokens} (router option max_prompt_tokens); shorten it"
            )
        return request

    def _begin(self, request: GenerateRequest) -> RequestRecord:
        request_id = request.request_id or uuid.uuid4().hex
        existing = self.journal.records.get(request_id)
        if request.seed is not None:
            seed = request.seed
        elif existing is not None:  # a resumed request keeps the seed it began with
            seed = existing.seed
        else:
            seed = self.seeds.next(_seed_fields(request))
        record = self.journal.begin(request_id, request, seed)
        if existing is not None and existing.finish_reason is None:
            record.num_resumes += 1  # picked up again, e.g. after a router restart
            self.metrics.num_resumes += 1
        self.metrics.num_requests += 1
        return record

    async def _run(self, record: RequestRecord, emit: Emit, num_received: int) -> None:
        self.metrics.num_in_flight += 1
        try:
            await self.dispatcher.run(record, emit, num_received)
        except BelayerRouterError:
            self.metrics.num_requests_failed += 1
            raise
        finally:
            self.metrics.num_in_flight -= 1

    async def _generate(
        self, request: GenerateRequest, scope: dict[str, Any], receive: Receive, send: Send
    ) -> None:
        record = self._begin(request)
        record.session_id = session_header(scope)
        skip = request.num_received_tokens
        if not request.stream:
            events: list[Event] = []
            emit = EventEmit(events.append, request.frames)
            if not await run_unless_disconnected(receive, lambda: self._run(record, emit, skip)):
                return
            token_ids: list[int] = []
            logprobs: list[float] = []
            for event in events:
                if isinstance(event, TokenEvent):
                    token_ids.append(event.token_id)
                    logprobs.append(event.logprob)
                elif isinstance(event, TokensEvent):
                    token_ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
            finish = next(e for e in events if isinstance(e, FinishEvent))
            payload = {**attrs.asdict(finish), "token_ids": token_ids, "logprobs": logprobs}
            await send_json(send, 200, payload)
            return

        async def produce(queue: StreamQueue[Event]) -> None:
            await self._run(record, _StreamEmit(queue, request.frames), skip)

        await stream_response(
            receive,
            send,
            produce,
            _render,
            _error_line,
            "application/x-ndjson",
            direct_writer(scope),
        )


class _StreamEmit:
    """A ``/generate`` stream's `Emit`: events go to the response queue; a frame's tokens are
    rendered here to the same NDJSON bytes `encode_event` gives, with no event object, and queued
    (or written) as one piece: one write per frame."""

    __slots__ = ("frames", "put_rendered", "queue")

    def __init__(self, queue: StreamQueue[Event], frames: bool) -> None:
        self.queue, self.put_rendered, self.frames = queue, queue.put_rendered, frames

    def __call__(self, event: Event) -> None:
        self.queue(event)

    def frame(self, start: int, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if self.frames:
            payload = {"type": "tokens", "index": start, "token_ids": token_ids, "logprobs": logprobs}
            self.put_rendered(orjson.dumps(payload, option=orjson.OPT_APPEND_NEWLINE))
            return
        lines = [
            orjson.dumps(
                {"type": "token", "index": start + offset, "token_id": token_id, "logprob": logprobs[offset]},
                option=orjson.OPT_APPEND_NEWLINE,
            )
            for offset, token_id in enumerate(token_ids)
        ]
        self.put_rendered(lines[0] if len(lines) == 1 else b"".join(lines))


def _seed_fields(request: GenerateRequest) -> dict[str, Any]:
    """What makes two requests the same for `SeedSource` (not their ids, nor how they stream)."""
    fields = attrs.asdict(request)
    for name in ("request_id", "num_received_tokens", "stream", "frames", "seed"):
        fields.pop(name, None)
    return fields


def _render(events: list[Event]) -> bytes:
    """The NDJSON lines of a writer wake-up's events (usually one: no join for it)."""
    if len(events) == 1:
        return encode_event(events[0])
    return b"".join([encode_event(e) for e in events])


def _router_error(error: BaseException) -> BelayerRouterError | None:
    """The router error ``error`` is, or the one a task group wrapped it in (anyio raises every
    task's error in an `ExceptionGroup`: a 503 from a waiting request came out as a bare 500)."""
    if isinstance(error, BelayerRouterError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _router_error(inner)
            if found is not None:
                return found
    return None


def _token_ids(body: dict[str, Any]) -> list[int]:
    """The body's ``token_ids``: a list of token ids (`InvalidRequestError` naming the field)."""
    token_ids = body.get("token_ids")
    if not isinstance(token_ids, list) or not all(
        type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in token_ids
    ):
        raise InvalidRequestError(f"field 'token_ids' must be a list of token ids in [0, {MAX_TOKEN_ID}]")
    return token_ids


def _parse_turn(turn: str) -> int:
    if not turn.isdigit():
        raise InvalidRequestError(f"turn must be a non-negative integer, got {turn!r}")
    return int(turn)
