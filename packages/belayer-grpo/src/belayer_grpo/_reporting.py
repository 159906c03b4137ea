"""What the person at the terminal sees, and the metrics files.

Per step: a progress bar through the phases (rollout with a count of samples, reward, train,
sync), then one summary line; every step's metrics go to ``metrics.jsonl`` and TensorBoard; at the
end a report (text on the terminal, ``report.json`` in the run folder).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

import attrs

from belayer_grpo._chaos import FailureRecord
from belayer_grpo._config import LoggingConfig

__all__ = ["Reporter", "format_summary"]


def format_summary(step: int, num_steps: int, metrics: dict[str, Any], failures: list[FailureRecord]) -> str:
    """The one line per step: reward, accuracy, throughput, and failures with their recoveries."""
    parts = [
        f"step {step:>3}/{num_steps}",
        f"reward {metrics['reward_mean']:.3f} (avg10 {metrics.get('reward_avg10', metrics['reward_mean']):.3f})",
        f"acc {metrics['accuracy']:.1%}",
        f"tok/s {metrics['tokens_per_s']:.0f}",
        f"loss {metrics['loss']:+.4f}",
        f"{metrics['step_s']:.1f}s",
    ]
    if metrics.get("num_resumed"):
        parts.append(f"resumed {metrics['num_resumed']}")
    if "env_failures" in metrics:
        from belayer_grpo._rollout_agentic import format_env

        parts.append(format_env(metrics))
    for failure in failures:
        text = f"FAILURE {failure.slot} killed (step {failure.step}, {failure.trigger})"
        if failure.recovery_s is not None:
            text += f" -> recovered by {failure.recovery} in {failure.recovery_s:.2f}s"
        else:
            text += " -> recovering"
        parts.append(text)
    return " | ".join(parts)


@attrs.define
class Reporter:
    """Progress bars, summary lines and metrics files for one run."""

    run_dir: Path
    config: LoggingConfig
    num_steps: int
    stream: TextIO = sys.stderr
    _bar: Any = None
    _jsonl: TextIO | None = None
    _writer: Any = None
    history: list[dict[str, Any]] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        if self.config.jsonl:
            self._jsonl = (self.run_dir / "metrics.jsonl").open("a")
        if self.config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def message(self, text: str) -> None:
        """A line for the terminal that does not break a progress bar."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def begin_step(self, step: int, num_samples: int) -> None:
        """Open the step's bar: one tick per finished sample, then reward, train and sync."""
        if not self.config.progress:
            return
        from tqdm import tqdm

        self._bar = tqdm(
            total=num_samples + 3,
            desc=f"step {step}/{self.num_steps} rollout",
            file=self.stream,
            leave=False,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}]",
        )

    def advance(self, phase: str | None = None, count: int = 1) -> None:
        """Move the bar on; ``phase`` renames the current phase (rollout, reward, train, sync)."""
        if self._bar is None:
            return
        if phase is not None:
            step_label = self._bar.desc.rsplit(" ", 1)[0]
            self._bar.set_description_str(f"{step_label} {phase}")
        self._bar.update(count)

    def end_step(self, step: int, metrics: dict[str, Any], failures: list[FailureRecord]) -> None:
        """Close the bar, print the summary line and record the metrics."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.message(format_summary(step, self.num_steps, metrics, failures))
        record = {"step": step, **metrics, "failures": [f.to_dict() for f in failures]}
        self.history.append(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float):
                    self._writer.add_scalar(f"train/{key}", value, step)
            self._writer.flush()

    def final_report(self, summary: dict[str, Any]) -> str:
        """Write ``report.json`` and return the report's text."""
        (self.run_dir / "report.json").write_text(json.dumps(summary, indent=2, default=str))
        lines = ["", "=" * 72, "belayer-grpo training report", "=" * 72]
        for key in (
            "status", "steps", "wall_s", "warmup_s", "reward_first", "reward_last",
            "accuracy_first", "accuracy_last", "eval_accuracy_before", "eval_accuracy_after",
            "num_samples", "tokens_per_s", "weight_version",
        ):  # fmt: skip
            if key in summary:
                value = summary[key]
                lines.append(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
        failures = summary.get("failures", [])
        lines.append(f"{'worker failures':>22}: {len(failures)}")
        for failure in failures:
            recovery = failure.get("recovery_s")
            done = (
                "not recovered"
                if recovery is None
                else f"recovered by {failure['recovery']} in {recovery:.2f}s"
            )
            if failure.get("requests_in_flight") is not None:
                done += (
                    f"; {failure['requests_in_flight']} stream(s) in flight on it,"
                    f" {failure.get('requests_resumed') or 0} resumed by the router"
                )
            lines.append(
                f"{'':>22}  {failure['slot']} killed at step {failure['step']} ({failure['trigger']}): {done}"
            )
        lines.append(f"{'resumed requests':>22}: {summary.get('num_resumed', 0)}")
        if "resumed_at_step" in summary:  # belayer-grpo train --resume
            lines.append(
                f"{'resumed run':>22}: step {summary['resumed_at_step']}, "
                f"{summary['trajectories_reused']} trajectories reused, "
                f"{summary['trajectories_regenerated']} regenerated, "
                f"{summary['steps_replayed']} step(s) trained again from their logs"
            )
            if "requests_reattached" in summary:  # the killed trainer's rollout host was adopted
                lines.append(
                    f"{'re-attached':>22}: {summary['requests_reattached']} request(s) the router held "
                    f"({summary['tokens_reattached']} tokens not generated again), "
                    f"{summary['trajectories_new']} never sent before the kill"
                )
            if "trajectories_reattached" in summary:  # agentic: the begun trajectories continued
                lines.append(
                    f"{'':>22}  {summary['trajectories_reattached']} trajectories continued where they were: "
                    f"{summary['sandboxes_restored_from_checkpoint']} sandbox(es) restored from a checkpoint, "
                    f"{summary['actions_replayed']} logged action(s) run again"
                    + (
                        f", {summary['rebuild_failures_recovered']} sandbox failure(s) meanwhile recovered"
                        if summary.get("rebuild_failures_recovered")
                        else ""
                    )
                    + (
                        f", {summary['reattached_inconsistent']} whose replay returned other than logged "
                        "(rewound to a checkpoint)"
                        if summary["reattached_inconsistent"]
                        else ""
                    )
                )
        for loss in summary.get("node_losses", []):
            seen = sorted((loss.get("detections_s") or {}).items(), key=lambda item: item[1])
            when = ", ".join(f"{name} {at:.2f}s" for name, at in seen)  # after the node was removed
            lines.append(
                f"{'node lost':>22}: {loss['node_id'][:12]} at step {loss['step']}"
                f" (seen first by {loss['detected_by']}{': ' + when if when else ''}):"
                f" {loss['requests_resumed']} requests resumed elsewhere,"
                f" {loss['sandboxes_restored']} sandboxes restored elsewhere, tokens lost {loss['tokens_lost']},"
                f" recovered in {loss['time_to_recover_s']:.2f}s; continuing on {len(loss['slots_left'])} slot(s)"
                " (no spare capacity)"
            )
        env = summary.get("env")
        if env:
            lines.append(
                f"{'sandbox failures':>22}: {env['sandbox_failures']} in {env['trajectories']} trajectories"
                f" ({env['recoveries_from_checkpoint']} restored from a checkpoint,"
                f" {env['recoveries_from_scratch']} from scratch)"
            )
            lines.append(
                f"{'recovery':>22}: restore {env['restore_s_mean']:.2f}s avg / {env['restore_s_max']:.2f}s max"
                f" ({env.get('restores_into_spare', 0)} into a spare container),"
                f" {env['tokens_regenerated']} tokens regenerated"
            )
            lines.append(
                f"{'env checkpoints':>22}: {env['checkpoints']} ({env['checkpoint_failures']} failed),"
                f" {env.get('checkpoint_s_total', 0.0):.1f}s taking them,"
                f" {env.get('checkpoint_waited_s_total', 0.0):.2f}s of it on the critical path;"
                f" prefix-consistent: {'yes' if env['all_prefix_consistent'] else 'NO'}"
            )
            by_kind = env.get("checkpoints_by_kind") or {}
            if any(by_kind.values()):
                seconds = env.get("checkpoint_s_by_kind") or {}
                waited = env.get("checkpoint_waited_s_by_kind") or {}
                parts = [
                    f"{kind} {count} ({seconds.get(kind, 0.0):.1f}s, {waited.get(kind, 0.0):.2f}s waited)"
                    for kind, count in by_kind.items()
                    if count
                ]
                lines.append(
                    f"{'checkpoint kinds':>22}: {', '.join(parts)};"
                    f" asking the kind {env.get('kind_query_s_total', 0.0):.1f}s (overlapped; waited"
                    f" {env.get('decide_waited_s_total', 0.0):.2f}s where no checkpoint followed)"
                )
            lines.append(
                f"{'unrecoverable':>22}: {env.get('unrecoverable_trajectories', 0)} trajectories ->"
                f" {env.get('resampled_groups', 0)} groups resampled ({env.get('group_resamples', 0)} times),"
                f" {env.get('dropped_groups', 0)} groups dropped; {env.get('checkpoint_fallbacks', 0)}"
                " fallbacks to an earlier checkpoint"
            )
            for error in env.get("unrecoverable_errors", [])[:5]:
                lines.append(f"{'':>22}  {error[:200]}")
            for r in env.get("recoveries", [])[:20]:
                if r["from_checkpoint"]:
                    kind = f"{r['restored_kind']} " if r.get("restored_kind") else ""
                    source = f"{kind}checkpoint at action {r['restored_prefix']} (turn {r['restored_turn']})"
                elif r["prefix_consistent"]:
                    source = "the start (image and prompt)"
                else:
                    source = "a fresh image, context kept (state lost)"
                lines.append(
                    f"{'':>22}  step {r['step']} {'-'.join(r['trajectory'].rsplit('-', 2)[-2:])}: {r['reason']} at turn"
                    f" {r['failed_turn']} -> from {source}, {r['turns_replayed']} turns /"
                    f" {r['tokens_regenerated']} tokens regenerated, {r['restore_s']:.2f}s,"
                    f" {'consistent' if r['prefix_consistent'] else 'INCONSISTENT'}, reward {r['reward']:.0f}"
                )
            if len(env.get("recoveries", [])) > 20:
                lines.append(f"{'':>22}  ... (all of them in report.json)")
        if "plot" in summary:
            lines.append(f"{'plot':>22}: {summary['plot']}")
        lines.append(f"{'run folder':>22}: {self.run_dir}")
        lines.append("=" * 72)
        return "\n".join(lines)

    def close(self) -> None:
        """Close the bar and the files."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
