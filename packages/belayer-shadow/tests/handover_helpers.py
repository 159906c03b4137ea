"""Helpers of the failover tests: a real router on loopback, supervised slots, concurrent clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio

from belayer_router import FinishEvent, RouterApp, RouterClient, RouterConfig, TokenEvent, running_router
from belayer_shadow import SlotConfig, SlotSupervisor

TOKEN = "test-admin-token"
PROMPTS = [[10 + i, 20 + 3 * i, 30, 40 + i, 50] for i in range(4)]


@asynccontextmanager
async def router(resume_wait_s: float = 30.0) -> AsyncIterator[tuple[str, RouterApp]]:
    """A router in this process on loopback."""
    async with running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=resume_wait_s)) as (url, app):
        yield url, app


@asynccontextmanager
async def supervised(
    url: str, run_dir: Path, slot: str = "s0", *, protected: bool = True, **options: Any
) -> AsyncIterator[SlotSupervisor]:
    """A started slot (waiting for its shadow to stand by when `protected`); stopped at the end.

    A hang is 3 s without a heartbeat here (the default 0.5 s): on a loaded 2-core machine a main's
    heartbeat was once 0.55 s late, the shadow took over before the test's own kill, and the kill
    then hit the new main (a second failure: slot unhealthy)."""
    options.setdefault("stale_s", 3.0)
    config = SlotConfig(
        slot=slot, router_url=url, run_dir=run_dir, admin_token=TOKEN, num_kv_blocks=256, **options
    )
    supervisor = SlotSupervisor(config)
    await anyio.to_thread.run_sync(supervisor.start)
    try:
        if protected:
            await anyio.to_thread.run_sync(supervisor.wait_protected)
        yield supervisor
    finally:
        await anyio.to_thread.run_sync(supervisor.stop)


async def generate_all(url: str, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy completions of all prompts, concurrently."""
    results: list[list[int]] = [[] for _ in prompts]
    async with RouterClient(url) as client:

        async def one(i: int) -> None:
            completion = await client.generate(prompts[i], max_tokens, temperature=0.0, seed=i)
            results[i] = completion.token_ids

        async with anyio.create_task_group() as group:
            for i in range(len(prompts)):
                group.start_soon(one, i)
    return results


class Streams:
    """Concurrent greedy streams whose progress the test can wait on (to fail things mid-generation)."""

    def __init__(self, url: str, prompts: Sequence[list[int]], max_tokens: int) -> None:
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.indices: list[list[int]] = [[] for _ in prompts]
        self.finishes: list[FinishEvent | None] = [None for _ in prompts]

    async def run(self) -> None:
        """Stream every prompt to completion, recording every event."""
        async with RouterClient(self.url) as client, anyio.create_task_group() as group:
            for i in range(len(self.prompts)):
                group.start_soon(self._one, client, i)

    async def _one(self, client: RouterClient, i: int) -> None:
        async for event in client.generate_stream(self.prompts[i], self.max_tokens, temperature=0.0, seed=i):
            if isinstance(event, TokenEvent):
                self.tokens[i].append(event.token_id)
                self.indices[i].append(event.index)
            else:
                self.finishes[i] = event

    async def wait_tokens(self, count: int, limit: float = 60.0) -> None:
        """Until every stream has received at least `count` tokens."""
        with anyio.fail_after(limit):
            while min(len(t) for t in self.tokens) < count:  # noqa: ASYNC110 (no event to wait on)
                await anyio.sleep(0.005)
