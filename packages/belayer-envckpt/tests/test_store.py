"""The store never takes a checkpoint that is still being written for a leftover."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import wait_for

from belayer_envckpt import CheckpointStore


def test_gc_spares_checkpoints_in_progress_in_this_process(tmp_path):
    store = CheckpointStore(tmp_path)
    writing = store.begin("traj-a", "k00001-abc")
    (writing / "layer.tar").write_bytes(b"half")
    assert store.leftovers() == []
    assert store.gc() == []
    assert store.gc("traj-b") == []  # another trajectory's rollout ends: traj-a is untouched
    assert writing.is_dir()
    store.abandon(writing)  # as if the writer died here
    assert store.leftovers() == [writing]
    assert store.gc("traj-a") == [writing]
    assert not any(tmp_path.rglob("*.lock"))


def test_gc_spares_checkpoints_another_process_is_writing(tmp_path):
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from belayer_envckpt import CheckpointStore
                CheckpointStore({str(tmp_path)!r}).begin("traj-a", "k00002-def")
                print("begun", flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "begun"
        store = CheckpointStore(tmp_path)
        assert store.gc() == []
        partial = tmp_path / "traj-a" / ".partial-k00002-def"
        assert partial.is_dir()
        writer.kill()  # a dead writer's lock goes with it
        writer.wait()
        wait_for(lambda: store.leftovers() == [partial])
        assert store.gc() == [partial]
    finally:
        writer.kill()
        writer.wait()
