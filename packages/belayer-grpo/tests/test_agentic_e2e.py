"""End to end on real Docker + CRIU, a real router and the real policy; only the LLM is scripted.

Sandboxes are killed with probability 0.2 per environment step.  Every trajectory must finish
(no sample lost), solve its task, and every recovery must be prefix-consistent: the restored
repository hashes to what the checkpoint recorded and the context reloaded from the router is
the ``L_k`` the checkpoint names.  The scripted actions append to ``notes.txt`` (not idempotent),
and each script ends with ``cat notes.txt``: the final observation must list every action once,
in order, so no action was lost or replayed into the final environment.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from agent_script import running_policy_worker
from agentic_support import agentic_config, connect_engine, router_with_worker, run_id

from belayer_envckpt import Engine
from belayer_grpo._agentic import (
    AgenticTrajectory,
    build_task_image,
    builtin_tasks,
    run_agentic_rollouts,
    summarize,
)
from belayer_router import ByteTokenizer

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

EXPECTED_NOTES = {
    "belayer__calc-1": "c1\nc2\nc3\n",
    "belayer__words-1": "w1\nw2\n",
    "belayer__countdown-1": "d1\nd2\n",
}
NUM_ACTIONS = {"belayer__calc-1": 4, "belayer__words-1": 3, "belayer__countdown-1": 3}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio only


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    return build_task_image(engine, builtin_tasks())


def final_notes(trajectory: AgenticTrajectory) -> str:
    text = ByteTokenizer().decode([t for t in trajectory.token_ids if t < 256])
    last = text.rsplit("<observation exit=0>\n", 1)[1]
    return last.split("</observation>", 1)[0]


def check_complete(trajectories: list[AgenticTrajectory], num_samples: int) -> None:
    tasks = [t.instance_id for t in builtin_tasks()]
    assert [t.task_id for t in trajectories] == [task for task in tasks for _ in range(num_samples)]
    for trajectory in trajectories:
        assert trajectory.finish == "submit", trajectory.summary()
        assert trajectory.reward == 1.0, trajectory.test_output
        assert trajectory.num_actions == NUM_ACTIONS[trajectory.task_id]
        assert final_notes(trajectory) == EXPECTED_NOTES[trajectory.task_id]
        assert trajectory.prefix_consistent, trajectory.summary()["recoveries"]
        assert len(trajectory.loss_mask) == len(trajectory.token_ids) == len(trajectory.logprobs)
        generated = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
        assert generated.count(256) == trajectory.rounds  # one stop token per response kept
        for recovery in trajectory.recoveries:
            assert recovery.expected_repo_hash == recovery.actual_repo_hash
            assert recovery.restored_prefix <= recovery.failed_prefix


@pytest.mark.parametrize("policy", ["adaptive", "never"])
async def test_chaos_every_trajectory_completes_prefix_consistent(
    engine: Engine, image: str, tmp_path: Path, policy: str
) -> None:
    config = agentic_config(
        tmp_path / "ckpt", image=image, checkpoint_policy=policy, sandbox_kill_probability=0.2, seed=7
    )
    async with router_with_worker(token_delay_s=0.01) as (client, _worker, _url):
        trajectories = await run_agentic_rollouts(
            builtin_tasks(), client, config, num_samples=1, engine=engine, run_id=run_id(f"chaos-{policy}")
        )
    check_complete(trajectories, 1)
    totals = summarize(trajectories)
    assert totals["num_failures"] > 0  # chaos hit (the injector is seeded, so this is fixed)
    assert totals["all_prefix_consistent"]
    if policy == "never":
        assert totals["num_checkpoints"] == 0
        assert all(not r.from_checkpoint for t in trajectories for r in t.recoveries)
        assert all(r.restored_prefix == 0 for t in trajectories for r in t.recoveries)
    assert not any((tmp_path / "ckpt").glob("*/*")), "checkpoints of finished trajectories remain"


async def test_always_recovers_from_checkpoints_not_from_scratch(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    config = agentic_config(
        tmp_path / "ckpt", image=image, checkpoint_policy="always", sandbox_kill_probability=0.2, seed=7
    )
    async with router_with_worker() as (client, _worker, _url):
        trajectories = await run_agentic_rollouts(
            builtin_tasks(), client, config, engine=engine, run_id=run_id("chaos-always")
        )
    check_complete(trajectories, 1)
    recoveries = [r for t in trajectories for r in t.recoveries]
    restored = [r for r in recoveries if r.from_checkpoint]
    assert restored, [r.to_dict() for r in recoveries]
    for recovery in restored:
        assert recovery.restored_prefix >= 1
        assert recovery.restore_timings_ms["total_ms"] > 0
        # Only the rounds after the checkpoint were generated again.
        assert recovery.rounds_regenerated == recovery.failed_turn - recovery.restored_turn
    # Only the stateless init runs in these sandboxes (every action is an exec that exits): the
    # checkpoints are the layer only (fresh-runtime), or a reference when an action changed
    # nothing; never CRIU. Each restore went by its checkpoint's kind.
    kinds = [c.kind for t in trajectories for c in t.checkpoints]
    assert kinds
    assert set(kinds) <= {"fresh-runtime", "reference"}, kinds
    assert {r.restored_kind for r in restored} <= {"fresh-runtime", "reference"}
    assert summarize(trajectories)["checkpoints_by_kind"]["full"] == 0


async def test_worker_killed_mid_rollout_is_replaced_and_nothing_is_lost(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    """The worker dies mid-response; a replacement registers with epoch 2 (as a shadow would)."""
    config = agentic_config(
        tmp_path / "ckpt", image=image, checkpoint_policy="adaptive", sandbox_kill_probability=0.2, seed=3
    )
    async with (
        router_with_worker(die_after_total=300, token_delay_s=0.002) as (client, first, _url),
        running_policy_worker(epoch=2) as (shadow_url, shadow),
    ):

        async def hand_over() -> None:
            await first.died.wait()
            await client.register("s0", shadow_url, 2)

        async with anyio.create_task_group() as group:
            group.start_soon(hand_over)
            trajectories = await run_agentic_rollouts(
                builtin_tasks(), client, config, num_samples=2, engine=engine, run_id=run_id("worker-kill")
            )
            group.cancel_scope.cancel()
    assert first.dead
    assert shadow.num_tokens_sent > 0
    check_complete(trajectories, 2)
    totals = summarize(trajectories)
    assert totals["all_prefix_consistent"]
    assert totals["num_resumed_responses"] >= 1  # the interrupted response was resumed, not redone
