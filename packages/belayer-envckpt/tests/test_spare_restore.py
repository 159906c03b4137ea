"""A fresh-runtime restore into a spare (`SparePool`) gives exactly a normal restore's state.

Each kind of change to the layer is checkpointed (fresh-runtime) and restored twice from the same
checkpoint: the normal way (a new container, layer into its upper directory, normal start) and
through a started spare (layer replayed through its merged root).  The two containers' merged
roots are then compared from the host entry by entry: type, mode, owner, size, mtime, contents,
link targets, hard-link counts and xattrs; and their processes (the init started fresh).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from conftest import DEBIAN, TEST_LABELS

from belayer_envckpt import (
    Checkpoint,
    CheckpointStore,
    Engine,
    Sandbox,
    SandboxConfig,
    SparePool,
    checkpoint,
    full_checkpoint,
    full_restore,
)
from belayer_envckpt._procfs import HOST_PROC_ENV
from belayer_envckpt._spares import merged_dir

CHANGES = {
    "new file with mode and owner": "mkdir -p /work && echo hi > /work/a && chmod 640 /work/a && chown 12:34 /work/a",
    "modified image file": "echo changed >> /etc/debian_version",
    "deleted image file": "rm /etc/issue",
    "deleted image directory": "rm -rf /var/log",
    "opaque directory": "rm -rf /var/cache && mkdir /var/cache && echo x > /var/cache/x",
    "image file replaced by a directory": "rm /etc/issue.net && mkdir /etc/issue.net && touch /etc/issue.net/y",
    "image directory replaced by a file": "rm -rf /srv && echo f > /srv",
    "image directory's mode, owner and mtime": "chmod 700 /opt && chown 5:6 /opt && touch -d 2001-01-01 /opt",
    "symlink, hard link, fifo": "mkdir /work && echo a > /work/a && ln /work/a /work/h && ln -s ../etc/hostname /work/l "
    "&& mkfifo -m 600 /work/f",
    "xattr and an old mtime": "mkdir /work && echo v > /work/x && touch -d 2001-01-01 /work/x && "
    "python3 -c \"import os; os.setxattr('/work/x', 'user.k', b'v')\"",
    "file created then deleted": "echo t > /tmp/t && rm /tmp/t",
    # The image's /etc/localtime is a symlink to an absolute path that exists on the host too.
    "image's absolute symlink replaced by a file": "rm /etc/localtime && echo local > /etc/localtime",
    "image's absolute symlink replaced by a directory": "rm /etc/localtime && mkdir /etc/localtime && echo d > /etc/localtime/d",
}
HOST_FILE = Path("/usr/share/zoneinfo/Etc/UTC")
TRAJECTORY_LABEL = "belayer.trajectory"
RUN_LABEL = "belayer.test.run"  # stands for a run's label (belayer-grpo's belayer.grpo.run)
PROCESSES = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"


def _config() -> SandboxConfig:
    return SandboxConfig(image=DEBIAN, labels=TEST_LABELS)


@pytest.fixture
def pool(engine: Engine) -> Iterator[SparePool]:
    with SparePool(engine) as spares:
        yield spares


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "store")


def _roots(sandbox: Sandbox) -> tuple[Path, Path]:
    data = sandbox.inspect()["GraphDriver"]["Data"]
    init = next(Path(p) for p in data["LowerDir"].split(":") if p.endswith("-init/diff"))
    return Path(data["MergedDir"]), init


def _tree(sandbox: Sandbox, archive_paths: set[str]) -> dict[str, tuple[Any, ...]]:
    """Every entry of the merged root: what a process in the container sees of it."""
    merged, init = _roots(sandbox)
    init_paths = {str(p.relative_to(init)) for p in init.rglob("*")} | {"."}
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(merged):
        for name in [".", *dirnames, *filenames] if dirpath == str(merged) else [*dirnames, *filenames]:
            path = Path(dirpath) / name
            rel = os.path.normpath(os.path.relpath(path, merged))
            st = os.lstat(path)
            # The init layer's entries are made per container (their mtimes differ) unless the
            # checkpoint's layer covers them.
            mtime = st.st_mtime_ns if rel not in init_paths or rel in archive_paths else None
            entry: tuple[Any, ...] = (
                stat.S_IFMT(st.st_mode),
                stat.S_IMODE(st.st_mode),
                st.st_uid,
                st.st_gid,
                mtime,
            )
            if stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(path.read_bytes()).hexdigest() if rel in archive_paths else None
                entry += (st.st_size, st.st_nlink, content)
            elif stat.S_ISLNK(st.st_mode):
                entry += (os.readlink(path),)
            xattrs = sorted(
                (k, os.getxattr(path, k, follow_symlinks=False))
                for k in os.listxattr(path, follow_symlinks=False)
            )
            out[rel] = (*entry, tuple(xattrs))
    return out


def _archive_paths(ckpt: Checkpoint) -> set[str]:
    with tarfile.open(ckpt.path / "layer.tar") as tar:
        return {os.path.normpath(m.name) for m in tar.getmembers()}


def _processes(sandbox: Sandbox) -> list[str]:
    lines = sandbox.probe(PROCESSES).stdout.splitlines()
    return sorted(line for line in lines if line and "/proc/" not in line and "cmdline" not in line)


def _checkpointed(sandbox: Sandbox, change: str, store: CheckpointStore) -> Checkpoint:
    result = sandbox.exec(change)
    assert result.ok, result
    ckpt = checkpoint(sandbox, sandbox.trajectory, store=store)
    assert ckpt.kind == "fresh-runtime"
    return ckpt


@pytest.mark.parametrize("change", list(CHANGES))
def test_spare_restore_equals_normal_restore(
    change: str,
    engine: Engine,
    pool: SparePool,
    store: CheckpointStore,
    make_sandbox: Callable[..., Sandbox],
    track: Callable[[Sandbox], Sandbox],
) -> None:
    _spare_equals_normal(change, engine, pool, store, make_sandbox, track)


@pytest.mark.parametrize("change", ["new file with mode and owner", "opaque directory", "deleted image file"])
def test_from_a_mount_namespace_of_its_own_the_layer_goes_in_through_the_inits_root(
    change: str,
    engine: Engine,
    pool: SparePool,
    store: CheckpointStore,
    make_sandbox: Callable[..., Sandbox],
    track: Callable[[Sandbox], Sandbox],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sandbox host on an isolated node of belayer-cluster (`BELAYER_ENVCKPT_HOST_PROC` set) does
    not see the overlays mounted after its namespace was made: the spare's root is reached through
    its init's procfs ``root`` (here this machine's /proc), with the same result."""
    monkeypatch.setenv(HOST_PROC_ENV, "/proc")
    pool.warm(_config(), "spare")
    (spare,) = pool._spares[pool._key(_config(), "spare")]
    assert merged_dir(spare.sandbox) == Path("/proc", str(spare.init_pid), "root")
    _spare_equals_normal(change, engine, pool, store, make_sandbox, track)


