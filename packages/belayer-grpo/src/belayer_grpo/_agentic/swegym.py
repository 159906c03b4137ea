"""SWE-Gym style task files (jsonl) and the small tasks shipped with the package.

One JSON object per line, in the SWE-Gym / SWE-bench instance format: ``instance_id``,
``problem_statement``, ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` (lists of test ids, or JSON strings
holding such lists, as the published data sets store them); ``repo`` and ``base_commit`` are kept
for reference.  Where the repository comes from:

- ``source``: a folder next to the jsonl file holding the repository; it is copied into the task
  image that `build_task_image` builds (the shipped tasks work this way);
- otherwise ``image`` (field or the loader's argument): a local image that already holds the
  repository at ``workdir`` (default ``/testbed``, as in SWE-bench images).

``test_command`` (optional) is run in ``workdir`` at the end of an episode; exit status 0 gives
reward 1.  Its default restores the pristine test files and runs the listed tests with unittest
(``source`` tasks) or pytest (image tasks).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from belayer_grpo._errors import TaskFormatError

__all__ = [
    "PRISTINE_ROOT",
    "WORKSPACE_ROOT",
    "SweTask",
    "builtin_tasks",
    "load_swegym",
]

WORKSPACE_ROOT = "/workspace"
PRISTINE_ROOT = "/opt/belayer-tasks"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_SHIPPED = Path(__file__).parent / "tasks" / "tasks.jsonl"


@attrs.frozen
class SweTask:
    """One software-engineering task: a repository with failing tests and a problem statement.

    ``image`` None means the package's built task image (see `build_task_image`), which holds
    ``source_dir`` at ``workdir``.
    """

    instance_id: str
    problem_statement: str
    workdir: str
    test_command: str
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    image: str | None = None
    source_dir: Path | None = None
    repo: str = ""

    @property
    def pristine_dir(self) -> str:
        """Where the built image keeps an untouched copy of a ``source`` repository."""
        name = self.source_dir.name if self.source_dir is not None else self.instance_id
        return f"{PRISTINE_ROOT}/{name}"


def _test_ids(value: Any, key: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except ValueError:
            raise TaskFormatError(f"{where}: {key} must be a list of test ids (or its JSON string)") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TaskFormatError(f"{where}: {key} must be a list of non-empty test id strings")
    return tuple(value)


def _string(record: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = record.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise TaskFormatError(f"{where}: field {key!r} must be a non-empty string")
    return value


def _parse_record(record: Any, where: str, base_dir: Path, image: str | None) -> SweTask:
    if not isinstance(record, dict):
        raise TaskFormatError(f"{where}: each line must be a JSON object")
    instance_id = _string(record, "instance_id", where)
    if not _ID.fullmatch(instance_id) or ".." in instance_id:
        raise TaskFormatError(
            f"{where}: instance_id {instance_id!r} must be 1-96 characters from [A-Za-z0-9_.-]"
        )
    statement = _string(record, "problem_statement", where)
    fail_to_pass = _test_ids(record.get("FAIL_TO_PASS", []), "FAIL_TO_PASS", where)
    pass_to_pass = _test_ids(record.get("PASS_TO_PASS", []), "PASS_TO_PASS", where)
    source_dir: Path | None = None
    task_image = record.get("image", image)
    if "source" in record:
        source = _string(record, "source", where)
        source_dir = (base_dir / source).resolve()
        if not source_dir.is_dir() or base_dir.resolve() not in source_dir.parents:
            raise TaskFormatError(f"{where}: source {source!r} is not a folder next to the task file")
        workdir = f"{WORKSPACE_ROOT}/{source_dir.name}"
        ids = " ".join(shlex.quote(t) for t in fail_to_pass + pass_to_pass)
        default = f"cp -f {PRISTINE_ROOT}/{source_dir.name}/test_*.py . && python3 -m unittest {ids}"
        task_image = None
    elif task_image is None:
        raise TaskFormatError(
            f"{where}: give either 'source' (a repository folder next to the file) or 'image' "
            "(a local image holding the repository), or pass image= to the loader"
        )
    else:
        workdir = _string(record, "workdir", where, "/testbed")
        ids = " ".join(shlex.quote(t) for t in fail_to_pass + pass_to_pass)
        default = f"python3 -m pytest -q {ids}".rstrip()
    if task_image is not None and not isinstance(task_image, str):
        raise TaskFormatError(f"{where}: field 'image' must be a string")
    test_command = _string(record, "test_command", where, default)
    if not fail_to_pass and "test_command" not in record:
        raise TaskFormatError(f"{where}: FAIL_TO_PASS is empty and no test_command is given")
    return SweTask(
        instance_id=instance_id,
        problem_statement=statement,
        workdir=workdir,
        test_command=test_command,
        fail_to_pass=fail_to_pass,
        pass_to_pass=pass_to_pass,
        image=task_image,
        source_dir=source_dir,
        repo=str(record.get("repo", "")),
    )


def load_swegym(path: str | Path, *, image: str | None = None) -> list[SweTask]:
    """Read a SWE-Gym style jsonl file; raise `TaskFormatError` naming the file and line if bad."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise TaskFormatError(f"cannot read task file {path}: {error}") from error
    tasks: list[SweTask] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as error:
            raise TaskFormatError(f"{where}: not valid JSON ({error})") from error
        task = _parse_record(record, where, path.parent, image)
        if task.instance_id in seen:
            raise TaskFormatError(f"{where}: instance_id {task.instance_id!r} appears twice")
        seen.add(task.instance_id)
        tasks.append(task)
    if not tasks:
        raise TaskFormatError(f"{path} holds no tasks")
    return tasks


def builtin_tasks(names: Sequence[str] | None = None) -> list[SweTask]:
    """The tasks shipped with the package (all, or those whose instance_id is in ``names``)."""
    tasks = load_swegym(_SHIPPED)
    if names is None:
        return tasks
    by_id = {t.instance_id: t for t in tasks}
    unknown = [n for n in names if n not in by_id]
    if unknown:
        raise TaskFormatError(f"unknown shipped task(s) {unknown}; choose from {sorted(by_id)}")
    return [by_id[n] for n in names]
