"""A begun trajectory continues from its journal, in real sandboxes with a scripted agent.

A tool-use trajectory (store a value, read it back, answer) runs once with its journal noted
(`belayer_grpo._agentic.journal`); then the same trajectory id runs again from a cut of that journal,
as a trainer that adopted a killed one's router would: its turns re-sent under the same ids, the
logged actions' results taken from the journal, its sandbox rebuilt at the last logged turn, from
the logged checkpoint when there is one (only the actions after it run again) or from a fresh
sandbox (every logged action runs again).  The continued trajectory is the same, token for token.
And a router that lost the logged turns (a new router, or one that dropped the record) generates
them anew, which ``RolloutStats.num_reattach_regenerated`` (``trajectories_regenerated``) counts.
A sandbox killed while it is rebuilt (chaos after a replayed action) is restored again and the
logged actions after the restore replayed again; past ``max_recoveries`` the trajectory is lost.
A resumed turn that comes back other than logged (a new router's agent answers otherwise) rewinds
the journal, so a second kill and resume continues what the first resume did.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
from agentic_support import agentic_config, connect_engine, run_id
from test_tooluse_sandbox import router_with_tooluse_agent, tooluse_response

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


def _cut(events: list[dict[str, Any]], kept: tuple[str, ...]) -> list[dict[str, Any]]:
    """The journal as a kill left it: the events of ``kept``, in order."""
    cut, rest = [], list(events)
    for kind in kept:
        while rest[0]["event"] != kind:
            rest.pop(0)
        cut.append(rest.pop(0))
    return cut


@pytest.mark.parametrize(
    ("kept", "kill_at", "replayed", "restored"),
    [
        # no checkpoint: the fresh sandbox killed after replaying `echo`: a fresh one again, both replayed
        (("action", "action"), 1, 2, False),
        # the checkpoint of turn 1 restored, killed after replaying `cat`: restored again, `cat` again
        (("action", "checkpoint", "action"), 2, 1, True),
        # the same, with no recovery allowed: the trajectory is lost (its group dropped here)
        (("action", "checkpoint", "action"), 2, 0, False),
    ],
)
async def test_a_sandbox_killed_while_it_is_rebuilt_is_restored_again(
    engine: Engine, tmp_path: Path, kept: tuple[str, ...], kill_at: int, replayed: int, restored: bool
) -> None:
    task, config, pool = _one_task(engine, tmp_path)
    lost = replayed == 0
    # The resumed run only: chaos kills the sandbox (a real `docker kill`) after the action that
    # brings it to prefix `kill_at`, here a replayed one.
    chaotic = attrs.evolve(
        config, sandbox_kill_at_actions=(kill_at,), max_recoveries=0 if lost else 100,
        on_unrecoverable="drop",
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    resumed_events: list[dict[str, Any]] = []
    stats = RolloutStats()
    name = run_id(f"rebuild-{len(kept)}-{lost}")
    try:
        async with router_with_tooluse_agent() as client:
            with anyio.fail_after(240):
                (first,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, note=events.append
                )
                again = await run_agentic_rollouts(
                    task, client, chaotic, engine=engine, pool=pool, run_id=name,
                    resume=read_journals(_cut(events, kept)), stats=stats, note=resumed_events.append,
                )  # fmt: skip
    finally:
        await pool.aclose()
    assert first.reward == 1.0, first.test_output
    if lost:  # no recovery left: lost like any unrecoverable trajectory (a train counts it regenerated)
        assert again == []
        assert (stats.num_unrecoverable, stats.num_dropped_groups, stats.num_reattached) == (1, 1, 0)
        assert "rebuilding the resumed sandbox: killed by chaos" in stats.errors[0]
        return
    (trajectory,) = again
    assert (trajectory.token_ids, trajectory.logprobs, trajectory.loss_mask) == (
        first.token_ids,
        first.logprobs,
        first.loss_mask,
    )
    assert (trajectory.reward, trajectory.finish, trajectory.num_actions) == (1.0, "answer", 2)
    assert stats.num_reattached == 1
    assert stats.num_rebuild_failures == 1
    assert stats.num_actions_replayed == replayed  # those of the rebuild the trajectory went on from
    assert stats.num_restored_from_checkpoint == int(restored)
    assert (stats.num_reattach_regenerated, stats.num_reattach_inconsistent, stats.num_unrecoverable) == (
        0,
        0,
        0,
    )
    (recovery,) = trajectory.recoveries  # the failure, recovered without losing a turn
    assert recovery.reason == "killed by chaos (rebuilding the resumed sandbox)"
    assert (recovery.from_checkpoint, recovery.restored_prefix) == (restored, int(restored))
    assert (recovery.tokens_regenerated, recovery.rounds_regenerated) == (0, 0)
    assert recovery.prefix_consistent
    # The journal still holds: no rewind, no action logged again (every logged one held).
    assert [e["event"] for e in resumed_events] == []


def _store_agent(first_turn: Callable[[str], str]) -> Callable[[str], str]:
    """The perfect tool-use agent, with ``first_turn(value)`` as its first response."""

    def respond(prompt: str) -> str:
        task = re.match(r"Save (\d+) to file a, ", prompt)
        if task is not None and "OUT " not in prompt:
            return first_turn(task.group(1))
        return tooluse_response(prompt)

    return respond


@pytest.mark.parametrize(
    ("kept", "restored"),
    [
        (("action", "checkpoint", "action"), True),  # turn 2's `cat` replayed after turn 1's checkpoint
        (("action", "action"), False),  # both replayed in a fresh sandbox: back to the prompt
    ],
)
async def test_a_replay_that_returns_other_than_logged_rewinds_to_a_checkpoint(
    engine: Engine, tmp_path: Path, kept: tuple[str, ...], restored: bool
) -> None:
    """An action whose effect differs when run again (a build id, a time) would leave the agent's
    context describing another sandbox than the one it goes on in: the journal's turn-2 result is
    made other than what `cat` prints, so the rebuild's replay returns something else.  The
    trajectory is recovered like a sandbox failure (the checkpoint the replay started from, or the
    prompt) and goes on in a sandbox that is what its context says: token for token the first run."""
    task, config, pool = _one_task(engine, tmp_path)
    events: list[dict[str, Any]] = []
    resumed_events: list[dict[str, Any]] = []
    stats = RolloutStats()
    name = run_id(f"diverge-{len(kept)}")
    try:
        async with router_with_tooluse_agent() as client:
            with anyio.fail_after(240):
                (first,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, note=events.append
                )
                cut = _cut(events, kept)
                true_stdout = cut[-1]["stdout"]
                cut[-1] = {**cut[-1], "stdout": "not what it printed\n", "context_hash": ""}
                (again,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name,
                    resume=read_journals(cut), stats=stats, note=resumed_events.append,
                )  # fmt: skip
    finally:
        await pool.aclose()
    assert first.reward == 1.0, first.test_output
    assert (again.token_ids, again.logprobs, again.loss_mask) == (
        first.token_ids,
        first.logprobs,
        first.loss_mask,
    )
    assert (again.reward, again.finish, again.num_actions) == (1.0, "answer", 2), again.test_output
    assert (stats.num_reattached, stats.num_reattach_inconsistent, stats.num_unrecoverable) == (1, 1, 0)
    # The rebuild restored the logged checkpoint before its replay diverged: counted (it was not).
    assert stats.num_restored_from_checkpoint == int(restored)
    (recovery,) = again.recoveries
    assert "turn 2 returned other than logged" in recovery.reason
    # The checkpoint restored for the rebuild and again for the recovery is one record, not two.
    ids = [c.checkpoint.checkpoint_id for c in again.checkpoints if c.checkpoint is not None]
    assert len(ids) == len(set(ids)), ids
    if restored:
        assert cut[1]["checkpoint_id"] in ids
    assert (recovery.from_checkpoint, recovery.restored_turn) == (restored, int(restored))
    assert recovery.prefix_consistent
    # The journal says so: a rewind to the restored turn, then turn 2 logged again with what ran.
    kinds = [e["event"] for e in resumed_events]
    assert "rewind" in kinds
    rewind = resumed_events[kinds.index("rewind")]
    assert rewind["turn"] == int(restored)
    (logged_again,) = [
        e for e in resumed_events[kinds.index("rewind") :] if e["event"] == "action" and e["turn"] == 2
    ]
    assert logged_again["stdout"] == true_stdout


@pytest.mark.parametrize(
    "first_turn",
    [
        pytest.param(lambda value: f"ACTION: echo {value} >a\n", id="another-command"),
        pytest.param(
            lambda value: f"Storing it.\nACTION: echo {value} > a\n", id="same-command-other-tokens"
        ),
    ],
)
async def test_a_resumed_turn_that_comes_back_otherwise_rewinds_the_journal(
    engine: Engine, tmp_path: Path, first_turn: Callable[[str], str]
) -> None:
    task, config, pool = _one_task(engine, tmp_path)
    events: list[dict[str, Any]] = []
    second_events: list[dict[str, Any]] = []
    first_stats, second_stats = RolloutStats(), RolloutStats()
    name = run_id("diverged")
    try:
        async with router_with_tooluse_agent() as client:
            with anyio.fail_after(240):
                (first,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, note=events.append
                )
        # Killed after turn 2's action; resumed on a router that lost every turn and whose agent
        # answers turn 1 otherwise: the killed run's history no longer holds from turn 1.
        killed = _cut(events, ("action", "checkpoint", "action"))
        async with router_with_tooluse_agent(_store_agent(first_turn)) as other:
            with anyio.fail_after(240):
                (second,) = await run_agentic_rollouts(
                    task, other, config, engine=engine, pool=pool, run_id=name,
                    resume=read_journals(killed), stats=first_stats, note=second_events.append,
                )  # fmt: skip
                assert second_events[0] == {
                    "event": "rewind",
                    "v": 1,
                    "trajectory_id": f"{name}-g0-s0",
                    "turn": 0,
                }
                # Killed again, right after the resumed run's turn-1 action was logged: the journal of
                # both runs' events is the second run's own history.
                upto = next(i for i, e in enumerate(second_events) if e["event"] == "action")
                journal = read_journals(killed + second_events[: upto + 1])[f"{name}-g0-s0"]
                assert (list(journal.actions), journal.checkpoints) == ([1], [])
                assert journal.actions[1].context_hash != killed[0]["context_hash"]
                (third,) = await run_agentic_rollouts(
                    task, other, config, engine=engine, pool=pool, run_id=name,
                    resume={f"{name}-g0-s0": journal}, stats=second_stats,
                )  # fmt: skip
    finally:
        await pool.aclose()
    assert first.reward == second.reward == third.reward == 1.0, (second.test_output, third.test_output)
    assert second.token_ids != first.token_ids  # the agent answered turn 1 otherwise
    assert (third.token_ids, third.logprobs, third.loss_mask) == (
        second.token_ids,
        second.logprobs,
        second.loss_mask,
    )
    # The first resume: turn 1 generated anew (the router lost it), consistent after the rewind.
    assert (first_stats.num_reattached, first_stats.num_reattach_regenerated) == (1, 1)
    assert first_stats.num_reattach_inconsistent == 0
    # The second: the new turn 1 held by the router, its action replayed in a fresh sandbox.
    assert (second_stats.num_reattached, second_stats.num_actions_replayed) == (1, 1)
    assert second_stats.num_restored_from_checkpoint == 0
    assert (second_stats.num_reattach_regenerated, second_stats.num_reattach_inconsistent) == (0, 0)


async def test_a_finished_trajectory_is_logged_before_its_checkpoints_go(
    engine: Engine, tmp_path: Path
) -> None:
    """A kill between the two must not leave a begun trajectory whose logged checkpoints are gone
    (a resume rebuilt it from a fresh sandbox); a finished one taken from the log has its
    leftover checkpoints (a kill after its log line, before its lease ended) removed."""
    task, config, _ = _one_task(engine, tmp_path)
    pool = SandboxPool(engine, CheckpointStore(tmp_path / "ckpt"), capacity=1, reuse=True)
    held_at_log: list[bool] = []

    def on_finished(trajectory: Any, _attempt: int) -> None:
        held_at_log.append(any(pool.store.trajectory_dir(trajectory.trajectory_id).glob("k*")))

    name = run_id("logged-first")
    try:
        async with router_with_tooluse_agent() as client:
            with anyio.fail_after(240):
                (first,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, on_finished=on_finished
                )
                folder = pool.store.trajectory_dir(first.trajectory_id)
                assert not folder.exists()  # gone with its lease
                folder.mkdir(parents=True)  # as a kill right after its log line leaves it
                (folder / "k00001-left").mkdir()
                stats = RolloutStats()
                (again,) = await run_agentic_rollouts(
                    task, client, config, engine=engine, pool=pool, run_id=name, done={(0, 0, 0): first},
                    stats=stats,
                )  # fmt: skip
    finally:
        await pool.aclose()
    assert held_at_log == [True]  # its checkpoints were still there when it was logged
    assert again is first
    assert stats.num_reused == 1
    assert not folder.exists()
