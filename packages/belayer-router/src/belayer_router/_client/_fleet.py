"""`RouterFleet`: several router processes, each owning the requests its hash picks.

Every router has its own journal and registry.  A request belongs to one router, found without
asking anyone: rendezvous (highest random weight) hashing of the request's key over the list of
router URLs.  The key is the ``trajectory_id`` when one is given (so a trajectory's contexts
``L_k`` live on one router) and the ``request_id`` otherwise.  Every client with the same router
list finds the same owner; adding a router moves only the requests the new one wins.

A router lost mid-stream is replaced on its journal: a router process started again on the same
address with the same ``--journal`` knows its preserved prefixes and registered workers, and the
owner's `RouterClient` reconnects to it (``reconnect_timeout_s``) with the request id and the
number of tokens already received, so the stream continues exactly.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Self

import anyio
import attrs

from belayer_router._client._client import Completion, RouterClient
from belayer_router._errors import BelayerRouterError, InvalidRequestError
from belayer_router._wire._protocol import FinishEvent, TokenEvent

__all__ = ["RouterFleet", "owner_index"]


def _weight(url: str, key: str) -> bytes:
    return hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest()


def owner_index(router_urls: Sequence[str], key: str) -> int:
    """Index of the router that owns ``key`` (rendezvous hashing over the router URLs)."""
    if not router_urls:
        raise InvalidRequestError("a router fleet needs at least one router URL")
    weights = [_weight(url.rstrip("/"), key) for url in router_urls]
    return max(range(len(weights)), key=weights.__getitem__)


@attrs.define
class RouterFleet:
    """A client of several routers: requests go to their owner, registrations go to every router.

    Use as ``async with RouterFleet([url0, url1, ...], admin_token=...) as fleet:``.  Workers
    register with every router (`register`, `unregister`, `mark_unhealthy` and the weight-version
    calls are broadcast);
    trainers call `generate` / `generate_stream` / the context calls as on one `RouterClient`.
    ``multiplex=True``: each router's client streams over one client link (see `RouterClient`).
    """

    router_urls: Sequence[str]
    admin_token: str | None = None
    reconnect_timeout_s: float = 30.0
    timeout_s: float = 600.0
    multiplex: bool = attrs.field(default=False, kw_only=True)
    clients: list[RouterClient] = attrs.field(init=False)
    _stack: AsyncExitStack | None = attrs.field(init=False, default=None, alias="_stack")

    def __attrs_post_init__(self) -> None:
        if not self.router_urls or len(set(self.router_urls)) != len(self.router_urls):
            raise InvalidRequestError(
                f"a router fleet needs one or more distinct router URLs, got {list(self.router_urls)!r}"
            )
        self.clients = [
            RouterClient(
                url, self.admin_token, self.reconnect_timeout_s, self.timeout_s, multiplex=self.multiplex
            )
            for url in self.router_urls
        ]

    async def __aenter__(self) -> Self:
        async with AsyncExitStack() as stack:
            for client in self.clients:  # a multiplexing client runs its link reader in there
                await stack.enter_async_context(client)
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            await self.aclose()
        else:
            await stack.__aexit__(kind, error, tb)

    async def aclose(self) -> None:
        """Close the connections to every router."""
        for client in self.clients:
            await client.aclose()

    def owner(self, key: str) -> RouterClient:
        """The client of the router that owns ``key`` (a trajectory id, else a request id)."""
        return self.clients[owner_index(self.router_urls, key)]

    async def _broadcast(self, call: Callable[[RouterClient], Coroutine[Any, Any, None]]) -> None:
        """Make the call on every router; a refusal raises the first router's error (typed)."""
        try:
            async with anyio.create_task_group() as group:
                for client in self.clients:
                    group.start_soon(call, client)
        except ExceptionGroup as errors:
            matched, _rest = errors.split(BelayerRouterError)
            if matched is None:
                raise
            first = matched.exceptions[0]
            while isinstance(first, ExceptionGroup):
                first = first.exceptions[0]
            raise first from errors

    # -- workers: every router has its own registry -----------------------------------------

    async def register(self, slot: str, url: str, epoch: int, link: bool = False) -> None:
        """Register the worker with every router (see `RouterClient.register`)."""
        await self._broadcast(lambda client: client.register(slot, url, epoch, link))

    async def unregister(self, slot: str, epoch: int) -> None:
        """Unregister the worker from every router."""
        await self._broadcast(lambda client: client.unregister(slot, epoch))

    async def mark_unhealthy(self, slot: str) -> None:
        """Mark the slot unhealthy on every router."""
        await self._broadcast(lambda client: client.mark_unhealthy(slot))

    async def report_weight_version(self, slot: str, version: int) -> None:
        """Record the slot's committed weight version on every router (`RouterClient.report_weight_version`)."""
        await self._broadcast(lambda client: client.report_weight_version(slot, version))

    async def require_weight_version(self, version: int) -> None:
        """Require the weight version on every router (see `RouterClient.require_weight_version`)."""
        await self._broadcast(lambda client: client.require_weight_version(version))

    # -- trainers: each request on its owner --------------------------------------------------

    async def generate_stream(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        trajectory_id: str | None = None,
        **options: Any,
    ) -> AsyncIterator[TokenEvent | FinishEvent]:
        """`RouterClient.generate_stream` on the owner of the trajectory (else of the request id)."""
        request_id = request_id or uuid.uuid4().hex
        client = self.owner(trajectory_id or request_id)
        stream = client.generate_stream(
            prompt_token_ids, max_tokens, request_id=request_id, trajectory_id=trajectory_id, **options
        )
        async for event in stream:
            yield event

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        trajectory_id: str | None = None,
        **options: Any,
    ) -> Completion:
        """`RouterClient.generate` on the owner of the trajectory (else of the request id)."""
        request_id = request_id or uuid.uuid4().hex
        client = self.owner(trajectory_id or request_id)
        return await client.generate(
            prompt_token_ids, max_tokens, request_id=request_id, trajectory_id=trajectory_id, **options
        )

    async def put_context(self, trajectory_id: str, turn: int, token_ids: Sequence[int]) -> None:
        """Record ``L_turn`` on the trajectory's owner."""
        await self.owner(trajectory_id).put_context(trajectory_id, turn, token_ids)

    async def append_context(self, trajectory_id: str, turn: int, token_ids: Sequence[int]) -> int:
        """Append to ``L_turn`` on the trajectory's owner (see `RouterClient.append_context`)."""
        return await self.owner(trajectory_id).append_context(trajectory_id, turn, token_ids)

    async def get_context(self, trajectory_id: str, turn: int | None = None) -> tuple[int, list[int]]:
        """``(turn, L_turn)`` from the trajectory's owner."""
        return await self.owner(trajectory_id).get_context(trajectory_id, turn)

    async def drop_trajectory(self, trajectory_id: str) -> None:
        """Forget a finished trajectory on its owner."""
        await self.owner(trajectory_id).drop_trajectory(trajectory_id)

    async def request_record(self, request_id: str, trajectory_id: str | None = None) -> dict[str, Any]:
        """The journal record of a request, from its owner."""
        return await self.owner(trajectory_id or request_id).request_record(request_id)
