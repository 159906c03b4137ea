"""The scale simulation's table and plot: effective training time ratio per strategy, 1,024-16,384 GPUs.

Two scenarios, each strategy on the same failure traces: the agentic job (the default inputs, with
sandbox losses) and a job without sandboxes (`sandbox_losses_per_node_day = 0`). Inputs are the
defaults, Belayer's measured recovery times among them (the package's committed
`measured_inputs.json`: `benchmarks/update_measured_inputs.py` regenerates it from the siblings'
results files first when one of them was re-run).

    python benchmarks/simulate_scale.py [--days 30] [--reps 20] [--seed 0] [--out benchmarks/results]

(run from packages/belayer-cluster; needs matplotlib: `pip install -e '.[bench]'`). Writes
`simulate_scale.json`, `simulate_scale.md` and `simulate_scale.png` under `--out`. A simulation:
nothing here is measured on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from belayer_cluster.simulate import (
    INPUT_SOURCES,
    SimInputs,
    Strategy,
    inputs_table,
    load_measured_inputs,
    markdown_table,
    simulate_scale,
)

_LABELS = {
    Strategy.JOB_RESTART: "(a) restart the job from its checkpoint",
    Strategy.ROLE_RESTART: "(b) restart the failed role",
    Strategy.BELAYER: "(c) Belayer",
}


def _plot(scenarios: dict[str, list], path: Path) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4.5), sharey=True)
    for axis, (title, results) in zip(axes, scenarios.items(), strict=True):
        for strategy in Strategy:
            rows = sorted((r for r in results if r.strategy is strategy), key=lambda r: r.gpus)
            axis.errorbar(
                [r.gpus for r in rows],
                [r.mean for r in rows],
                yerr=[r.ci95 for r in rows],
                marker="o",
                capsize=3,
                label=_LABELS[strategy],
            )
        axis.set_xscale("log", base=2)
        axis.set_xticks([1024, 2048, 4096, 8192, 16384], ["1,024", "2,048", "4,096", "8,192", "16,384"])
        axis.set_xlabel("GPUs (8 per node)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("effective training time ratio (mean, 95% CI)")
    axes[0].legend(loc="lower left")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    measured = load_measured_inputs()
    sources = {name: info.source for name, info in INPUT_SOURCES.items()} | {
        n: s for n, (_, s) in measured.items()
    }
    agentic = SimInputs()  # its measured defaults are the committed measured_inputs.json
    plain = agentic.replace(sandbox_losses_per_node_day=0.0)
    started = time.monotonic()
    scenarios = {
        "agentic GRPO (sandbox losses 0.1 per rollout node-day)": simulate_scale(
            agentic, days=args.days, repetitions=args.reps, seed=args.seed
        ),
        "GRPO without sandboxes": simulate_scale(
            plain, days=args.days, repetitions=args.reps, seed=args.seed
        ),
    }
    elapsed_s = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    command = (
        f"python benchmarks/simulate_scale.py --days {args.days:g} --reps {args.reps} --seed {args.seed}"
    )
    document = {
        "command": command,
        "days": args.days,
        "repetitions": args.reps,
        "seed": args.seed,
        "elapsed_s": elapsed_s,
        "inputs": {
            name: {
                "value": getattr(agentic, name),
                "unit": info.unit,
                "source": sources[name],
                "note": info.note,
            }
            for name, info in INPUT_SOURCES.items()
        },
        "scenarios": {title: [r.to_json() for r in results] for title, results in scenarios.items()},
    }
    (args.out / "simulate_scale.json").write_text(json.dumps(document, indent=1) + "\n")
    parts = [f"Written by `{command}` (from packages/belayer-cluster). A simulation, not a measurement.\n"]
    for title, results in scenarios.items():
        parts.append(
            f"### {title}\n\nEffective training time ratio, mean ± 95% CI over {args.reps} runs of "
            f"{args.days:g} days each (seed {args.seed}):\n\n{markdown_table(results)}\n"
        )
    parts.append(f"### Inputs (agentic scenario)\n\n{inputs_table(agentic, sources)}\n")
    markdown = "\n".join(parts)
    (args.out / "simulate_scale.md").write_text(markdown)
    _plot(scenarios, args.out / "simulate_scale.png")
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
