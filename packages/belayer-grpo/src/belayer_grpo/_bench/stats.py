"""Summary statistics of repeated measurements (plain Python, no numpy)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["intervals_separate", "mean_ci95", "relative_change", "summarize"]


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


# Two-sided 95 % quantiles of Student's t for 1..30 degrees of freedom (then the normal's 1.96).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)  # fmt: skip


def mean_ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """The mean of ``values`` and the half-width of its 95 % confidence interval (Student's t);
    ``None`` with fewer than two values (no interval)."""
    n = len(values)
    if n < 2:
        return None
    quantile = _T95[n - 2] if n - 1 <= len(_T95) else 1.96
    return statistics.fmean(values), quantile * statistics.stdev(values) / math.sqrt(n)


def intervals_separate(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether the 95 % confidence intervals of the means of ``a`` and ``b`` do not overlap."""
    ca, cb = mean_ci95(a), mean_ci95(b)
    if ca is None or cb is None:
        return False
    return ca[0] + ca[1] < cb[0] - cb[1] or cb[0] + cb[1] < ca[0] - ca[1]
