"""Shared pieces of the agentic tests: the Docker engine, a real router with a scripted worker."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from agent_script import STOP, running_policy_worker

from belayer_envckpt import BelayerEnvckptError, Engine
from belayer_envckpt._spares import SHARED_TRAJECTORY
from belayer_grpo._agentic import AgenticConfig
from belayer_grpo._agentic.pool import POOL_LABEL
from belayer_router import RouterClient, RouterConfig, running_router
from belayer_router.testing import FakeWorker

ADMIN = "agentic-test-token"
# Trajectory ids of this test session carry it, so the leak check ignores concurrent sessions.
SESSION = uuid.uuid4().hex[:6]


def run_id(name: str) -> str:
    """A run id unique to this test session."""
    return f"{name}-{SESSION}"


def _is_spare(labels: dict[str, str]) -> bool:
    return labels.get("belayer.trajectory") == SHARED_TRAJECTORY


def connect_engine() -> Iterator[Engine]:
    """The real engine with CRIU; afterwards no sandbox of this test session may be left."""
    try:
        engine = Engine.connect()
        engine.require_checkpoint_support()
    except BelayerEnvckptError as error:
        pytest.fail(f"the agentic tests need Docker (experimental) and CRIU: {error}", pytrace=False)
    # A pool's spares carry the trajectory label "spare" (envckpt's shared SparePool), not the
    # session's: any spare that appears during the test and is still there afterwards leaked too.
    spares_before = {c.id for c in engine.list_containers([POOL_LABEL]) if _is_spare(c.labels)}
    yield engine
    leaked = [
        c.name
        for c in engine.list_containers([POOL_LABEL])
        if SESSION in c.labels.get("belayer.trajectory", "")
        or (_is_spare(c.labels) and c.id not in spares_before)
    ]
    engine.close()
    assert not leaked, f"sandbox containers leaked: {leaked}"


@asynccontextmanager
async def router_with_worker(
    journal_path: Path | None = None,
    **worker_options: Any,
) -> AsyncIterator[tuple[RouterClient, FakeWorker, str]]:
    """A real router (in this process, its journal at ``journal_path`` if given) with one scripted
    `FakeWorker` registered in slot ``s0``."""
    config = RouterConfig(admin_token=ADMIN, resume_wait_s=10.0, journal_path=journal_path)
    async with (
        running_router(config) as (url, _app),
        running_policy_worker(epoch=1, **worker_options) as (worker_url, worker),
        RouterClient(url, admin_token=ADMIN) as client,
    ):
        await client.register("s0", worker_url, 1)
        yield client, worker, url


def agentic_config(checkpoint_root: Path, **overrides: Any) -> AgenticConfig:
    """Small rollouts: few rounds, byte tokens with the worker's stop token."""
    settings: dict[str, Any] = {
        "checkpoint_root": checkpoint_root,
        "max_rounds": 8,
        "max_response_tokens": 200,
        "stop_token_ids": (STOP,),
        "max_concurrency": 3,
        "action_timeout_s": 30.0,
        "test_timeout_s": 60.0,
    }
    return AgenticConfig(**(settings | overrides))
