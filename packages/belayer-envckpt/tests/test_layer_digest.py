"""The writable layer's metadata digest on a real directory: every change moves it, reads do not."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from belayer_envckpt._layer import layer_digest


def _layer(tmp_path: Path) -> Path:
    root = tmp_path / "upper"
    (root / "work" / "sub").mkdir(parents=True)
    (root / "work" / "a").write_text("one")
    (root / "work" / "sub" / "b").write_text("two")
    os.symlink("a", root / "work" / "link")
    return root


def _create_and_delete(root: Path) -> None:
    (root / "work" / "t").write_text("x")
    (root / "work" / "t").unlink()


def _retarget(root: Path) -> None:
    (root / "work" / "link").unlink()
    os.symlink("b", root / "work" / "link")


CHANGES: dict[str, Callable[[Path], object]] = {
    "a file written": lambda r: (r / "work" / "a").write_text("ONE"),  # same size
    "a file appended": lambda r: (r / "work" / "a").open("a").write("!"),
    "a file deleted": lambda r: (r / "work" / "sub" / "b").unlink(),
    "a file created and deleted": _create_and_delete,
    "a rename": lambda r: (r / "work" / "a").rename(r / "work" / "c"),
    "a chmod": lambda r: (r / "work" / "sub" / "b").chmod(0o600),
    "an mtime set back": lambda r: os.utime(r / "work" / "a", ns=(0, 0)),
    "a hard link": lambda r: os.link(r / "work" / "a", r / "work" / "hard"),
    "a symlink retargeted": _retarget,
    "an xattr": lambda r: os.setxattr(r / "work" / "a", "user.belayer", b"1"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_every_change_moves_the_digest(tmp_path: Path, change: str) -> None:
    root = _layer(tmp_path)
    before = layer_digest(root)
    time.sleep(0.01)  # past the clock tick of the writes above
    try:
        CHANGES[change](root)
    except OSError as exc:  # user xattrs need a file system that has them
        pytest.skip(f"{change}: {exc}")
    assert layer_digest(root) != before


def test_reads_and_listings_leave_it_alone(tmp_path: Path) -> None:
    root = _layer(tmp_path)
    before = layer_digest(root)
    assert (root / "work" / "a").read_text() == "one"
    assert sorted(os.listdir(root / "work")) == ["a", "link", "sub"]
    os.stat(root / "work" / "sub" / "b")
    assert layer_digest(root) == before
    assert layer_digest(_layer(tmp_path / "other")) != before  # another layer: other inodes and times
