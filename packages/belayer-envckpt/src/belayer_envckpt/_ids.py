"""Ids that become path components and engine checkpoint names must be safe for both."""

from __future__ import annotations

import re

from ._errors import InvalidIdError

_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def validate_id(value: str, what: str) -> str:
    """Return ``value`` if it is a safe id, else raise `InvalidIdError` naming ``what``."""
    if not isinstance(value, str) or not _SAFE.fullmatch(value) or ".." in value:
        raise InvalidIdError(
            f"{what} id {value!r} is unsafe: use 1-128 characters from [A-Za-z0-9_.-], starting "
            "with a letter or digit and without '..'"
        )
    return value
