"""Layer archives that would escape the container root are refused before extraction."""

from __future__ import annotations

import io
import tarfile

import pytest

from belayer_envckpt import CheckpointCorruptError, UnsafeArchiveError
from belayer_envckpt._layer import check_layer_archive, install_layer


def _archive(path, *members):
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name, data=b"x"):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name, target, kind=tarfile.SYMTYPE):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def _dev(name, major, minor, kind=tarfile.CHRTYPE):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.devmajor, info.devminor = major, minor
    return info, None


@pytest.mark.parametrize(
    ("members", "why"),
    [
        ([_file("../escape")], "escapes the root"),
        ([_file("./a/../../escape")], "escapes the root"),
        ([_file("/etc/passwd")], "escapes the root"),
        ([_link("./evil", "../../../etc")], "points outside the root"),
        ([_link("./sub/evil", "../../x")], "points outside the root"),
        ([_link("./hard", "../outside", tarfile.LNKTYPE)], "points outside the layer"),
        ([_link("./hard", "/etc/shadow", tarfile.LNKTYPE)], "points outside the layer"),
        ([_link("./etc", "/etc"), _file("./etc/cron.d/job")], "through the symlink"),
        (
            [
                _link("./x/y/d", "../../a"),
                _link("./x/y/u", "d/../.."),
                _link("./hard", "x/y/u/etc/shadow", tarfile.LNKTYPE),
            ],
            "goes through a symlink",
        ),
        ([_dev("./sda", 8, 0, tarfile.BLKTYPE)], "not an overlay whiteout"),
        ([_dev("./mem", 1, 1)], "not an overlay whiteout"),
    ],
)
def test_escaping_members_are_refused(members, why, tmp_path):
    archive = _archive(tmp_path / "layer.tar", *members)
    target = tmp_path / "upper"
    target.mkdir()
    with pytest.raises(UnsafeArchiveError, match=why):
        install_layer(archive, target)
    assert list(target.iterdir()) == []


def test_safe_members_pass(tmp_path):
    archive = _archive(
        tmp_path / "layer.tar",
        _file("./work/a.txt"),
        _link("./work/abs", "/usr/bin/python3"),  # absolute targets resolve inside the container
        _link("./work/rel", "a.txt"),
        _link("./work/hard", "work/a.txt", tarfile.LNKTYPE),
        _dev("./etc/deleted", 0, 0),  # an overlay whiteout
        _link("./work/hard-abs", "work/abs", tarfile.LNKTYPE),  # a hard link to the symlink itself
    )
    assert check_layer_archive(archive) == 6


def test_garbage_archive_is_corrupt(tmp_path):
    bad = tmp_path / "layer.tar"
    bad.write_bytes(b"\x00not a tar" * 100)
    with pytest.raises(CheckpointCorruptError):
        check_layer_archive(bad)
