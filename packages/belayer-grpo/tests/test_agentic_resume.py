"""A begun trajectory continues from its journal, in real sandboxes with a scripted agent.

A tool-use trajectory (store a value, read it back, answer) runs once with its journal noted
(`belayer_grpo._agentic.journal`); then the same trajectory id runs again from a cut of that journal,
as a trainer that adopted a killed one's router would: its turns re-sent under the same ids, the
logged actions' results taken from the journal, its sandbox rebuilt at the last logged turn, from
the logged checkpoint when there is one (only the actions after it run again) or from a fresh
sandbox (every logged action runs again).  The continued trajectory is the same, token for token.
And a router that lost the logged turns (a new router, or one that dropped the record) generates
them anew, which ``RolloutStats.num_reattach_regenerated`` (``trajectories_regenerated``) counts.
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
from belayer_grpo._agentic import (
    AgenticConfig,
    RolloutStats,
    SandboxPool,
    ToolUseTask,
    generate_tooluse_tasks,
    run_agentic_rollouts,
)
from belayer_grpo._agentic.journal import read_journals

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


def _one_task(engine: Engine, tmp_path: Path) -> tuple[list[ToolUseTask], AgenticConfig, SandboxPool]:
    """One held-out tool-use task, settings that checkpoint every step under derivable request ids,
    and a pool that keeps its checkpoints (a resumed run restores them)."""
    task = generate_tooluse_tasks(0, held_out=1)[1][:1]
    config = agentic_config(
        tmp_path / "ckpt", max_rounds=4, max_response_tokens=40, checkpoint_policy="always", request_ids=True,
    )  # fmt: skip
    pool = SandboxPool(
        engine, CheckpointStore(tmp_path / "ckpt"), capacity=1, reuse=True, keep_checkpoints=True
    )
    return task, config, pool


@pytest.mark.parametrize(
    ("kept", "replayed", "restored"),
    [
        (("action", "checkpoint", "action"), 1, True),  # killed before turn 2's checkpoint: `cat` again
        (("action", "action"), 2, False),  # no checkpoint logged: both actions in a fresh sandbox
    ],
)
async def test_a_begun_trajectory_continues_where_its_journal_ends(
    engine: Engine, tmp_path: Path, kept: tuple[str, ...], replayed: int, restored: bool
) -> None:
    task, config, pool = _one_task(engine, tmp_path)
    events: list[dict[str, Any]] = []
    stats = RolloutStats()
    name = run_id(f"resume-{len(kept)}")
    try:
        async with router_with_tooluse_agent() as client:
            with anyio.fail_after(240):
                (first,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, note=events.append
                )
                assert [e["event"] for e in events] == ["action", "checkpoint", "action", "checkpoint"]
                assert [e["turn"] for e in events] == [1, 1, 2, 2]
                # The journal as a kill left it: the events of `kept`, in order.
                cut, rest = [], list(events)
                for kind in kept:
                    while rest[0]["event"] != kind:
                        rest.pop(0)
                    cut.append(rest.pop(0))
                journals = read_journals(cut)
                assert list(journals) == [f"{name}-g0-s0"]
                (again,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, resume=journals, stats=stats
                )
    finally:
        await pool.aclose()
    assert first.reward == 1.0, first.test_output
    assert (again.token_ids, again.logprobs, again.loss_mask) == (
        first.token_ids,
        first.logprobs,
        first.loss_mask,
    )
    assert (again.reward, again.finish, again.num_actions) == (1.0, "answer", 2), again.test_output
    assert stats.num_reattached == 1
    assert stats.num_actions_replayed == replayed
    assert stats.num_restored_from_checkpoint == int(restored)
    assert stats.num_reattach_regenerated == 0
    assert stats.num_reattach_inconsistent == 0
    if restored:  # the restored checkpoint is the logged one, and it stays the trajectory's first
        assert again.checkpoints[0].checkpoint is not None
        assert again.checkpoints[0].checkpoint.checkpoint_id == cut[1]["checkpoint_id"]
    assert not again.recoveries  # continuing is not a sandbox failure


@pytest.mark.parametrize("same_router", [True, False])
async def test_logged_turns_a_router_lost_count_as_regenerated(
    engine: Engine, tmp_path: Path, same_router: bool
) -> None:
    task, config, pool = _one_task(engine, tmp_path)
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
