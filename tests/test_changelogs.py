"""Every package's CHANGELOG keeps one shape: one heading per version, and under it only the
sections Added, Changed, Fixed and Removed (in that order), each a list of entries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
CHANGELOGS = sorted(ROOT.glob("packages/belayer-*/CHANGELOG.md"))
SECTIONS = ("Added", "Changed", "Fixed", "Removed")
VERSION = re.compile(r"## (Unreleased|\d+\.\d+\.\d+)( \(.*\))?")


def _problems(text: str) -> list[str]:
    problems: list[str] = []
    versions: list[str] = []
    sections: list[str] = []
    in_section = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("## "):
            match = VERSION.fullmatch(line)
            if match is None:
                problems.append(f"line {number}: a release heading is `## X.Y.Z (date)` or `## Unreleased`")
                continue
            versions.append(match.group(1))
            sections, in_section = [], False
        elif line.startswith("### "):
            name = line[4:].strip()
            if name not in SECTIONS:
                problems.append(f"line {number}: section {name!r}: use one of {', '.join(SECTIONS)}")
            elif sections and SECTIONS.index(name) <= SECTIONS.index(sections[-1]):
                problems.append(f"line {number}: {name} after {sections[-1]} (order: {', '.join(SECTIONS)})")
            sections.append(name)
            in_section = True
        elif line.startswith("- ") and versions and not in_section:
            problems.append(f"line {number}: an entry outside Added / Changed / Fixed / Removed")
        elif line.startswith("#### "):
            problems.append(f"line {number}: no sub-sections below Added / Changed / Fixed / Removed")
    repeated = sorted({v for v in versions if versions.count(v) > 1})
    if repeated:
        problems.append(f"versions with more than one heading: {repeated} (one heading per release)")
    return problems


def test_every_package_has_a_changelog() -> None:
    assert len(CHANGELOGS) == len(list(ROOT.glob("packages/belayer-*/pyproject.toml")))


@pytest.mark.parametrize("path", CHANGELOGS, ids=[p.parent.name for p in CHANGELOGS])
def test_the_changelog_has_one_heading_per_version_and_the_four_sections(path: Path) -> None:
    assert _problems(path.read_text()) == []


def test_the_checker_finds_each_kind_of_problem() -> None:
    bad = "\n".join(
        [
            "# Changelog",
            "## 0.2.0 (2026-12-02)",
            "- an entry without a section",
            "### Fixed",
            "- fine",
            "### Added",
            "### Bench (issue 16)",
            "## 0.2.0 (2026-12-01)",
            "## next",
        ]
    )
    found = _problems(bad)
    assert [p.split(":")[0] for p in found[:4]] == ["line 3", "line 6", "line 7", "line 9"]
    assert "['0.2.0']" in found[-1]
