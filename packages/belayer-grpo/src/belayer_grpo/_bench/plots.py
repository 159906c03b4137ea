"""The PNG plots of the report (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

__all__ = ["PLOTTERS"]


def _overhead(results: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels, means, errors = [], [], []
    for r in results:
        for label, stats in ((f"{r['workload']}: {r['on']}", r["overhead"]),
                             *((("swe: always", r["always"]["overhead"]),) if "always" in r else ())):  # fmt: skip
            labels.append(label)
            means.append(100 * stats["mean"])
            errors.append(100 * stats["std"])
    ax.barh(labels, means, xerr=errors, color="tab:blue", capsize=4)
    ax.axvline(1.0, color="tab:red", linestyle="--", label="1% target")
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("overhead vs Belayer off (%), mean ± std of paired repeats")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _worker_failure(result: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3))
    modes = [m for m in ("shadow", "restart", "conventional") if m in result["modes"]]
    parts = [("detection_s", "detection"), ("recovery_s", "handover / reconstruction"),
             ("resume_or_regeneration_s", "resume / regeneration")]  # fmt: skip
    left = [0.0] * len(modes)
    for key, label in parts:
        values = [result["modes"][m][key]["mean"] or 0.0 for m in modes]
        ax.barh(modes, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.set_xscale("symlog", linthresh=0.1)
    ax.set_xlabel("seconds added to an affected trajectory (mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _env_failures(result: dict[str, Any], path: Path) -> None:
    rows = result["rows"]
    probabilities = sorted({r["kill_p"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / max(1, len(probabilities))
    for i, p in enumerate(probabilities):
        mine = {r["policy"]: r["increase"] for r in rows if r["kill_p"] == p}
        xs = [j + i * width for j in range(len(policies))]
        ax.bar(xs, [100 * mine[q]["mean"] for q in policies], width, yerr=[100 * mine[q]["std"] for q in policies],
               capsize=3, label=f"p = {p:g}")  # fmt: skip
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(policies))], policies)
    ax.set_ylabel("rollout time increase (%)")
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _checkpoint_cost(result: dict[str, Any], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    seconds = [c["seconds"] for c in result["records"]]
    if seconds:
        ax.hist(seconds, bins=20, color="tab:blue", alpha=0.8, label="checkpoint duration")
        if result["response_s"]["mean"] is not None:
            ax.axvline(
                result["response_s"]["mean"],
                color="tab:green",
                linestyle="--",
                label="overlapping response (mean)",
            )
    ax.set_xlabel("seconds")
    ax.set_ylabel("checkpoints")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


PLOTTERS: dict[str, Callable[[Any, Path], None]] = {
    "overhead": _overhead,
    "worker-failure": _worker_failure,
    "env-failures": _env_failures,
    "checkpoint-cost": _checkpoint_cost,
}
