"""The build tasks (the default workload's) in real sandboxes with a scripted agent.

`mk V` takes seconds, writes the file `a` and shows a build id that differs on every run; the
agent reads the file back (`cat a`) and answers.  Each trajectory's sandbox is killed right after
the read (action 2), after the agent saw the id.  A checkpoint restore brings back the very build
the agent saw (prefix-consistent, reward 1), a restart from scratch regenerates the whole
trajectory (consistent, reward 1, but the build runs again), and a verbatim replay of the actions
(what a harness without Belayer does) builds another id: the replayed `mk` differs from what the
agent saw, the recovery is flagged inconsistent and the right agent's reward is 0.
"""

from __future__ import annotations

import random
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from agent_script import STOP
from agentic_support import ADMIN, agentic_config, connect_engine, run_id

from belayer_envckpt import CheckpointStore, Engine, Sandbox, SandboxConfig
from belayer_grpo._agentic import SandboxPool, ToolObservation, generate_tooluse_tasks, run_agentic_rollouts
from belayer_grpo._agentic.tooluse import BUILD_IMAGE, BuildTask, ensure_build_image, tooluse_demonstration
from belayer_router import ByteTokenizer, RouterClient, RouterConfig, running_router
from belayer_router.testing import running_worker, text_script

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    for engine in connect_engine():
        ensure_build_image(engine)
        yield engine


def build_response(prompt: str) -> str:
    """A perfect agent: build, read, answer the number it read."""
    task = re.match(r"Build (\d+) into file a, ", prompt)
    if task is None:
        return "I do not know this task."
    observations = re.findall(r"OUT (-?\d+): (.*)\n", prompt)
    if not observations:
        return f"ACTION: mk {task.group(1)}\n"
    if len(observations) == 1:
        return "ACTION: cat a\n"
    exit_code, output = observations[-1]
    read = output.split()[-1] if exit_code == "0" and output.split() else ""
    return f"ANSWER: {read}\n"


@asynccontextmanager
async def router_with_build_agent() -> AsyncIterator[RouterClient]:
    script = text_script(ByteTokenizer(), build_response, STOP)
    async with (
        running_router(RouterConfig(admin_token=ADMIN, resume_wait_s=10.0)) as (url, _app),
        running_worker(1, script=script) as (worker_url, _worker),
        RouterClient(url, admin_token=ADMIN) as client,
    ):
        await client.register("s0", worker_url, 1)
        yield client


def test_mk_takes_seconds_and_stamps_another_id_every_run(engine: Engine) -> None:
    sandbox = Sandbox.create(engine, SandboxConfig(image=BUILD_IMAGE, working_dir="/w"), trajectory="mk-ids")
    try:
        first = sandbox.exec("mk 375")
        kept = sandbox.exec("cat a")
        second = sandbox.exec("mk 375")
    finally:
        sandbox.remove()
    assert re.fullmatch(r"[k-z]{4} 375\n", first.stdout), first
    assert kept.stdout == first.stdout  # what it showed is what the file holds
    assert first.stdout != second.stdout  # a verbatim re-run gives another observation
    assert first.duration_s >= 1.4


def test_the_reward_needs_the_read_and_the_file_to_hold_every_build_the_agent_saw() -> None:
    task = BuildTask("build-375", 375)
    turns = task.transcript(random.Random(0))
    seen = [o for _, o in turns if o is not None]
    read = seen[1].output.strip()
    assert task.score("375", seen, f"{read}\n") == 1.0
    assert task.score("375", seen, "kkkk 375\n") == 0.0  # the file holds another build: inconsistent
    assert task.score("375", seen, None) == 0.0
    assert task.score("375", [seen[0]], f"{read}\n") == 0.0  # answered without reading
    assert task.score("376", seen, f"{read}\n") == 0.0
    # A build replayed after the agent saw it: the file and the last read agree, the first build not.
    rebuilt = ToolObservation("cat a", 0, "kkkk 375\n")
    assert task.score("375", [seen[0], rebuilt], "kkkk 375\n") == 0.0
    wrong = ToolObservation("cat a", 0, "375\n")  # no build id: not built by mk
    assert task.score("375", [wrong], "375\n") == 0.0
    rng = random.Random(1)
    demonstrations = [tooluse_demonstration(task, rng) for _ in range(200)]
    lazy = [d for d in demonstrations if len(d) == 2]
    assert all(len(d) in (2, 3) for d in demonstrations)
    assert 0.35 < len(lazy) / 200 < 0.65  # the imperfect demonstrator skips the read half the time
    assert all(o is None or o.command != "cat a" for d in lazy for _, o in d)


@pytest.mark.parametrize(
    ("recovery", "policy", "reward", "consistent", "from_checkpoint", "restored_prefix"),
    [
        ("checkpoint", "always", 1.0, True, True, 1),  # the build the agent saw comes back
        ("checkpoint", "never", 1.0, True, False, 0),  # from scratch: every turn again, build too
        ("replay", "never", 0.0, False, False, 1),  # another id built: what the agent saw is stale
    ],
)
async def test_a_kill_after_the_agent_saw_the_id_is_harmless_only_with_a_checkpoint_or_from_scratch(
    engine: Engine, tmp_path: Path, recovery: str, policy: str, reward: float, consistent: bool,
    from_checkpoint: bool, restored_prefix: int,
) -> None:  # fmt: skip
    tasks = generate_tooluse_tasks(0, held_out=2, kind="build")[1]
    config = agentic_config(
        tmp_path / "ckpt", max_rounds=4, max_response_tokens=40, checkpoint_policy=policy,
        sandbox_kill_at_actions=(2,), sandbox_recovery=recovery, max_concurrency=4,
    )  # fmt: skip
    pool = SandboxPool(engine, CheckpointStore(tmp_path / "ckpt"), capacity=4, reuse=True)
    try:
        async with router_with_build_agent() as client:
            with anyio.fail_after(240):
                trajectories = await run_agentic_rollouts(
                    tasks, client, config, num_samples=2, engine=engine, pool=pool,
                    run_id=run_id(f"build-{recovery}-{policy}"),
                )  # fmt: skip
    finally:
        await pool.aclose()
    assert len(trajectories) == 4
    for trajectory in trajectories:
        assert trajectory.finish == "answer", trajectory.test_output
        (record,) = trajectory.recoveries  # the forced kill, once per trajectory
        assert (record.failed_prefix, record.failed_turn) == (1, 2)
        assert record.from_checkpoint is from_checkpoint
        assert record.restored_prefix == restored_prefix
        assert record.prefix_consistent is consistent
        assert record.replayed is (recovery == "replay")
        assert trajectory.reward == reward, trajectory.test_output
        if from_checkpoint:
            # Only the stateless init runs: the layer alone, no CRIU.
            assert record.restored_kind == "fresh-runtime"
            assert {c.kind for c in trajectory.checkpoints} <= {"fresh-runtime", "reference"}
            assert record.rounds_regenerated == 1  # only the read's turn
        elif recovery == "checkpoint":
            assert record.rounds_regenerated == 2  # build and read again
    assert not list((tmp_path / "ckpt").glob("*/*"))
