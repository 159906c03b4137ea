"""A full restore's page images reach CRIU as links to the store's files (read in place), and
only where the engine sees the store: the memory comes back byte for byte, the store is not
changed, and a store the engine cannot see (or a CRIU told to dedup) is copied as before."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEBIAN, wait_for

from belayer_envckpt import CheckpointStore, Engine, Sandbox, _restore_images, full_checkpoint, full_restore
from belayer_envckpt._restore_images import COPIED, IN_PLACE, engine_sees, stage_images

# 24 MB of random bytes and their digest; the digest of the memory again on request.
APP = r"""
import hashlib, os, time
state = bytearray(os.urandom(24 * 1024 * 1024))
os.makedirs('/work', exist_ok=True)
open('/work/h0', 'w').write(hashlib.sha256(state).hexdigest())
while True:
    if os.path.exists('/work/q') and not os.path.exists('/work/h1'):
        open('/work/h1.tmp', 'w').write(hashlib.sha256(state).hexdigest())
        os.rename('/work/h1.tmp', '/work/h1')
    time.sleep(0.05)
"""


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("pages-*.img"))}


def _memory_digest(sandbox: Sandbox) -> str:
    sandbox.exec("touch /work/q")
    wait_for(lambda: sandbox.exec("cat /work/h1 2>/dev/null").stdout != "", timeout=30)
    digest: str = sandbox.exec("cat /work/h1").stdout
    return digest


def test_the_memory_comes_back_exact_from_page_images_read_in_place(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(DEBIAN, "mem", command=("python3", "-c", APP))
    wait_for(lambda: sandbox.exec("cat /work/h0 2>/dev/null").stdout != "", timeout=30)
    before = sandbox.exec("cat /work/h0").stdout
    ckpt = full_checkpoint(sandbox, "mem", store=CheckpointStore(tmp_path))
    pages = _digests(ckpt.path)
    assert sum(p.stat().st_size for p in ckpt.path.rglob("pages-*.img")) > 20e6
    sandbox.kill()

    restored = track(full_restore(ckpt, engine=engine))
    assert restored.restore_images == IN_PLACE
    assert _memory_digest(restored) == before
    assert _digests(ckpt.path) == pages  # CRIU read the store's files and changed none of them

    with Engine.connect(restore_in_place=False) as copying:  # the old path, the same state
        copied = track(full_restore(ckpt, engine=copying, remove_failed=False))
        assert copied.restore_images == COPIED
        assert _memory_digest(copied) == before


def test_the_links_climb_to_the_root_from_wherever_they_are_unpacked(tmp_path):
    images = tmp_path / "store" / "criu"
    images.mkdir(parents=True)
    (images / "pages-1.img").write_bytes(b"pages")
    (images / "core-1.img").write_bytes(b"core")
    staged = tmp_path / "engine" / "checkpoints" / "c1"
    assert stage_images(images, staged, in_place=True) == IN_PLACE
    assert (staged / "pages-1.img").is_symlink()
    assert not (staged / "core-1.img").is_symlink()
    link = os.readlink(staged / "pages-1.img")
    assert not link.startswith("/")  # relative: CRIU resolves it from the folder, not its root
    for depth in (1, 2, 7):  # the engine unpacks the folder elsewhere (ctrd-checkpoint*)
        elsewhere = tmp_path.joinpath(*[f"d{i}" for i in range(depth)])
        elsewhere.mkdir(parents=True, exist_ok=True)
        os.symlink(link, elsewhere / "pages-1.img")
        assert (elsewhere / "pages-1.img").read_bytes() == b"pages"


def _store_through_a_symlink(tmp_path: Path) -> Path:
    """A store folder reached through an absolute symbolic link (a /var/run -> /run, a /home ->
    /data/home): CRIU would resolve such a link against the new container's root."""
    (tmp_path / "real").mkdir()
    via = tmp_path / "via"
    via.symlink_to(tmp_path / "real")  # absolute
    return via


def test_the_links_name_the_stores_real_path(tmp_path):
    via = _store_through_a_symlink(tmp_path)
    (via / "criu").mkdir()
    (via / "criu" / "pages-1.img").write_bytes(b"pages")
    assert stage_images(via / "criu", tmp_path / "staged", in_place=True) == IN_PLACE
    real = os.path.realpath(tmp_path / "real" / "criu" / "pages-1.img")
    assert os.readlink(tmp_path / "staged" / "pages-1.img") == "../" * 64 + real.lstrip("/")


def test_a_store_reached_through_an_absolute_symlink_is_read_in_place(make_sandbox, track, engine, tmp_path):
    sandbox = make_sandbox(DEBIAN, "mem", command=("python3", "-c", APP))
    wait_for(lambda: sandbox.exec("cat /work/h0 2>/dev/null").stdout != "", timeout=30)
    before = sandbox.exec("cat /work/h0").stdout
    ckpt = full_checkpoint(sandbox, "mem", store=CheckpointStore(_store_through_a_symlink(tmp_path)))
    sandbox.kill()
    restored = track(full_restore(ckpt, engine=engine))
    assert restored.restore_images == IN_PLACE
    assert _memory_digest(restored) == before


def test_a_crius_dedup_setting_keeps_the_images_copied(tmp_path, monkeypatch):
    conf = tmp_path / "runc.conf"
    conf.write_text("tcp-established\nauto-dedup\n")
    monkeypatch.setattr(_restore_images, "CRIU_CONFS", (conf,))
    images = tmp_path / "criu"
    images.mkdir()
    (images / "pages-1.img").write_bytes(b"pages")
    assert stage_images(images, tmp_path / "staged", in_place=True) == COPIED
    assert not (tmp_path / "staged" / "pages-1.img").is_symlink()


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace needs root")
def test_a_store_the_engine_cannot_see_is_copied(tmp_path):
    visible = tmp_path / "visible"
    visible.write_text("x")
    assert engine_sees(visible)  # the engine's containerd sees this machine's tmp_path
    private = tmp_path / "private"
    private.mkdir()
    script = (
        "import sys; from pathlib import Path; from belayer_envckpt._restore_images import engine_sees, "
        "stage_images\n"
        "p = Path(sys.argv[1]); (p / 'criu').mkdir(); (p / 'criu' / 'pages-1.img').write_bytes(b'x')\n"
        "print(engine_sees(p / 'criu' / 'pages-1.img'), stage_images(p / 'criu', p / 'staged', in_place=True), "
        "(p / 'staged' / 'pages-1.img').is_symlink())"
    )
    # A tmpfs over the folder in a mount namespace of its own: the engine's view has the folder empty.
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs none "$1" && exec "{sys.executable}" -c "$2" "$1"', "sh", str(private), script],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["False", COPIED, "False"]
    assert list(private.iterdir()) == []  # it never reached the engine's (and our) view
