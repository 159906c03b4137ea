"""Counting down for launches."""


def countdown(start: int) -> list[int]:
    """``start``, ``start - 1``, ..., 1, 0."""
    return list(range(start, 0, -1))
