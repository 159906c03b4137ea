"""The run folder's picture: reward and accuracy over the steps, every failure marked.

``training.png``: the mean reward and the share of right trajectories per step, the held-out
greedy accuracy before (step 0) and after (the last step), a dashed line at every step in which a
rollout worker was killed (with its handover time), and a marker at every step whose sandboxes
failed (with how many, and how many came back from a checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["write_training_plot"]


def write_training_plot(path: Path, history: Sequence[dict[str, Any]], summary: dict[str, Any]) -> Path:
    """Draw ``history`` (the per-step metrics) and ``summary`` (the report) into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(h["step"]) for h in history]
    figure, axes = plt.subplots(figsize=(9, 4.8))
    try:
        axes.plot(steps, [h["reward_mean"] for h in history], marker=".", label="reward (mean)")
        axes.plot(steps, [h["accuracy"] for h in history], marker=".", alpha=0.7, label="accuracy (rollouts)")
        if "eval_accuracy_before" in summary and steps:
            points = [(0, summary["eval_accuracy_before"])]
            if "eval_accuracy_after" in summary:
                points.append((steps[-1], summary["eval_accuracy_after"]))
            axes.plot(*zip(*points, strict=True), "s--", color="black", label="held-out accuracy (greedy)")
        killed = False
        for failure in summary.get("failures", []):
            recovery = failure.get("recovery_s")
            note = "" if recovery is None else f" {failure.get('recovery')} {recovery:.2f}s"
            axes.axvline(failure["step"], color="tab:red", linestyle="--", alpha=0.8,
                         label=None if killed else "rollout worker killed")  # fmt: skip
            axes.annotate(f"worker kill{note}", (failure["step"], 0.98), color="tab:red", fontsize=8,
                          rotation=90, va="top", ha="right")  # fmt: skip
            killed = True
        failed = [(h["step"], h["env_failures"], h.get("env_recoveries_from_checkpoint", 0))
                  for h in history if h.get("env_failures")]  # fmt: skip
        if failed:
            axes.scatter([s for s, _, _ in failed], [-0.06] * len(failed), marker="x", color="tab:orange",
                         clip_on=False, label="sandbox failures (n / from checkpoint)")  # fmt: skip
            for step, count, restored in failed:
                axes.annotate(f"{count}/{restored}", (step, -0.06), textcoords="offset points", xytext=(0, 6),
                              ha="center", fontsize=7, color="tab:orange", annotation_clip=False)  # fmt: skip
        axes.set_ylim(-0.1, 1.05)
        axes.set_xlabel("step")
        axes.set_ylabel("reward / accuracy")
        axes.set_title(f"belayer-grpo train ({summary.get('workload', '?')})")
        axes.grid(alpha=0.3)
        axes.legend(loc="upper right", fontsize=8)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
    finally:
        plt.close(figure)
    return path
