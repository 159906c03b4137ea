"""Restore after a failure, twice from one checkpoint, and back to the state at prefix k."""

from __future__ import annotations

import types
import uuid
from pathlib import Path

import pytest

import belayer_envckpt._docker as engine_module
from belayer_envckpt import CheckpointStore, full_checkpoint, full_restore

SNAPSHOT = "find /work -exec ls -ld {} + | awk '{print $1, $3, $4, $5, $NF}' | sort; find /work -type f | sort | xargs md5sum"


def test_same_checkpoint_restores_twice(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(trajectory="twice")
    sandbox.exec("echo one > /work/f")
    state = sandbox.exec(SNAPSHOT).stdout
    ckpt = full_checkpoint(sandbox, "twice", store=CheckpointStore(tmp_path))
    sandbox.kill()
    first = track(full_restore(ckpt, engine=engine))
    second = track(full_restore(ckpt, engine=engine, remove_failed=False))
    assert first.id != second.id
    assert first.exec(SNAPSHOT).stdout == state == second.exec(SNAPSHOT).stdout
    first.exec("echo changed > /work/f")  # the two restored containers are independent
    assert second.exec("cat /work/f").stdout == "one\n"


def test_a_restore_leaves_no_copy_of_the_images_behind(make_sandbox, track, engine, tmp_path, monkeypatch):
    # containerd copies the images into a ctrd-checkpoint* temp folder per restore and keeps it;
    # the restore's id (a file in the copy) is fixed here, in the engine module only, to find ours.
    known = uuid.UUID("0123456789abcdef0123456789abcdef")
    monkeypatch.setattr(engine_module, "uuid", types.SimpleNamespace(uuid4=lambda: known))

    def ours() -> list[Path]:
        return [
            folder
            for folder in Path("/tmp").glob("ctrd-checkpoint*")
            if (folder / "belayer-restore-id").is_file()
            and (folder / "belayer-restore-id").read_text() == known.hex[:8]
        ]

    seen_before_cleanup: list[list[Path]] = []
    remove = engine_module.Engine._remove_restore_copies

    def spy(self: engine_module.Engine, restore_id: str) -> None:
        seen_before_cleanup.append(ours())
        remove(self, restore_id)

    monkeypatch.setattr(engine_module.Engine, "_remove_restore_copies", spy)
    sandbox = make_sandbox(trajectory="copies")
    sandbox.exec("echo one > /work/f")
    ckpt = full_checkpoint(sandbox, "copies", store=CheckpointStore(tmp_path))
    sandbox.kill()
    restored = track(full_restore(ckpt, engine=engine))
    assert restored.exec("cat /work/f").stdout == "one\n"
    assert len(seen_before_cleanup) == 1  # the restore cleaned up once
    if not seen_before_cleanup[0]:
        pytest.skip("this engine keeps no copy of the images in /tmp (another TMPDIR): nothing to remove")
    assert ours() == []  # the copy was there before the cleanup and is gone after it


def test_failure_after_more_actions_returns_to_prefix_k(make_sandbox, track, engine, tmp_path):
    store = CheckpointStore(tmp_path)
    sandbox = make_sandbox(trajectory="prefix")
    for i in range(3):
        sandbox.exec(f"echo step{i} > /work/s{i}")
    state_at_k = sandbox.exec(SNAPSHOT).stdout
    ckpt = full_checkpoint(sandbox, "prefix", context_ref="ctx/turn-4", store=store)
    assert ckpt.prefix == 4
    sandbox.exec("rm /work/s0; echo later > /work/s3; mkdir /work/d")
    sandbox.kill()

    restored = track(full_restore(store.latest_ready("prefix"), engine=engine))
    assert (restored.prefix, restored.context_ref, restored.trajectory) == (4, "ctx/turn-4", "prefix")
    assert restored.exec(SNAPSHOT).stdout == state_at_k
    # Work continues and checkpoints again from the restored sandbox.
    restored.exec("echo again > /work/s5")
    newer = full_checkpoint(restored, "prefix", store=store)
    assert store.latest_ready("prefix") == newer
    assert [c.prefix for c in store.list("prefix")] == [4, 6]


def test_restore_of_stopped_and_paused_containers(make_sandbox, track, engine, tmp_path):
    store = CheckpointStore(tmp_path)
    for how in ("stop", "pause"):
        sandbox = make_sandbox(trajectory=f"fail-{how}")
        sandbox.exec(f"echo {how} > /work/x")
        ckpt = full_checkpoint(sandbox, f"fail-{how}", store=store)
        getattr(sandbox, how)()
        restored = track(full_restore(ckpt, engine=engine))
        assert restored.exec("cat /work/x").stdout == f"{how}\n"
        assert sandbox.status() == "removed"


def test_dump_through_the_engine_api_restores_too(track, tmp_path):
    """The engine's own checkpoint API (slower, see Engine.checkpoint) gives restorable images."""
    from conftest import TEST_LABELS

    from belayer_envckpt import Engine, Sandbox, SandboxConfig

    engine = Engine.connect(dump_method="engine")
    try:
        counter = (
            "/bin/sh",
            "-c",
            "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.tmp; mv /tmp/n.tmp /tmp/n; sleep 0.05; done",
        )
        config = SandboxConfig(image="belayer/busybox:latest", command=counter, labels=TEST_LABELS)
        sandbox = track(Sandbox.create(engine, config, trajectory="api"))
        sandbox.exec("echo via-api > /work/f")
        ckpt = full_checkpoint(sandbox, "api", store=CheckpointStore(tmp_path))
        sandbox.kill()
        restored = track(full_restore(ckpt, engine=engine))
        assert restored.exec("cat /work/f").stdout == "via-api\n"
        assert int(restored.exec("cat /tmp/n").stdout) > 0
    finally:
        engine.close()


def test_unknown_dump_method():
    import docker
    import pytest

    from belayer_envckpt import Engine, InvalidConfigError

    with pytest.raises(InvalidConfigError, match="dump_method"):
        Engine(docker.from_env(), dump_method="magic")
    with pytest.raises(InvalidConfigError, match="dump_method"):
        Engine.connect(dump_method="magic")