def _spare_equals_normal(
    change: str,
    engine: Engine,
    pool: SparePool,
    store: CheckpointStore,
    make_sandbox: Callable[..., Sandbox],
    track: Callable[[Sandbox], Sandbox],
) -> None:
    sandbox = make_sandbox(DEBIAN, trajectory="spare")
    pool.warm(_config(), "spare")
    host_before = HOST_FILE.read_bytes() if HOST_FILE.exists() else None
    ckpt = _checkpointed(sandbox, CHANGES[change], store)
    normal = track(full_restore(ckpt, engine=engine, remove_failed=False))
    spared = track(full_restore(ckpt, engine=engine, remove_failed=False, spares=pool))
    assert "spare_ms" not in normal.restore_timings_ms
    assert "spare_ms" in spared.restore_timings_ms  # the spare was used, not the normal path
    assert (spared.prefix, spared.context_ref) == (ckpt.prefix, ckpt.context_ref)
    paths = _archive_paths(ckpt)
    normal_tree, spare_tree = _tree(normal, paths), _tree(spared, paths)
    differ = {
        p: (normal_tree.get(p), spare_tree.get(p))
        for p in normal_tree.keys() | spare_tree.keys()
        if normal_tree.get(p) != spare_tree.get(p)
    }
    assert not differ
    assert (
        HOST_FILE.read_bytes() if HOST_FILE.exists() else None
    ) == host_before  # nothing written on the host
    assert _processes(spared) == _processes(normal)  # the init, fresh: its shell and its sleep
    assert spared.inspect()["Config"]["Labels"] == normal.inspect()["Config"]["Labels"]
    pool.wait_idle()
    assert pool.count(_config(), "spare") == 1  # refilled in the background


