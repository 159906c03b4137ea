"""The task image, the sandbox pool and the loop's episode endings, on the real Docker engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from agentic_support import agentic_config, connect_engine, router_with_worker, run_id

from belayer_envckpt import CheckpointStore, Engine, Sandbox, full_checkpoint
from belayer_grpo._agentic import (
    SandboxImageError,
    SandboxPool,
    build_task_image,
    builtin_tasks,
    repository_hash,
    run_agentic_rollouts,
)

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    return build_task_image(engine, builtin_tasks())


def test_the_image_is_built_once_per_content_and_holds_failing_tasks(engine: Engine, image: str) -> None:
    assert build_task_image(engine, builtin_tasks()) == image
    result = engine.run(
        image,
        [
            "sh",
            "-c",
            "ls /workspace /opt/belayer-tasks && cd /workspace/calc_add && python3 -m unittest -q; true",
        ],
    )
    text = result.stdout + result.stderr
    assert text.split()[:3] == ["/opt/belayer-tasks:", "calc_add", "countdown"]
    assert "FAILED (failures=1)" in text


def test_a_missing_base_image_is_a_clear_error(engine: Engine) -> None:
    with pytest.raises(SandboxImageError, match="scripts/setup-system"):
        build_task_image(engine, builtin_tasks(), base_image="belayer/absent:latest")


async def test_pool_bounds_live_sandboxes_and_cleans_up_containers_and_checkpoints(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    pool = SandboxPool(engine, store, capacity=1)
    workdir = builtin_tasks()[0].workdir
    entered: list[str] = []
    first, second = run_id("pool-a"), run_id("pool-b")

    async def hold_first(ready: anyio.Event, release: anyio.Event) -> None:
        async with pool.lease(first, image, workdir) as lease:
            first_id = lease.sandbox.id
            base = await anyio.to_thread.run_sync(repository_hash, lease.sandbox, workdir)
            await anyio.to_thread.run_sync(lease.sandbox.exec, "echo changed >> calc.py")
            local = lease.sandbox
            assert isinstance(local, Sandbox)  # the single-machine pool's own sandbox
            await anyio.to_thread.run_sync(lambda: full_checkpoint(local, first, store=store))
            assert store.list(first)
            fresh = await lease.restart()
            assert fresh.id != first_id
            assert await anyio.to_thread.run_sync(repository_hash, fresh, workdir) == base
            assert first_id not in [c.id for c in engine.list_containers()]
            ready.set()
            await release.wait()

    async def take_second() -> None:
        async with pool.lease(second, image, workdir):
            entered.append(second)

    try:
        ready, release = anyio.Event(), anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(hold_first, ready, release)
            await ready.wait()
            group.start_soon(take_second)
            await anyio.sleep(0.3)
            assert entered == []  # capacity 1: the second lease waits
            assert pool.num_live == 1
            release.set()
        assert entered == [second]
        assert pool.num_live == 0
        assert not (tmp_path / "ckpt" / first).exists()
    finally:
        await pool.aclose()


async def test_a_response_without_an_action_ends_the_episode_with_the_tests_reward(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    config = agentic_config(tmp_path / "ckpt", image=image)
    async with router_with_worker(scripts={}) as (client, _worker, _url):
        [trajectory] = await run_agentic_rollouts(
            builtin_tasks()[:1], client, config, engine=engine, run_id=run_id("no-action")
        )
    assert trajectory.finish == "no_action"
    assert (trajectory.rounds, trajectory.num_actions, trajectory.reward) == (1, 0, 0.0)
    assert "FAILED" in trajectory.test_output


async def test_feedback_mode_answers_invalid_actions_until_the_round_or_context_limit(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    config = agentic_config(tmp_path / "ckpt", image=image, invalid_action="feedback", max_rounds=3)
    async with router_with_worker(scripts={}) as (client, _worker, _url):
        [rounds] = await run_agentic_rollouts(
            builtin_tasks()[:1], client, config, engine=engine, run_id=run_id("no-action")
        )
        small = agentic_config(
            tmp_path / "ckpt", image=image, invalid_action="feedback", max_context_tokens=400
        )
        [full] = await run_agentic_rollouts(
            builtin_tasks()[:1], client, small, engine=engine, run_id=run_id("full")
        )
    assert (rounds.finish, rounds.rounds, rounds.num_actions) == ("max_rounds", 3, 0)
    assert rounds.token_ids.count(ord("<")) >= 3
    assert full.finish == "context_full"
    assert len(full.token_ids) >= 400
