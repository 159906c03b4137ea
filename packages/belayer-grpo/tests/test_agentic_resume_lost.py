"""A begun trajectory continued from its journal while the router lost its turns is counted.

The resumed loop sends each logged turn again under its request id; a router that no longer holds
it (a new router, or one that dropped the record) generates it anew, which
``RolloutStats.num_reattach_regenerated`` (``trajectories_regenerated``) must count.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from agentic_support import agentic_config, connect_engine, run_id
from test_tooluse_sandbox import router_with_tooluse_agent

from belayer_envckpt import CheckpointStore, Engine
from belayer_grpo._agentic import RolloutStats, SandboxPool, generate_tooluse_tasks, run_agentic_rollouts
from belayer_grpo._agentic.journal import read_journals

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


@pytest.mark.parametrize("same_router", [True, False])
async def test_logged_turns_a_router_lost_count_as_regenerated(
    engine: Engine, tmp_path: Path, same_router: bool
) -> None:
    task = generate_tooluse_tasks(0, held_out=1)[1][:1]
    config = agentic_config(
        tmp_path / "ckpt", max_rounds=4, max_response_tokens=40, checkpoint_policy="always", request_ids=True,
    )  # fmt: skip
    pool = SandboxPool(
        engine, CheckpointStore(tmp_path / "ckpt"), capacity=1, reuse=True, keep_checkpoints=True
    )
    events: list[dict[str, Any]] = []
    stats = RolloutStats()
    name = run_id(f"lost-{same_router}")
    try:
        async with router_with_tooluse_agent() as client:
            with anyio.fail_after(240):
                (first,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, note=events.append
                )
                # Killed after turn 2's action: its checkpoint is not logged.
                journals = read_journals(events[:3])
                if same_router:
                    (again,) = await run_agentic_rollouts(
                        task, client, config, engine=engine, pool=pool, run_id=name, resume=journals,
                        stats=stats,
                    )  # fmt: skip
        if not same_router:
            async with router_with_tooluse_agent() as fresh:  # holds none of the turns
                with anyio.fail_after(240):
                    (again,) = await run_agentic_rollouts(
                        task, fresh, config, engine=engine, pool=pool, run_id=name, resume=journals,
                        stats=stats,
                    )  # fmt: skip
    finally:
        await pool.aclose()
    assert first.reward == 1.0, first.test_output
    assert again.token_ids == first.token_ids  # the scripted agent answers the same
    assert (again.reward, again.num_actions) == (1.0, 2), again.test_output
    assert stats.num_reattached == 1
    assert stats.num_actions_replayed == 1  # `cat a` after the logged checkpoint of turn 1
    assert stats.num_restored_from_checkpoint == 1
    assert stats.num_reattach_regenerated == (0 if same_router else 1)
