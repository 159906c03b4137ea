"""`SandboxPool` restores with its run-wide shared spares (``spares``): a restore of a checkpoint
another pool of the run took (a killed trainer's, on ``--resume``) hands over a sandbox of this pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from agentic_support import connect_engine, run_id

from belayer_envckpt import Checkpoint, CheckpointStore, Engine, Sandbox
from belayer_grpo._agentic import SandboxPool, generate_tooluse_tasks
from belayer_grpo._agentic.pool import POOL_LABEL
from belayer_grpo._guardian import RUN_LABEL

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


async def _checkpoint_of(pool: SandboxPool, trajectory: str, image: str, workdir: str) -> Checkpoint:
    """A ``fresh-runtime`` checkpoint (a file written, no process left) of a lease of ``pool``."""
    async with pool.lease(trajectory, image, workdir) as lease:
        sandbox = lease.sandbox
        await anyio.to_thread.run_sync(lambda: sandbox.exec("echo 7 > a"))
        record = await anyio.to_thread.run_sync(
            lambda: pool.take_checkpoint(
                sandbox, trajectory=trajectory, prefix=1, turn=1, workdir=workdir, context_hash="c"
            )
        )
    assert record.checkpoint is not None
    assert record.kind == "fresh-runtime", record
    return record.checkpoint


async def test_a_restore_of_another_pools_checkpoint_carries_this_pool_and_takes_its_spare(
    engine: Engine, tmp_path: Path
) -> None:
    """A resumed trainer's pool restores the killed trainer's checkpoints (same run, same store,
    another pool id): the restored sandbox is this pool's (its label: what `aclose` and the
    lease's sweep remove by), and the restore goes into this pool's spare of that configuration."""
    task = generate_tooluse_tasks(0, held_out=3)[1][0]
    image, workdir = task.image or "", task.workdir
    trajectory, run = run_id("other-pool"), {RUN_LABEL: run_id("other-run")}
    store = CheckpointStore(tmp_path / "ckpt")
    killed = SandboxPool(engine, store, capacity=1, keep_checkpoints=True, labels=run)
    try:
        checkpoint = await _checkpoint_of(killed, trajectory, image, workdir)
    finally:
        await killed.aclose()
    resumed = SandboxPool(engine, store, capacity=1, labels=run, spares=1)
    try:
        await resumed.warm_spares(image, workdir)
        async with resumed.lease(trajectory, image, workdir) as lease:
            current = lease.sandbox
            sandbox = await anyio.to_thread.run_sync(lambda: resumed.restore(checkpoint, current))
            await lease.replace(sandbox)
            assert isinstance(sandbox, Sandbox)
            labels = sandbox.inspect()["Config"]["Labels"]
            assert labels[POOL_LABEL] == resumed.pool_id
            assert labels[RUN_LABEL] == run[RUN_LABEL]
            assert "spare_ms" in sandbox.restore_timings_ms, sandbox.restore_timings_ms
            held = await anyio.to_thread.run_sync(lambda: sandbox.exec("cat a"))
            assert held.stdout.strip() == "7"
    finally:
        await resumed.aclose()
    assert not engine.list_containers([f"{RUN_LABEL}={run[RUN_LABEL]}"])
