"""The tool-use tasks in real sandboxes with a scripted agent: the task depends on the sandbox's
state, so a recovery that loses it (the `image` control) turns right answers into wrong ones,
while checkpoint recovery (or a replay from scratch) keeps every answer right."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from agent_script import STOP
from agentic_support import ADMIN, agentic_config, connect_engine, run_id

from belayer_envckpt import CheckpointStore, Engine, Sandbox, full_checkpoint
from belayer_grpo._agentic import SandboxPool, generate_tooluse_tasks, run_agentic_rollouts
from belayer_grpo._guardian import RUN_LABEL
from belayer_router import ByteTokenizer, RouterClient, RouterConfig, running_router
from belayer_router.testing import running_worker, text_script

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


def tooluse_response(prompt: str) -> str:
    """A perfect agent: store the value, read it back, answer from what it read."""
    task = re.match(r"Save (\d+) to file a, ", prompt)
    if task is None:
        return "I do not know this task."
    observations = re.findall(r"OUT (-?\d+): (.*)\n", prompt)
    if not observations:
        return f"ACTION: echo {task.group(1)} > a\n"
    if len(observations) == 1:
        return "ACTION: cat a\n"
    exit_code, output = observations[-1]
    read = output.strip() if exit_code == "0" else ""
    return f"ANSWER: {read}\n"


@asynccontextmanager
async def router_with_tooluse_agent(
    respond: Callable[[str], str] = tooluse_response,
) -> AsyncIterator[RouterClient]:
    """A new router (none of the earlier turns) whose scripted worker answers ``respond``."""
    script = text_script(ByteTokenizer(), respond, STOP)
    async with (
        running_router(RouterConfig(admin_token=ADMIN, resume_wait_s=10.0)) as (url, _app),
        running_worker(1, script=script) as (worker_url, _worker),
        RouterClient(url, admin_token=ADMIN) as client,
    ):
        await client.register("s0", worker_url, 1)
        yield client


@pytest.mark.parametrize(
    ("recovery", "policy", "reward", "consistent", "from_checkpoint", "restored_prefix"),
    [
        ("checkpoint", "always", 1.0, True, True, 1),  # restored after the store: only `cat` again
        ("checkpoint", "never", 1.0, True, False, 0),  # no checkpoint: replayed from the image and prompt
        ("image", "always", 0.0, False, False, 1),  # the control: state lost, the agent goes on
    ],
)
async def test_a_kill_after_the_read_is_harmless_only_when_the_state_comes_back(
    engine: Engine, tmp_path: Path, recovery: str, policy: str, reward: float, consistent: bool,
    from_checkpoint: bool, restored_prefix: int,
) -> None:  # fmt: skip
    tasks = generate_tooluse_tasks(0, held_out=3)[1]
    config = agentic_config(
        tmp_path / "ckpt", max_rounds=4, max_response_tokens=40, checkpoint_policy=policy,
        sandbox_kill_at_actions=(2,), sandbox_recovery=recovery, max_concurrency=3,
    )  # fmt: skip
    run = {RUN_LABEL: run_id(f"spares-{recovery}-{policy}")}  # as `belayer-grpo train` labels its pool
    pool = SandboxPool(
        engine, CheckpointStore(tmp_path / "ckpt"), capacity=3, reuse=True, labels=run, spares=1
    )
    try:
        await pool.warm_spares(tasks[0].image or "", tasks[0].workdir)  # ready before the first kill
        async with router_with_tooluse_agent() as client:
            with anyio.fail_after(240):
                trajectories = await run_agentic_rollouts(
                    tasks, client, config, num_samples=2, engine=engine, pool=pool,
                    run_id=run_id(f"tool-{recovery}-{policy}"),
                )  # fmt: skip
        # The run's spare (refilled), found by the run's label (what the guardian reaps by).
        await pool.warm_spares(tasks[0].image or "", tasks[0].workdir)
        labelled = engine.list_containers([f"{RUN_LABEL}={run[RUN_LABEL]}"])
        assert [c.labels["belayer.trajectory"] for c in labelled].count("spare") == 1
    finally:
        await pool.aclose()
    assert not engine.list_containers([f"{RUN_LABEL}={run[RUN_LABEL]}"])  # no spare left behind
    into_spare = [r.into_spare for t in trajectories for r in t.recoveries]
    # A checkpoint's restore (fresh-runtime: `echo > a` leaves only the init) went into the spare.
    assert any(into_spare) is from_checkpoint, into_spare
    assert len(trajectories) == 6
    if not from_checkpoint:  # 6 trajectories on at most 3 sandboxes (restored ones are not reused)
        assert pool.num_reused >= 1
    for trajectory in trajectories:
        assert trajectory.finish == "answer", trajectory.test_output
        (recovery_record,) = trajectory.recoveries  # the forced kill, once per trajectory
        assert recovery_record.failed_prefix == 1
        assert recovery_record.failed_turn == 2
        assert recovery_record.from_checkpoint is from_checkpoint
        assert recovery_record.restored_prefix == restored_prefix
        assert recovery_record.prefix_consistent is consistent
        assert trajectory.reward == reward, trajectory.test_output
    if recovery == "image":
        assert all("can't open" in t.test_output for t in trajectories)
    assert not list((tmp_path / "ckpt").glob("*/*"))  # every trajectory's checkpoints went with it


async def test_a_reused_sandbox_has_no_leftover_process_or_file_and_checkpoints(
    engine: Engine, tmp_path: Path
) -> None:
    store = CheckpointStore(tmp_path / "ckpt")
    pool = SandboxPool(engine, store, capacity=1, reuse=True)
    sleeping = "grep -q sleep /proc/$(cat /tmp/sleeper.pid)/cmdline"
    try:
        async with pool.lease("reuse-1", "belayer/busybox", "/work") as first:
            box = first.sandbox
            await anyio.to_thread.run_sync(lambda: box.exec("echo left > f; echo hidden > .h; mkdir d"))
            await anyio.to_thread.run_sync(
                lambda: box.exec("sleep 1000 > /dev/null 2>&1 & echo $! > /tmp/sleeper.pid")
            )
            assert (await anyio.to_thread.run_sync(lambda: box.exec(sleeping))).exit_code == 0
        async with pool.lease("reuse-2", "belayer/busybox", "/work") as second:
            reused = second.sandbox
            assert isinstance(reused, Sandbox)  # the single-machine pool's own sandbox
            assert reused.id == box.id
            assert pool.num_reused == 1
            listing = await anyio.to_thread.run_sync(lambda: reused.exec("ls -A /work"))
            assert (listing.exit_code, listing.stdout) == (0, "")  # emptied, hidden files too
            assert (await anyio.to_thread.run_sync(lambda: reused.exec(sleeping))).exit_code != 0
            kept = await anyio.to_thread.run_sync(lambda: reused.exec("cat /tmp/sleeper.pid"))
            assert kept.exit_code == 0  # outside the working directory: not reset (documented)
            # The directory was emptied, not deleted: CRIU checkpoints the reused sandbox.
            checkpoint = await anyio.to_thread.run_sync(
                lambda: full_checkpoint(reused, "reuse-2", prefix=reused.prefix, context_ref="c", store=store)
            )
            assert checkpoint.prefix == reused.prefix == 3
    finally:
        await pool.aclose()
    assert not engine.list_containers([f"belayer.grpo.pool={pool.pool_id}"])
