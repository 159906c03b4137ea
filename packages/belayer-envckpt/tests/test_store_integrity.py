"""The store against races, bad or hostile manifests, clock skew and failed fsyncs (real files,
real processes; a fake only for the operating system's fsync and mkdir)."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import fail_fsync_of

from belayer_envckpt import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointDurabilityError,
    CheckpointStore,
    UnknownManifestFormatError,
)
from belayer_envckpt._store import record_files


def publish(
    store: CheckpointStore, traj: str, cid: str, prefix: int, created_ns: int | None = None
) -> Checkpoint:
    tmp = store.begin(traj, cid)
    with tarfile.open(tmp / "layer.tar", "w") as tar:
        info = tarfile.TarInfo("hello.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    (tmp / "criu").mkdir()
    (tmp / "criu" / "core-1.img").write_bytes(b"img")
    return store.publish(tmp, make_record(tmp, traj, cid, prefix, created_ns))


def make_record(tmp: Path, traj: str, cid: str, prefix: int, created_ns: int | None = None) -> Checkpoint:
    return Checkpoint(
        checkpoint_id=cid,
        trajectory=traj,
        prefix=prefix,
        context_ref=f"{traj}/turn-{prefix}",
        image="belayer/busybox",
        config={"image": "belayer/busybox"},
        container_id="c0ffee",
        created_ns=created_ns or time.time_ns(),
        timings_ms={},
        files=record_files(tmp),
        path=tmp,
    )


def edit_manifest(directory: Path, *, rehash: bool = True, **changes: Any) -> None:
    """Change manifest fields; with ``rehash`` also its self-checksum, so only the change is wrong."""
    manifest = directory / "manifest.json"
    data = json.loads(manifest.read_text())
    data.update(changes)
    if rehash and "manifest_sha256" in data:
        body = {k: v for k, v in data.items() if k != "manifest_sha256"}
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        data["manifest_sha256"] = hashlib.sha256(canonical).hexdigest()
    manifest.write_text(json.dumps(data))


def gc_in_another_process(root: Path) -> list[str]:
    code = (
        "import json; from belayer_envckpt import CheckpointStore; "
        f"print(json.dumps([str(p) for p in CheckpointStore({str(root)!r}).gc()]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return list(json.loads(out))


# 1. begin / gc race


def test_a_gc_right_after_begin_made_its_directory_spares_it(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    publish(store, "traj-7", "k00003-prev", 3)
    real_mkdir = Path.mkdir
    seen: list[list[str]] = []

    def fake_mkdir_then_gc(self: Path, *args: Any, **kwargs: Any) -> None:
        real_mkdir(self, *args, **kwargs)
        if self.name.startswith(".partial-"):
            seen.append(gc_in_another_process(tmp_path))  # a rollout ending elsewhere, at the worst moment

    monkeypatch.setattr(Path, "mkdir", fake_mkdir_then_gc)
    tmp = store.begin("traj-7", "k00004-new0")
    monkeypatch.setattr(Path, "mkdir", real_mkdir)
    assert seen == [[]]
    assert tmp.is_dir()
    assert (tmp_path / "traj-7" / ".partial-k00004-new0.lock").is_file()
    with tarfile.open(tmp / "layer.tar", "w"):
        pass
    (tmp / "criu").mkdir()
    (tmp / "criu" / "core-1.img").write_bytes(b"img")
    published = store.publish(tmp, make_record(tmp, "traj-7", "k00004-new0", 4))
    assert store.verify(store.get("traj-7")) == published


def test_publish_refuses_a_checkpoint_without_its_layer_or_criu_images(tmp_path):
    store = CheckpointStore(tmp_path)
    previous = publish(store, "traj-7", "k00003-prev", 3)
    tmp = store.begin("traj-7", "k00004-nolayer")
    (tmp / "criu").mkdir()
    (tmp / "criu" / "core-1.img").write_bytes(b"img")
    with pytest.raises(CheckpointCorruptError, match="lacks its layer archive"):
        store.publish(tmp, make_record(tmp, "traj-7", "k00004-nolayer", 4))
    store.abort(tmp)
    tmp = store.begin("traj-7", "k00004-nocriu")
    (tmp / "layer.tar").write_bytes(b"")
    (tmp / "criu").mkdir()
    with pytest.raises(CheckpointCorruptError, match="take the checkpoint again"):
        store.publish(tmp, make_record(tmp, "traj-7", "k00004-nocriu", 4))
    store.abort(tmp)
    assert store.latest_ready("traj-7") == previous


def test_gc_takes_the_lock_of_a_partial_before_removing_it(tmp_path):
    store = CheckpointStore(tmp_path)
    partial = store.begin("traj-7", "k00001-abc")
    store.abandon(partial)
    assert store.leftovers() == [partial]
    # A process takes the lock between gc's scan and its removal: gc must see that and keep it.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import fcntl, os, time
                fd = os.open({str(tmp_path / "traj-7" / ".partial-k00001-abc.lock")!r}, os.O_RDWR)
                fcntl.flock(fd, fcntl.LOCK_EX)
                print("locked", flush=True)
                time.sleep(60)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        assert store.gc() == []
        assert partial.is_dir()
    finally:
        holder.kill()
        holder.wait()
    assert store.gc() == [partial]


# 2. bad manifests


BAD_MANIFESTS = {
    "created_ns null": lambda d: edit_manifest(d, created_ns=None),
    "files a list": lambda d: edit_manifest(d, files=[]),
    "a JSON string": lambda d: (d / "manifest.json").write_text('"x"'),
    "a directory": lambda d: ((d / "manifest.json").unlink(), (d / "manifest.json").mkdir()),
    "cut short": lambda d: (d / "manifest.json").write_text('{"format": 2, "checkpoint_id'),
    "a bad file record": lambda d: edit_manifest(d, files={"layer.tar": {"size": "3", "sha256": "x"}}),
}


@pytest.mark.parametrize("mutate", BAD_MANIFESTS.values(), ids=BAD_MANIFESTS.keys())
def test_a_bad_manifest_is_skipped_and_reported_not_a_crash(tmp_path, mutate):
    store = CheckpointStore(tmp_path)
    good = publish(store, "traj-7", "k00001-aaaa", 1)
    bad = publish(store, "traj-7", "k00002-bbbb", 2)
    mutate(bad.path)
    with pytest.raises(CheckpointCorruptError):
        Checkpoint.load(bad.path)
    with pytest.raises(CheckpointCorruptError):
        store.verify(bad.path)
    assert store.list() == [good]
    assert store.latest_ready("traj-7") == good
    assert store.get("traj-7") == good
    assert [path for path, _why in store.unreadable("traj-7")] == [bad.path]
    assert store.gc() == []  # not a leftover: a person decides
    assert bad.path.is_dir()
    assert good.path.is_dir()


# 3. the manifest is checked against where it lies and checksummed


HOSTILE = {
    "id escapes": {"checkpoint_id": "../../../tmp/x"},
    "another id": {"checkpoint_id": "k00009-zzzz"},
    "another trajectory": {"trajectory": "traj-A"},
    "file outside": {"files": {"../../etc/passwd": {"size": 1, "sha256": "0" * 64}}},
    "absolute file": {"files": {"/etc/passwd": {"size": 1, "sha256": "0" * 64}}},
    "file climbing": {"files": {"criu/../layer.tar": {"size": 1, "sha256": "0" * 64}}},
}


@pytest.mark.parametrize("changes", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_manifest_must_name_its_own_directory_and_files_inside_it(tmp_path, changes):
    store = CheckpointStore(tmp_path)
    source = publish(store, "traj-B", "k00001-eeee", 1)
    edit_manifest(source.path, **changes)
    with pytest.raises(CheckpointCorruptError):
        store.verify(source.path)
    assert store.latest_ready("traj-B") is None
    assert [path for path, _why in store.unreadable()] == [source.path]


def test_a_copied_checkpoint_under_another_trajectory_is_not_ready_there(tmp_path):
    store = CheckpointStore(tmp_path)
    a = publish(store, "traj-A", "k00005-dddd", 5)
    shutil.copytree(a.path, tmp_path / "traj-B" / "k00005-dddd")
    assert store.latest_ready("traj-B") is None
    assert store.latest_ready("traj-A") == a


def test_verify_catches_a_changed_field_by_the_manifest_self_checksum(tmp_path):
    store = CheckpointStore(tmp_path)
    checkpoint = publish(store, "traj-7", "k00003-cccc", 3)
    edit_manifest(checkpoint.path, rehash=False, prefix=4, context_ref="traj-7/turn-4")
    with pytest.raises(CheckpointCorruptError, match="self-checksum"):
        store.verify(checkpoint.path)
    assert store.latest_ready("traj-7") is None


def test_a_format_1_manifest_without_a_self_checksum_still_verifies(tmp_path):
    store = CheckpointStore(tmp_path)
    checkpoint = publish(store, "traj-7", "k00003-cccc", 3)
    manifest = checkpoint.path / "manifest.json"
    data = json.loads(manifest.read_text())
    for key in ("manifest_sha256", "kind", "runtime", "layer_digest", "artifacts_of"):
        del data[key]
    data["format"] = 1
    manifest.write_text(json.dumps(data))  # as 0.2.5 wrote it
    assert store.verify(checkpoint.path) == checkpoint
    assert store.latest_ready("traj-7") == checkpoint


def test_a_format_2_manifest_without_a_kind_reads_as_a_full_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    checkpoint = publish(store, "traj-7", "k00003-cccc", 3)
    manifest = checkpoint.path / "manifest.json"
    data = json.loads(manifest.read_text())
    for key in ("kind", "runtime", "layer_digest", "artifacts_of"):
        del data[key]
    data["format"] = 2
    edited = {k: v for k, v in data.items() if k != "manifest_sha256"}
    data["manifest_sha256"] = hashlib.sha256(
        json.dumps(edited, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    manifest.write_text(json.dumps(data))  # as 0.3 wrote it
    loaded = store.verify(checkpoint.path)
    assert (loaded.kind, loaded.runtime, loaded.artifacts_of) == ("full", "criu", "")
    data["kind"] = "reference"  # a format-2 manifest cannot carry a kind
    manifest.write_text(json.dumps(data))
    with pytest.raises(UnknownManifestFormatError):
        store.verify(checkpoint.path)


@pytest.mark.parametrize(
    "edit",
    [
        {"kind": "delta"},
        {"kind": "fresh-runtime"},  # a fresh-runtime checkpoint with runtime "criu"
        {"runtime": "podman"},
        {"kind": "reference", "runtime": "fresh"},  # a reference that names no owner
        {"artifacts_of": "k00001-aaaa"},  # an owner on a full checkpoint
        {"kind": "reference", "artifacts_of": "../k00001"},
        {"layer_digest": 7},
    ],
)
def test_a_manifest_whose_kind_fields_disagree_is_corrupt(tmp_path, edit):
    store = CheckpointStore(tmp_path)
    checkpoint = publish(store, "traj-7", "k00003-cccc", 3)
    edit_manifest(checkpoint.path, **edit)
    with pytest.raises(CheckpointCorruptError, match="malformed manifest"):
        store.verify(checkpoint.path)


def test_a_fresh_runtime_checkpoint_must_hold_no_criu_images(tmp_path):
    store = CheckpointStore(tmp_path)
    tmp = store.begin("traj-7", "k00004-fresh")
    (tmp / "layer.tar").write_bytes(b"")
    (tmp / "criu").mkdir()
    (tmp / "criu" / "core-1.img").write_bytes(b"img")
    record = attrs.evolve(
        make_record(tmp, "traj-7", "k00004-fresh", 4), kind="fresh-runtime", runtime="fresh"
    )
    with pytest.raises(CheckpointCorruptError, match="holds CRIU images although its runtime is fresh"):
        store.publish(tmp, record)
    shutil.rmtree(tmp / "criu")
    published = store.publish(tmp, attrs.evolve(record, files=record_files(tmp)))
    assert store.verify(published.path).kind == "fresh-runtime"


# 4. gc removes only what is surely a leftover


def test_gc_keeps_checkpoints_of_a_format_it_cannot_read(tmp_path):
    store = CheckpointStore(tmp_path)
    newer = publish(store, "traj-7", "k00001-aaaa", 1)
    extra = publish(store, "traj-7", "k00002-bbbb", 2)
    no_manifest = publish(store, "traj-7", "k00003-cccc", 3)
    edit_manifest(newer.path, format=4)
    edit_manifest(extra.path, future_field="x")
    (no_manifest.path / "manifest.json").unlink()
    assert store.gc() == [no_manifest.path]
    assert store.gc("traj-7") == []
    assert newer.path.is_dir()
    assert extra.path.is_dir()
    reasons = dict(store.unreadable("traj-7"))
    assert isinstance(reasons[newer.path], UnknownManifestFormatError)
    assert isinstance(reasons[extra.path], UnknownManifestFormatError)


# 5. order by prefix, not by wall clock


def test_latest_and_gc_keep_order_by_prefix_not_by_wall_clock(tmp_path):
    store = CheckpointStore(tmp_path)
    now = time.time_ns()
    older = publish(store, "traj-7", "k00007-ffff", 7, created_ns=now)
    newer = publish(store, "traj-7", "k00008-gggg", 8, created_ns=now - 2_000_000_000)  # a slow clock
    assert store.latest_ready("traj-7") == newer
    assert store.gc("traj-7", keep=1) == [older.path]
    assert store.list() == [newer]


# 9. a failed fsync after the rename


def test_a_failed_directory_fsync_after_the_rename_says_the_checkpoint_is_published(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    publish(store, "traj-7", "k00001-aaaa", 1)
    fail_fsync_of(monkeypatch, tmp_path / "traj-7")
    with pytest.raises(CheckpointDurabilityError, match="IS published") as caught:
        publish(store, "traj-7", "k00002-bbbb", 2)
    monkeypatch.undo()
    assert caught.value.checkpoint == store.latest_ready("traj-7")
    latest = store.latest_ready("traj-7")
    assert latest is not None
    assert latest.prefix == 2
    assert not list(tmp_path.rglob("*.lock"))


# 12. a lock file left by a crash after the rename


def test_gc_collects_a_lock_file_left_by_a_crash_after_the_rename(tmp_path):
    store = CheckpointStore(tmp_path)
    checkpoint = publish(store, "traj-7", "k00009-hhhh", 9)
    orphan = tmp_path / "traj-7" / ".partial-k00009-hhhh.lock"
    orphan.touch()
    assert store.leftovers() == [orphan]
    assert store.gc() == [orphan]
    assert sorted(p.name for p in (tmp_path / "traj-7").iterdir()) == [checkpoint.checkpoint_id]


def test_gc_spares_a_held_lock_whose_directory_is_not_made_yet(tmp_path):
    (tmp_path / "traj-7").mkdir()
    lock = tmp_path / "traj-7" / ".partial-k00001-abc.lock"
    fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer between its lock and its mkdir
        assert CheckpointStore(tmp_path).gc() == []
        assert lock.exists()
    finally:
        os.close(fd)


# 13. a new trajectory directory is made durable


def test_begin_fsyncs_the_root_after_making_a_trajectory_directory(tmp_path, monkeypatch):
    real_fsync = os.fsync
    synced: list[str] = []

    def fake_recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fake_recording_fsync)
    CheckpointStore(tmp_path / "store").begin("traj-new", "k00001-abc")
    assert str(tmp_path / "store") in synced
    assert str(tmp_path) in synced  # the root itself was new too


# 14. gc of one trajectory touches only that trajectory


def test_gc_of_one_trajectory_leaves_other_trajectories_alone(tmp_path):
    store = CheckpointStore(tmp_path)
    publish(store, "traj-a", "k00001-aaaa", 1)
    (tmp_path / "traj-b").mkdir()  # another rollout's, about to be filled
    (tmp_path / ".failed" / "traj-b").mkdir(parents=True)
    store.gc("traj-a")
    assert not (tmp_path / "traj-a").exists()
    assert (tmp_path / "traj-b").is_dir()
    assert (tmp_path / ".failed" / "traj-b").is_dir()
