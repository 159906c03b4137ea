"""The benchmark report: markdown tables (every row with its baseline), PNG plots, raw JSON."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["render_markdown", "write_plots", "write_report"]


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(stats: dict[str, Any]) -> str:
    if not stats or stats.get("mean") is None:
        return "-"
    return f"{stats['mean']:+.1%} ± {stats['std']:.1%} (n={stats['n']})"


def _ms(stats: dict[str, Any]) -> str:
    if not stats or stats.get("mean") is None:
        return "-"
    return f"{stats['mean']:.2f} ± {stats['std']:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _overhead(results: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in results:
        rows.append([r["workload"], r["on"], str(r["steps"]), _ms(r["on_s"]), _ms(r["off_s"]), r["off"],
                     _pct(r["overhead"]), f"{r['noise_floor']:.1%}"])  # fmt: skip
        if "always" in r:
            a = r["always"]
            rows.append(["swe", "always checkpoint (reference)", str(r["steps"]), _ms(a["on_s"]), _ms(a["off_s"]),
                         r["off"], _pct(a["overhead"]), f"{a['noise_floor']:.1%}"])  # fmt: skip
    header = ["workload", "Belayer on", "steps", "time on (s)", "baseline time off (s)", "baseline (off)",
              "overhead (paired, mean ± std)", "noise floor"]  # fmt: skip
    lines = _table(header, rows)
    math = [r for r in results if "breakdown" in r]
    if math:
        lines += [
            "",
            "Where the math step time goes (seconds per steady-state step, mean ± std over steps):",
            "",
        ]
        parts = []
        for r in math:
            for arm, label in (("shadow", r["on"]), ("conventional", r["off"])):
                b = r["breakdown"][arm]
                parts.append([r["workload"], label, _ms(b["step_s"]), _ms(b["rollout_s"]), _ms(b["sync_s"])])
        lines += _table(["workload", "arm", "step", "rollout", "weight push (sync)"], parts)
    return lines


def _worker_failure(result: dict[str, Any]) -> list[str]:
    shadow = result["modes"]["shadow"]
    baselines = [(name, label) for name, label in (
        ("restart", "baseline: restart (instant detection, token resume)"),
        ("conventional", "baseline: conventional recovery"),
    ) if name in result["modes"]]  # fmt: skip
    header = ["quantity (s, mean ± std)", "Belayer (shadow handover)", *(label for _, label in baselines)]
    header += [f"speed-up vs {name}" for name, _ in baselines]
    rows = []
    for key, label in (("step_added_s", "time added to the step (rollout)"),
                       ("trajectory_added_s", "time added to an affected trajectory"),
                       ("detection_s", "detection"), ("recovery_s", "handover / engine reconstruction"),
                       ("resume_or_regeneration_s", "resume / regeneration (rest of the trajectory's delay)"),
                       ("rollout_free_s", "failure-free rollout (same seeds)"),
                       ("num_affected", "affected samples (resumed)")):  # fmt: skip
        a = shadow[key]
        ratios = []
        for name, _ in baselines:
            b = result["modes"][name][key]
            ratio = "-"
            if key.endswith("added_s") and a.get("mean") and b.get("mean") and a["mean"] > 0:
                ratio = f"{b['mean'] / a['mean']:.1f}x"
            ratios.append(ratio)
        rows.append([label, _ms(a), *(_ms(result["modes"][name][key]) for name, _ in baselines), *ratios])
    equal = all(r["outputs_equal"] for m in result["modes"].values() for r in m["repeats"])
    return [*_table(header, rows), "", f"Outputs with the failure equal the failure-free outputs: {equal}."]


def _env_failures(result: dict[str, Any]) -> list[str]:
    header = [
        "kill p / step",
        "policy",
        "rollout (s)",
        "baseline failure-free, never (s)",
        "increase (mean ± std)",
        "failures",
        "restored from checkpoint",
        "checkpoints",
        "tokens regenerated",
        "prefix-consistent",
    ]
    rows = [[f"{r['kill_p']:g}", r["policy"], _ms(r["rollout_s"]), _ms(r["baseline_s"]), _pct(r["increase"]),
             str(r["num_failures"]), str(r["num_recoveries_from_checkpoint"]), str(r["num_checkpoints"]),
             str(r["tokens_regenerated"]), str(r["all_prefix_consistent"])] for r in result["rows"]]  # fmt: skip
    return _table(header, rows) + _separation(result.get("separation")) + _simulator(result.get("simulator"))


def _simulator(sim: dict[str, Any] | None) -> list[str]:
    if not sim or not sim["batches"]:
        return [] if not sim or "error" not in sim else ["", f"Simulator check failed: {sim['error']}"]
    low, high = sim["difference_ci95_s"] or (0.0, 0.0)
    verdict = "agrees" if sim["agrees"] else "does not agree"
    return ["", f"belayer-policy's simulator, replaying the recorded traces of the {sim['batches']} batches "
            f"with failures (and their seeds' baselines), **{verdict}** with the measured rollout-time increase: "
            f"measured minus simulated {sim['difference_s']:+.2f} s, 95% CI [{low:+.2f}, {high:+.2f}] s."]  # fmt: skip


def _separation(sep: dict[str, Any] | None) -> list[str]:
    if not sep:
        return []
    verdict = "separate" if sep["separated"] else "do not separate"
    stop = {"separated": "they separated", "max_repeats": f"the cap of {sep['max_repeats']} seeds",
            "max_repeat_s": f"the cap of {sep['max_repeat_s']:.0f} s of repeats"}[sep["stopped_by"]]  # fmt: skip
    lines = ["", f"At p = {sep['kill_p']:g} the 95% confidence intervals of the increase of never and adaptive "
             f"**{verdict}** after {sep['seeds']} seeds (stopped by {stop}).", ""]  # fmt: skip
    header = [
        "policy",
        "seeds",
        "increase (mean ± std)",
        "95% CI of the mean",
        "failures observed",
        "checkpoints",
    ]
    rows = []
    for policy, arm in sep["arms"].items():
        ci = arm["increase_ci95"]
        rows.append([policy, str(arm["n"]), _pct(arm["increase"]), "-" if ci is None else f"[{ci[0]:+.1%}, {ci[1]:+.1%}]",
                     str(arm["num_failures"]), str(arm["num_checkpoints"])])  # fmt: skip
    return lines + _table(header, rows)


def _checkpoint_cost(result: dict[str, Any]) -> list[str]:
    if not result["num_checkpoints"]:
        return ["No checkpoint was taken in this run."]
    header = ["checkpoints", "p50 (s)", "p90 (s)", "p99 (s)", "mean ± std (s)", "overlapping response (s)",
              "total (s)", "hidden by response bubbles (s)", "on the critical path (measured, s)",
              "baseline: blocking checkpoints (s)", "hidden share", "fully hidden"]  # fmt: skip
    row = [str(result["num_checkpoints"]), _s(result["p50_s"]), _s(result["p90_s"]), _s(result["p99_s"]),
           _ms(result["seconds"]), _ms(result["response_s"]), _s(result["total_s"]), _s(result["hidden_s"]),
           _s(result["exposed_s"]), _s(result["total_s"]), f"{result['hidden_fraction']:.0%}",
           f"{result['fully_hidden']}/{result['num_checkpoints']}"]  # fmt: skip
    lines = _table(header, [row])
    arms = result.get("arms")
    if arms and arms["blocking"]["num_checkpoints"]:
        overlapped, blocking = arms["overlapped"], arms["blocking"]
        header = ["arm (always, no failures)", "checkpoints", "checkpoint time (s)", "rollout (s)",
                  "added to the critical path (s)", "baseline: blocking, rollout (s)",
                  "baseline: blocking, added to the critical path (s)"]  # fmt: skip
        rows = [["overlapped with the next response", str(overlapped["num_checkpoints"]),
                 _s(overlapped["checkpoint_s"]), _ms(overlapped["rollout_s"]), _s(overlapped["critical_path_s"]),
                 _ms(blocking["rollout_s"]), _s(blocking["critical_path_s"])]]  # fmt: skip
        lines += ["", *_table(header, rows)]
    return lines


_ROLES = {
    "adaptive": "Belayer: adaptive checkpoints, restore with the LLM context",
    "never": "baseline: restart from scratch",
    "replay": "baseline: verbatim replay of the actions (no Belayer)",
}


def _build_recovery(result: dict[str, Any]) -> list[str]:
    arms = result["arms"]
    base = arms.get("adaptive", {}).get("rollout_s_mean") or 0.0
    header = ["arm", "what it is (baseline or Belayer)", "batches", "rollout s (mean)", "vs adaptive",
              "sandbox failures", "restored from checkpoint",
              "from scratch", "replayed", "inconsistent recoveries", "reward of a perfect agent",
              "tokens regenerated", "checkpoints (kinds)"]  # fmt: skip
    rows = []
    for name, arm in arms.items():
        kinds = ", ".join(f"{count} {kind}" for kind, count in arm["checkpoints"].items() if count) or "0"
        versus = f"{arm['rollout_s_mean'] / base - 1:+.0%}" if base and name != "adaptive" else ""
        rows.append([name, _ROLES.get(name, name), str(arm["batches"]), _s(arm["rollout_s_mean"], 1), versus, str(arm["failures"]),
                     str(arm["from_checkpoint"]), str(arm["from_scratch"]), str(arm["replayed"]),
                     f"{arm['inconsistent']} of {arm['failures']}", f"{arm['reward_mean']:.2f}",
                     str(arm["tokens_regenerated"]), kinds])  # fmt: skip
    return _table(header, rows)


_SECTIONS: dict[str, tuple[str, Callable[[Any], list[str]], str]] = {
    "overhead": ("Failure-free overhead", _overhead, "overhead.png"),
    "worker-failure": ("Rollout-worker failure", _worker_failure, "worker_failure.png"),
    "env-failures": ("Environment failures", _env_failures, "env_failures.png"),
    "checkpoint-cost": ("Checkpoint cost", _checkpoint_cost, "checkpoint_cost.png"),
    "build-recovery": ("Build tasks: adaptive vs restart vs replay", _build_recovery, ""),
}


def render_markdown(results: dict[str, Any], plots: dict[str, str]) -> str:
    """The report's text: a header with the setting, then one section per experiment run."""
    meta = results["meta"]
    lines = ["# Belayer benchmark report", "",
             f"`{meta['command']}` — scale **{meta['scale']}**, {meta['machine']}, {meta['started']}, "
             f"{meta['wall_s']:.0f} s in all.", ""]  # fmt: skip
    if meta["scale"] != "full":
        lines += [
            "Small scale on a CPU machine; the GPU-scale configuration (`--scale full`) was not run here.",
            "",
        ]
    for note in meta.get("notes", []):
        lines += [f"- {note}"]
    lines.append("")
    for name, (title, render, _png) in _SECTIONS.items():
        if name not in results["experiments"]:
            continue
        lines += [f"## {title}", "", *results["descriptions"].get(name, []), ""]
        lines += [*render(results["experiments"][name]), ""]
        if name in plots:
            lines += [f"![{title}]({plots[name]})", ""]
    lines += ["Raw results: `results.json`.", ""]
    return "\n".join(lines)


def write_plots(results: dict[str, Any], out_dir: Path) -> dict[str, str]:
    """One PNG per experiment (needs the ``bench`` extra: matplotlib); returns name -> file name."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from belayer_grpo._bench import plots
    except ImportError:
        return {}
    written = {}
    for name, (_title, _render, png) in _SECTIONS.items():
        if name in results["experiments"] and png:  # a table only: no plot
            plotter: Any = plots.PLOTTERS[name]
            plotter(results["experiments"][name], out_dir / png)
            written[name] = png
    return written


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    """``report.md``, the plots and ``results.json`` in ``out_dir``; returns the report's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    plots = write_plots(results, out_dir)
    path = out_dir / "report.md"
    path.write_text(render_markdown(results, plots))
    return path
