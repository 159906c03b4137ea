"""The one lazy-import helper: a package's public names resolved from their modules on first use.

`import belayer_grpo` stays cheap (no torch, no Docker client) for the CLI's parser, while
`belayer_grpo.AgentLoop` and friends still work as ordinary attributes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module) on demand."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
