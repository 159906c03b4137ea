"""The package's shape: the engine half never imports the worker half; the public API resolves."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import belayer_shadow

PACKAGE = Path(belayer_shadow.__file__).parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_engine_half_does_not_import_the_worker_half() -> None:
    modules = sorted((PACKAGE / "_engine").glob("*.py"))
    assert len(modules) >= 10
    for path in modules:
        bad = {n for n in _imports(path) if n.startswith(("belayer_shadow._workers", "belayer_shadow._cli"))}
        assert not bad, f"{path.name} imports {bad}"


def test_every_public_name_resolves_and_the_version_is_the_metadata() -> None:
    for name in belayer_shadow.__all__:
        assert getattr(belayer_shadow, name) is not None
    assert belayer_shadow.__version__ == importlib.metadata.version("belayer-shadow")
    # The old error names are gone (distinct from envckpt's and grpo's; issue 18).
    for old in ("ConfigError", "EngineError"):
        assert not hasattr(belayer_shadow, old)


def test_importing_the_package_loads_no_torch() -> None:
    code = "import sys, belayer_shadow; belayer_shadow.SlotConfig; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"
