"""The agentic loop on belayer-shadow's real engine slot: the main worker is killed mid-rollout.

The slot serves the small built-in model from a seeded init, so its responses are noise: in
``feedback`` mode each one is answered with a hint and the trajectory runs its rounds through the
real router and the real worker.  The main worker is SIGKILLed while responses stream; the shadow
takes over and the router resumes the interrupted responses.  No sample is lost: every
trajectory finishes its rounds with a complete, well-formed context and a reward from its tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from agentic_support import ADMIN, agentic_config, connect_engine, run_id

from belayer_envckpt import Engine
from belayer_grpo._agentic import build_task_image, builtin_tasks, run_agentic_rollouts, summarize
from belayer_router import RouterClient, RouterConfig, running_router
from belayer_shadow import ModelConfig, SlotConfig, SlotSupervisor

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


async def test_real_worker_killed_mid_rollout_shadow_takes_over_nothing_lost(
    engine: Engine, tmp_path: Path
) -> None:
    image = await anyio.to_thread.run_sync(build_task_image, engine, builtin_tasks())
    model = tmp_path / "model.json"
    model.write_text(json.dumps(ModelConfig.default().to_dict()))
    config = agentic_config(
        tmp_path / "ckpt", image=image, invalid_action="feedback", max_rounds=4, max_response_tokens=24
    )
    async with (
        running_router(RouterConfig(admin_token=ADMIN, resume_wait_s=30.0)) as (url, _app),
        RouterClient(url, admin_token=ADMIN) as client,
    ):
        slot = SlotSupervisor(
            SlotConfig(
                slot="s0",
                router_url=url,
                run_dir=tmp_path / "slot",
                admin_token=ADMIN,
                model=model,
                # The kill is a crash, seen at once by the supervisor; a generous hang threshold
                # keeps a loaded 2-core machine's late heartbeats from counting as a second failure.
                stale_s=10.0,
            )
        )
        try:
            await anyio.to_thread.run_sync(slot.start)
            await anyio.to_thread.run_sync(slot.wait_protected, 120.0)

            async def kill_mid_rollout() -> None:
                while not any(s.get("num_outstanding") for s in await client.workers()):  # noqa: ASYNC110
                    await anyio.sleep(0.005)
                await anyio.sleep(0.05)
                slot.kill_main()

            with anyio.fail_after(300):
                async with anyio.create_task_group() as group:
                    group.start_soon(kill_mid_rollout)
                    trajectories = await run_agentic_rollouts(
                        builtin_tasks(), client, config, num_samples=2, engine=engine, run_id=run_id("shadow")
                    )
                    group.cancel_scope.cancel()  # if the kill never came, the handover check fails
            await anyio.to_thread.run_sync(slot.wait_handovers, 1, 60.0)
        finally:
            await anyio.to_thread.run_sync(slot.stop)
    assert slot.num_handovers == 1
    assert len(trajectories) == 6  # no sample lost
    totals = summarize(trajectories)
    assert totals["num_resumed_responses"] >= 1
    for trajectory in trajectories:
        assert (trajectory.finish, trajectory.rounds) in {
            ("max_rounds", 4),
            ("context_full", trajectory.rounds),
        }
        generated = sum(trajectory.loss_mask)
        assert 1 <= generated <= 4 * 24
        assert all(lp <= 0.0 for lp in trajectory.logprobs)
        assert trajectory.reward == 0.0  # noise does not fix bugs
