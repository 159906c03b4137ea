"""The run folder's picture: reward and accuracy over the steps, every failure marked.

``training.png``: the mean reward and the share of right trajectories per step, the held-out
greedy accuracy before (step 0) and after (the last step), a dashed line at every step in which a
rollout worker was killed (with its handover time), and markers at every step whose sandboxes
failed, the two recoveries apart: restores from a checkpoint (green triangles) and restarts from
scratch (orange crosses), each with its count; groups dropped after an unrecoverable trajectory
are marked too (red).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["sandbox_markers", "write_training_plot"]

# kind -> (marker, colour, legend label, the marker's height below the axis; one height per kind,
# so markers of one step never overlap)
_MARKERS = {
    "restored": ("^", "tab:green", "sandbox restored from a checkpoint (n)", -0.04),
    "restarted": ("x", "tab:orange", "sandbox restarted from scratch (n)", -0.08),
    "dropped": ("v", "tab:red", "group dropped (unrecoverable) (n)", -0.12),
}


def sandbox_markers(history: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, int]]]:
    """Per kind of sandbox event (`restored`, `restarted`, `dropped`), the ``(step, count)`` of every
    step that had one."""
    markers: dict[str, list[tuple[int, int]]] = {kind: [] for kind in _MARKERS}
    for h in history:
        restored = int(h.get("env_recoveries_from_checkpoint", 0))
        counts = {
            "restored": restored,
            "restarted": int(h.get("env_failures", 0)) - restored,
            "dropped": int(h.get("env_dropped_groups", 0)),
        }
        for kind, count in counts.items():
            if count > 0:
                markers[kind].append((int(h["step"]), count))
    return markers


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
        for kind, points in sandbox_markers(history).items():
            if not points:
                continue
            marker, colour, label, height = _MARKERS[kind]
            axes.scatter([step for step, _ in points], [height] * len(points), marker=marker, color=colour,
                         clip_on=False, label=label)  # fmt: skip
            for step, count in points:
                axes.annotate(str(count), (step, height), textcoords="offset points", xytext=(6, -3),
                              fontsize=7, color=colour, annotation_clip=False)  # fmt: skip
        axes.set_ylim(min(m[3] for m in _MARKERS.values()) - 0.04, 1.05)
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
