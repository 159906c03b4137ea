"""Summary statistics of repeated measurements (plain Python, no numpy)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["relative_change", "summarize"]


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Mean, standard deviation, median, min, max and count of ``values``."""
    if not values:
        return {"n": 0, "mean": None, "std": None, "median": None, "min": None, "max": None, "values": []}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": list(values),
    }


def relative_change(value: float, baseline: float) -> float:
    """``(value - baseline) / baseline``; 0 when the baseline is 0."""
    return 0.0 if baseline == 0 else (value - baseline) / baseline
