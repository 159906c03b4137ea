"""A failure at any point inside full_checkpoint keeps the previous ready checkpoint in effect."""

from __future__ import annotations

import pytest

from belayer_envckpt import (
    CheckpointFailedError,
    CheckpointFault,
    CheckpointStore,
    CrashPoint,
    FaultAction,
    InjectedCrash,
    full_checkpoint,
    full_restore,
)


@pytest.mark.parametrize("point", list(CrashPoint))
def test_crash_of_the_checkpointing_process(point, make_sandbox, track, engine, tmp_path):
    store = CheckpointStore(tmp_path)
    sandbox = make_sandbox(trajectory="crash")
    sandbox.exec("echo v1 > /work/v")
    first = full_checkpoint(sandbox, "crash", store=store)
    sandbox.exec("echo v2 > /work/v")
    with pytest.raises(InjectedCrash):
        full_checkpoint(sandbox, "crash", store=store, fault=CheckpointFault(point))
    assert sandbox.status() == "running"  # never left frozen
    assert store.latest_ready("crash") == first
    assert store.list("crash") == [first]
    leftovers = store.leftovers()
    assert len(leftovers) == 1
    assert leftovers[0].name.startswith(".partial-")
    assert store.gc() == leftovers
    assert store.leftovers() == []
    assert store.list("crash") == [first]
    sandbox.kill()
    restored = track(full_restore(store.latest_ready("crash"), engine=engine))
    assert restored.exec("cat /work/v").stdout == "v1\n"


@pytest.mark.parametrize(
    ("point", "action"),
    [(CrashPoint.AFTER_LAYER, FaultAction.KILL), (CrashPoint.AFTER_LAYER, FaultAction.STOP)],
)
def test_container_dies_inside_checkpoint(point, action, make_sandbox, engine, tmp_path):
    store = CheckpointStore(tmp_path)
    sandbox = make_sandbox(trajectory="dies")
    first = full_checkpoint(sandbox, "dies", store=store)
    with pytest.raises(CheckpointFailedError, match="previous ready checkpoint"):
        full_checkpoint(sandbox, "dies", store=store, fault=CheckpointFault(point, action))
    assert store.list("dies") == [first]
    assert store.leftovers() == []  # an ordinary failure cleans up after itself


def test_checkpoint_of_a_dead_container_is_refused(make_sandbox, tmp_path):
    store = CheckpointStore(tmp_path)
    sandbox = make_sandbox(trajectory="dead")
    sandbox.kill()
    with pytest.raises(CheckpointFailedError, match="not running"):
        full_checkpoint(sandbox, "dead", store=store)
    assert store.list() == []
    assert store.leftovers() == []
