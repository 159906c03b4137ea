"""A hung router (SIGSTOP of a real ``belayer-router serve``): nothing in Belayer detects it; a
``RouterClient`` times out (``timeout_s``), reconnects with the tokens it has, and its stream
finishes exactly once the router runs again (within ``reconnect_timeout_s``).  The fault matrix's
router/SIGSTOP row (docs/architecture.md)."""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest
from router_helpers import ADMIN_TOKEN, StartRouter

from belayer_router import FinishEvent, RouterClient, TokenEvent
from belayer_router.testing import expected_tokens, running_worker

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers


async def test_a_stopped_router_times_the_client_out_and_the_stream_resumes_once_it_runs(
    tmp_path: Path, router_process: StartRouter
) -> None:
    router, url = await router_process(tmp_path / "router.jsonl")
    async with (
        running_worker(1, token_delay_s=0.01) as (worker_url, _),
        RouterClient(url, admin_token=ADMIN_TOKEN, timeout_s=1.0, reconnect_timeout_s=120) as client,
    ):
        await client.register("s0", worker_url, 1)
        tokens: list[int] = []
        finish: FinishEvent | None = None
        stopped = anyio.Event()

        async def hang_for_a_while() -> None:
            await stopped.wait()
            await anyio.sleep(3.0)  # several of the client's timeouts
            router.send_signal(signal.SIGCONT)

        async with anyio.create_task_group() as group:
            group.start_soon(hang_for_a_while)
            async for event in client.generate_stream([1, 2], 40, seed=3, request_id="hung"):
                if isinstance(event, FinishEvent):
                    finish = event
                elif isinstance(event, TokenEvent):
                    tokens.append(event.token_id)
                if len(tokens) == 10 and not stopped.is_set():
                    router.send_signal(signal.SIGSTOP)
                    stopped.set()
        assert tokens == expected_tokens(3, 40)
        assert finish is not None  # through a 3 s hang, with a 1 s read timeout: by reconnecting