def test_no_spare_takes_the_normal_path_and_refills(
    engine: Engine,
    pool: SparePool,
    store: CheckpointStore,
    make_sandbox: Callable[..., Sandbox],
    track: Callable[[Sandbox], Sandbox],
) -> None:
    sandbox = make_sandbox(DEBIAN, trajectory="spare")
    ckpt = _checkpointed(sandbox, "echo 1 > /one", store)
    restored = track(full_restore(ckpt, engine=engine, remove_failed=False, spares=pool))
    assert "spare_ms" not in restored.restore_timings_ms
    assert restored.probe("cat /one").stdout == "1\n"
    pool.wait_idle()
    assert pool.count(_config(), "spare") == 1


def test_a_change_to_what_the_init_starts_from_takes_the_normal_path(
    engine: Engine,
    pool: SparePool,
    store: CheckpointStore,
    make_sandbox: Callable[..., Sandbox],
    track: Callable[[Sandbox], Sandbox],
) -> None:
    sandbox = make_sandbox(DEBIAN, trajectory="spare")
    pool.warm(_config(), "spare")
    ckpt = _checkpointed(
        sandbox, "echo 'echo tool' > /usr/local/bin/tool && chmod +x /usr/local/bin/tool", store
    )
    restored = track(full_restore(ckpt, engine=engine, remove_failed=False, spares=pool))
    assert "spare_ms" not in restored.restore_timings_ms
    assert restored.probe("tool").stdout == "tool\n"
    assert pool.count(_config(), "spare") == 1  # not taken


@pytest.mark.parametrize("spoil", ["write a file", "kill"])
def test_a_spare_that_changed_since_its_start_is_not_used(
    spoil: str,
    engine: Engine,
    pool: SparePool,
    store: CheckpointStore,
    make_sandbox: Callable[..., Sandbox],
    track: Callable[[Sandbox], Sandbox],
) -> None:
    sandbox = make_sandbox(DEBIAN, trajectory="spare")
    pool.warm(_config(), "spare")
    [spare_info] = [
        c
        for c in engine.list_containers([f"{k}={v}" for k, v in TEST_LABELS.items()])
        if c.id != sandbox.id and c.labels.get("belayer.trajectory") == "spare"
    ]
    spare = Sandbox.attach(engine, spare_info.id)
    if spoil == "kill":
        spare.kill()
    else:
        assert spare.exec("echo leftover > /leftover").ok
    ckpt = _checkpointed(sandbox, "echo 2 > /two", store)
    restored = track(full_restore(ckpt, engine=engine, remove_failed=False, spares=pool))
    assert "spare_ms" not in restored.restore_timings_ms
    assert restored.probe("cat /two; ls /leftover").stdout == "2\n"
    assert spare.status() == "removed"  # the spoiled spare was thrown away


