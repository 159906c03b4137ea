"""The tools are pinned once, in constraints.txt; pre-commit's hooks pin the same versions."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
TOOLS = ("ruff", "mypy", "import-linter", "pytest", "pytest-timeout", "hypothesis", "nox", "uv")


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s#]+)\s*(#.*)?", line.strip())
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def test_every_tool_is_pinned_exactly() -> None:
    pins = _constraints()
    assert sorted(t for t in TOOLS if t not in pins) == []


def test_pre_commit_pins_the_constraints_versions() -> None:
    pins = _constraints()
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    hooks = re.findall(r"additional_dependencies:\s*\[([^\]]*)\]", config)
    assert hooks, "no hook installs its tool"
    for listed in hooks:
        for requirement in (r.strip() for r in listed.split(",") if r.strip()):
            name, sep, pinned = requirement.partition("==")
            assert sep, f"pre-commit installs {requirement!r} unpinned: pin it as constraints.txt does"
            assert pins.get(name.lower()) == pinned, f"{requirement} differs from constraints.txt"
