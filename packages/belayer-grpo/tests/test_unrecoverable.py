"""No trajectory sinks a step: real Docker + CRIU sandboxes, a real router, the scripted LLM.

Each case is forced for real: more sandbox failures than ``max_recoveries`` (a deterministic kill
after the calc task's 4th action, which only that task reaches), a task image that does not exist,
a corrupt latest checkpoint (files of the ready checkpoint overwritten before the kill), and a
checkpoint that fails verification (the router's ``L_turn`` replaced) with no earlier one.  The
batch must hold only complete groups of trajectories that finished, the counts must say what
happened, and a corrupt checkpoint must fall back to the one before it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.from_thread
import attrs
import pytest
from agentic_support import agentic_config, connect_engine, router_with_worker, run_id

from belayer_envckpt import CheckpointStore, Engine, SandboxLike
from belayer_grpo._agentic import (
    AgenticTrajectory,
    AgentLoop,
    RolloutStats,
    SandboxPool,
    build_task_image,
    builtin_tasks,
    run_agentic_rollouts,
)
from belayer_grpo._errors import RolloutError, UnrecoverableTrajectoryError
from belayer_grpo._rollout_agentic import run_swe_rollout
from belayer_policy import PolicySpec, SharedEstimators
from belayer_router import ByteTokenizer, RouterClient

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio only


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield from connect_engine()


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    return build_task_image(engine, builtin_tasks())


@pytest.mark.parametrize("mode", ["resample", "drop"])
async def test_a_group_over_max_recoveries_is_resampled_then_dropped_and_the_rest_is_whole(
    engine: Engine, image: str, tmp_path: Path, mode: str
) -> None:
    # Only the calc task takes a 4th action; its sandbox dies there every time, once is too many.
    config = agentic_config(
        tmp_path / "ckpt", image=image, checkpoint_policy="never", sandbox_kill_at_actions=(4,),
        max_recoveries=0, on_unrecoverable=mode, max_resamples=1,
    )  # fmt: skip
    stats = RolloutStats()
    seen: list[str] = []
    async with router_with_worker() as (client, _worker, _url):
        trajectories = await run_agentic_rollouts(
            builtin_tasks(), client, config, num_samples=2, engine=engine, run_id=run_id(f"over-{mode}"),
            stats=stats, on_trajectory=lambda t: seen.append(t.trajectory_id),
        )  # fmt: skip
    assert sorted(seen) == sorted(t.trajectory_id for t in trajectories)  # each kept one, once
    # calc (group 0) is left out whole; words and countdown complete, each a full group.
    assert [(t.group_index, t.sample_index) for t in trajectories] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(t.reward == 1.0 and t.finish == "submit" for t in trajectories)
    attempts = 2 if mode == "resample" else 1
    assert stats.num_unrecoverable == 2 * attempts
    assert stats.num_resampled_groups == (1 if mode == "resample" else 0)
    assert stats.num_resamples == attempts - 1
    assert stats.num_dropped_groups == 1
    assert all("UnrecoverableTrajectoryError" in e and "max_recoveries" in e for e in stats.errors)
    assert all("group 0" in e for e in stats.errors)


async def test_on_trajectory_sees_only_trajectories_of_kept_groups(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # p = 0.5 per action, seed 163: the calc group's sample 0 survives every draw and finishes,
    # sample 1 dies at its first action and is unrecoverable: the group is dropped, and the
    # finished sample 0 must not be reported (progress, issue 33's count of finished trajectories).
    config = agentic_config(
        tmp_path / "ckpt", image=image, checkpoint_policy="never", sandbox_kill_probability=0.5,
        seed=163, max_recoveries=0, on_unrecoverable="drop",
    )  # fmt: skip
    stats = RolloutStats()
    seen: list[str] = []
    async with router_with_worker() as (client, _worker, _url):
        trajectories = await run_agentic_rollouts(
            builtin_tasks()[:1], client, config, num_samples=2, engine=engine, run_id=run_id("kept"),
            on_trajectory=lambda t: seen.append(t.trajectory_id), stats=stats,
        )  # fmt: skip
    assert (trajectories, stats.num_dropped_groups, stats.num_unrecoverable) == ([], 1, 1), stats.errors
    assert seen == []


async def test_fail_ends_the_rollout_naming_the_type_and_where(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    config = agentic_config(
        tmp_path / "ckpt", image=image, checkpoint_policy="never", sandbox_kill_at_actions=(4,),
        max_recoveries=0, on_unrecoverable="fail",
    )  # fmt: skip
    async with router_with_worker() as (client, _worker, _url):
        with pytest.raises(RolloutError) as caught:
            await run_agentic_rollouts(
                builtin_tasks()[:1], client, config, num_samples=1, engine=engine, run_id=run_id("over-fail")
            )
    text = str(caught.value)
    assert "belayer_grpo._errors.UnrecoverableTrajectoryError (loop.py:" in text, text
    assert "group 0 sample 0" in text, text
    assert "more than 0 sandbox failures" in text, text
    assert isinstance(caught.value.__cause__, UnrecoverableTrajectoryError)


async def test_a_task_image_that_is_gone_drops_its_group_after_resampling(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    tasks = list(builtin_tasks())
    tasks[1] = attrs.evolve(tasks[1], image="belayer/no-such-image-grpo-test:gone")
    config = agentic_config(tmp_path / "ckpt", image=image, checkpoint_policy="never", max_resamples=2)
    stats = RolloutStats()
    async with router_with_worker() as (client, _worker, _url):
        trajectories = await run_agentic_rollouts(
            tasks, client, config, num_samples=2, engine=engine, run_id=run_id("gone"), stats=stats
        )
    assert [t.group_index for t in trajectories] == [0, 0, 2, 2]
    assert all(t.reward == 1.0 for t in trajectories)
    assert (stats.num_resampled_groups, stats.num_resamples, stats.num_dropped_groups) == (1, 2, 1)
    assert stats.num_unrecoverable == 6
    assert all("ImageNotFoundError" in e for e in stats.errors), stats.errors


async def test_each_step_s_metrics_count_that_step_only_and_the_totals_add_up(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # Two steps, each with one group whose image is gone (dropped): the step metrics say 1 dropped
    # group each (not the run's running total), the run's totals 2; progress sees no trajectory of it.
    task = attrs.evolve(builtin_tasks()[0], image="belayer/no-such-image-grpo-test:gone")
    config = agentic_config(
        tmp_path / "ckpt", image=image, checkpoint_policy="never", on_unrecoverable="drop"
    )
    totals = RolloutStats()
    seen: list[str] = []
    async with router_with_worker() as (client, _worker, _url):
        for step in (1, 2):
            samples, metrics, trajectories = await run_swe_rollout(
                [task], config, client, ByteTokenizer(), num_samples=2,  # type: ignore[arg-type]
                run_id=run_id(f"steps{step}"), chaos=None, trajectories_file=tmp_path / "t.jsonl",
                step=step, on_trajectory=lambda t: seen.append(t.trajectory_id), stats=totals,
            )  # fmt: skip
            assert samples == []
            assert trajectories == []
            assert metrics["env_dropped_groups"] == 1, metrics
            assert metrics["env_unrecoverable"] == 2, metrics
            assert metrics["env_resampled_groups"] == metrics["env_group_resamples"] == 0
            assert (totals.num_dropped_groups, totals.num_unrecoverable) == (step, 2 * step)
    assert seen == []


@attrs.define
class _CorruptThenKill:
    """At action ``at``: overwrite the files of the newest ``num_corrupt`` ready checkpoints of the
    trajectory (or replace the router's context of its newest one), then kill the sandbox."""

    store: CheckpointStore
    trajectory: str
    at: int
    num_corrupt: int = 1
    forge_context: tuple[RouterClient, int] | None = None
    corrupt_prefixes: tuple[int, ...] = ()  # also these, by prefix
    forge_repo_hash: bool = False  # the newest record's repository hash replaced (needs `loop`)
    loop: AgentLoop | None = None
    fired: bool = False

    def step(self, sandbox: SandboxLike) -> bool:
        if sandbox.prefix != self.at or self.fired:
            return False
        self.fired = True
        ready = sorted(self.store.list(self.trajectory), key=lambda c: c.prefix)
        assert len(ready) >= self.num_corrupt, ready
        newest = ready[len(ready) - self.num_corrupt :]
        for checkpoint in [c for c in ready if c in newest or c.prefix in self.corrupt_prefixes]:
            for path in Path(checkpoint.path).rglob("*"):
                if path.is_file() and path.name != "manifest.json":
                    path.write_bytes(b"corrupt")
        if self.forge_context is not None:
            client, turn = self.forge_context
            anyio.from_thread.run(client.put_context, self.trajectory, turn, [1, 2, 3])
        if self.forge_repo_hash:
            assert self.loop is not None
            assert self.loop.checkpoints
            record = self.loop.checkpoints[-1]
            self.loop.checkpoints[-1] = attrs.evolve(record, repo_hash="0" * len(record.repo_hash))
        sandbox.kill()
        return True


async def _one_trajectory(
    engine: Engine, image: str, tmp_path: Path, client: RouterClient, name: str, policy: str, **chaos: object
) -> tuple[AgentLoop, AgenticTrajectory | UnrecoverableTrajectoryError]:
    task = builtin_tasks()[0]  # calc: 4 actions
    config = agentic_config(tmp_path / "ckpt", image=image, checkpoint_policy=policy)
    store = CheckpointStore(config.checkpoint_root)
    pool = SandboxPool(engine, store, capacity=1)
    trajectory = run_id(name)
    injector = _CorruptThenKill(store, trajectory, **chaos)  # type: ignore[arg-type]
    try:
        async with pool.lease(trajectory, image, task.workdir) as lease:
            loop = AgentLoop(
                task, trajectory, config, client, ByteTokenizer(), lease,
                PolicySpec.parse(policy).build(SharedEstimators()), injector,
            )  # fmt: skip
            injector.loop = loop
            try:
                return loop, await loop.run()
            except UnrecoverableTrajectoryError as error:
                return loop, error
    finally:
        await pool.aclose()


@pytest.mark.parametrize("num_corrupt", [1, 2])
async def test_a_corrupt_latest_checkpoint_falls_back_to_the_one_before_then_to_the_start(
    engine: Engine, image: str, tmp_path: Path, num_corrupt: int
) -> None:
    async with router_with_worker() as (client, _worker, _url):
        _loop, result = await _one_trajectory(
            engine, image, tmp_path, client, f"corrupt{num_corrupt}", "always", at=3, num_corrupt=num_corrupt
        )
    assert isinstance(result, AgenticTrajectory), result
    trajectory = result
    assert trajectory.reward == 1.0
    assert trajectory.num_actions == 4
    assert trajectory.num_checkpoint_fallbacks == num_corrupt
    [recovery] = trajectory.recoveries
    assert recovery.prefix_consistent
    # Checkpoints of prefixes 1 and 2 were ready; the newest num_corrupt of them were unusable.
    assert recovery.restored_prefix == 2 - num_corrupt
    assert recovery.from_checkpoint == (num_corrupt == 1)
    text = ByteTokenizer().decode([t for t in trajectory.token_ids if t < 256])
    assert text.rsplit("<observation exit=0>\n", 1)[1].startswith("c1\nc2\nc3\n")  # no action twice


async def test_a_checkpoint_that_fails_verification_with_no_earlier_one_is_unrecoverable(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    async with router_with_worker() as (client, _worker, _url):
        # every:2 checkpoints after action 2 only (turn 2); its L_2 is replaced before the kill.
        loop, result = await _one_trajectory(
            engine,
            image,
            tmp_path,
            client,
            "forged",
            "every:2",
            at=3,
            num_corrupt=0,
            forge_context=(client, 2),
        )
    assert isinstance(result, UnrecoverableTrajectoryError), result
    assert "fails verification" in str(result)
    assert "no earlier one" in str(result)
    assert loop.num_checkpoint_fallbacks == 1


async def test_the_router_owns_each_turns_context_and_a_recovery_finds_it_aligned(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    """One owner per turn's context (issue 32) and invariant 3: a turn's generation records prompt +
    completion at the router, the loop sends only the observation, and a recovery finds the router's
    ``L_turn`` equal to the context its checkpoint was taken with."""
    journal = tmp_path / "router.jsonl"
    async with router_with_worker(journal_path=journal) as (client, _worker, _url):
        loop, result = await _one_trajectory(
            engine, image, tmp_path, client, "owned", "always", at=3, num_corrupt=0
        )
    assert isinstance(result, AgenticTrajectory), result
    assert result.reward == 1.0
    [recovery] = result.recoveries
    assert recovery.from_checkpoint
    assert recovery.restored_prefix == 2  # the newest ready checkpoint, no fallback
    assert recovery.context_matches  # the router's L_2 is the context the checkpoint hashed
    assert recovery.prefix_consistent
    assert loop.num_checkpoint_fallbacks == 0
    ops = [json.loads(line) for line in journal.read_text().splitlines()]
    whole = [op for op in ops if op["op"] == "context"]
    appended = [op for op in ops if op["op"] == "context_append"]
    assert [op["turn"] for op in whole] == [0]  # the prompt, once; never a whole context again
    assert len(appended) >= result.num_actions  # every observation, alone
    prompt = len(whole[0]["token_ids"])
    assert all(len(op["token_ids"]) < prompt for op in appended)  # an observation, not a context


async def test_a_context_mismatch_stays_unrecoverable_when_an_older_checkpoint_is_corrupt(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # Checkpoints of prefixes 1 and 2: L_2 replaced (the newest fails verification), prefix 1's
    # files corrupt (it fails to restore).  The order of the failures must not matter: the
    # context mismatch is sticky, so no restart from scratch.
    async with router_with_worker() as (client, _worker, _url):
        loop, result = await _one_trajectory(
            engine, image, tmp_path, client, "forged-corrupt", "always", at=3, num_corrupt=0,
            corrupt_prefixes=(1,), forge_context=(client, 2),
        )  # fmt: skip
    assert isinstance(result, UnrecoverableTrajectoryError), result
    assert "prefix 2 fails verification" in str(result)
    assert "no earlier one" in str(result)
    assert loop.num_checkpoint_fallbacks == 2


async def test_a_repository_hash_mismatch_with_no_earlier_checkpoint_restarts_from_scratch(
    engine: Engine, image: str, tmp_path: Path
) -> None:
    # every:2: one checkpoint (prefix 2), its recorded repository hash replaced before the kill.
    # A repository that does not verify is no reason to refuse a fresh start.
    async with router_with_worker() as (client, _worker, _url):
        loop, result = await _one_trajectory(
            engine, image, tmp_path, client, "forged-hash", "every:2", at=3, num_corrupt=0,
            forge_repo_hash=True,
        )  # fmt: skip
    assert isinstance(result, AgenticTrajectory), result
    assert result.reward == 1.0
    assert loop.num_checkpoint_fallbacks == 1
    [recovery] = result.recoveries
    assert not recovery.from_checkpoint
    assert recovery.restored_prefix == 0