def test_a_full_checkpoint_never_goes_into_a_spare(
    engine: Engine,
    pool: SparePool,
    store: CheckpointStore,
    make_sandbox: Callable[..., Sandbox],
    track: Callable[[Sandbox], Sandbox],
) -> None:
    sandbox = make_sandbox(DEBIAN, trajectory="spare")
    pool.warm(_config(), "spare")
    assert sandbox.exec("echo 3 > /three").ok
    ckpt = full_checkpoint(sandbox, "spare", store=store)
    restored = track(full_restore(ckpt, engine=engine, remove_failed=False, spares=pool))
    assert "spare_ms" not in restored.restore_timings_ms  # its processes come from CRIU's images
    assert restored.probe("cat /three").stdout == "3\n"
    assert pool.count(_config(), "spare") == 1  # not taken


def _run_containers(engine: Engine, run: str) -> dict[str, str]:
    """What a run's reaper finds: every container with the run's label (id -> trajectory label)."""
    return {c.id: c.labels.get(TRAJECTORY_LABEL, "") for c in engine.list_containers([f"{RUN_LABEL}={run}"])}


def test_a_run_shared_pool_restores_any_trajectory_into_spares_found_by_the_run_label(
    engine: Engine, store: CheckpointStore, track: Callable[[Sandbox], Sandbox]
) -> None:
    """One pool for a run: spares keyed by configuration, labelled as the run, taken by two
    trajectories in turn, each restore equal to the normal one; the run's label finds them all."""
    run = uuid.uuid4().hex[:8]
    config = SandboxConfig(image=DEBIAN, labels={**TEST_LABELS, RUN_LABEL: run})
    with SparePool(engine, shared=True) as pool:
        pool.warm(config)
        assert list(_run_containers(engine, run).values()) == ["spare"]
        made: set[str] = set()
        for trajectory, change in [("traj-a", "deleted image file"), ("traj-b", "opaque directory")]:
            sandbox = track(Sandbox.create(engine, config, trajectory=trajectory))
            ckpt = _checkpointed(sandbox, CHANGES[change], store)
            normal = track(full_restore(ckpt, engine=engine, remove_failed=False))
            spared = track(full_restore(ckpt, engine=engine, remove_failed=False, spares=pool))
            assert "spare_ms" in spared.restore_timings_ms  # into a spare, not the normal path
            assert spared.id not in made | {sandbox.id, normal.id}
            made |= {sandbox.id, normal.id, spared.id}
            assert (spared.trajectory, spared.prefix, spared.context_ref) == (
                trajectory,
                ckpt.prefix,
                ckpt.context_ref,
            )
            paths = _archive_paths(ckpt)
            assert _tree(spared, paths) == _tree(normal, paths)
            assert _processes(spared) == _processes(normal)
            labels = spared.inspect()["Config"]["Labels"]
            normal_labels = normal.inspect()["Config"]["Labels"]
            assert labels.pop(TRAJECTORY_LABEL) == "spare"  # set at creation: Docker cannot relabel
            assert normal_labels.pop(TRAJECTORY_LABEL) == trajectory
            assert labels == normal_labels  # the run's label included
            pool.wait_idle()
            assert pool.count(config, "any trajectory") == 1  # refilled, for every trajectory
        found = _run_containers(engine, run)
        assert made < set(found)
        assert [found[c] for c in set(found) - made] == ["spare"]  # the refilled spare
        for container in found:  # the reaper removes them all; the pool's close copes
            engine.remove(container)
    assert _run_containers(engine, run) == {}


def test_retain_removes_the_spares_of_configurations_no_longer_used(engine: Engine) -> None:
    run = uuid.uuid4().hex[:8]
    first = SandboxConfig(image=DEBIAN, labels={**TEST_LABELS, RUN_LABEL: run})
    second = attrs.evolve(first, working_dir="/tmp")
    with SparePool(engine, shared=True) as pool:
        pool.warm(first)
        kept = set(_run_containers(engine, run))
        pool.warm(second)
        assert len(_run_containers(engine, run)) == 2
        assert pool.retain([first]) == 1
        assert (pool.count(first), pool.count(second)) == (1, 0)
        assert set(_run_containers(engine, run)) == kept
    assert _run_containers(engine, run) == {}
