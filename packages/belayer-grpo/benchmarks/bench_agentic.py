"""Agentic rollouts under sandbox chaos: checkpoint policies against the `never` baseline.

Real Docker + CRIU sandboxes, the real router and the real checkpoint policy; the LLM is the
tests' scripted `FakePolicyWorker` (streaming at a fixed per-token delay, so responses take a
realistic share of each round).  Every policy sees the same tasks, scripts and seeded kill
decisions per step.  Prints a markdown table and saves it as JSON under ``benchmarks/results``.

    python benchmarks/bench_agentic.py [--samples 2] [--probabilities 0 0.1 0.2] \
        [--policies adaptive always every:2 never] [--token-delay 0.02] [--seed 7]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from agentic_support import agentic_config, router_with_worker

from belayer_envckpt import Engine
from belayer_grpo.agentic import build_task_image, builtin_tasks, run_agentic_rollouts, summarize

RESULTS = Path(__file__).parent / "results" / "bench_agentic.json"


async def one_run(
    engine: Engine, image: str, policy: str, p: float, args: argparse.Namespace
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        config = agentic_config(
            Path(root), image=image, checkpoint_policy=policy, sandbox_kill_probability=p, seed=args.seed,
            max_concurrency=args.concurrency,
        )  # fmt: skip
        async with router_with_worker(token_delay=args.token_delay) as (client, _worker, _url):
            started = time.monotonic()
            trajectories = await run_agentic_rollouts(
                builtin_tasks(), client, config, num_samples=args.samples, engine=engine,
                run_id=f"bench-{policy.replace(':', '')}-{int(p * 100)}",
            )  # fmt: skip
            wall = time.monotonic() - started
    totals = summarize(trajectories)
    rounds = [r.rounds_regenerated for t in trajectories for r in t.recoveries]
    return {
        "policy": policy,
        "p": p,
        "wall_s": wall,
        "slowest_trajectory_s": max(t.wall_seconds for t in trajectories),
        "trajectories": len(trajectories),
        "solved": sum(t.reward == 1.0 for t in trajectories),
        "rounds_regenerated": sum(rounds),
        **totals,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| p | policy | batch wall s | vs never | failures | from checkpoint | rounds regenerated "
        "| tokens regenerated | checkpoints | restore s (mean / max) | solved | prefix-consistent |"
    )
    lines = [head, "|" + "---|" * 12]
    never = {r["p"]: r["wall_s"] for r in rows if r["policy"] == "never"}
    for r in rows:
        base = never.get(r["p"])
        versus = f"{(r['wall_s'] / base - 1) * 100:+.0f} %" if base else "n/a"
        lines.append(
            f"| {r['p']:.2f} | {r['policy']} | {r['wall_s']:.1f} | {versus} | {r['num_failures']} "
            f"| {r['num_recoveries_from_checkpoint']} | {r['rounds_regenerated']} | {r['tokens_regenerated']} "
            f"| {r['num_checkpoints']} | {r['restore_seconds_mean']:.2f} / {r['restore_seconds_max']:.2f} "
            f"| {r['solved']}/{r['trajectories']} | {'yes' if r['all_prefix_consistent'] else 'NO'} |"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--samples", type=int, default=2, help="trajectories per task (3 tasks)")
    parser.add_argument("--probabilities", type=float, nargs="+", default=[0.0, 0.1, 0.2])
    parser.add_argument("--policies", nargs="+", default=["adaptive", "always", "every:2", "never"])
    parser.add_argument("--token-delay", type=float, default=0.02, help="seconds per streamed token")
    parser.add_argument("--concurrency", type=int, default=6, help="sandboxes alive at once")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    engine = Engine.connect()
    engine.require_checkpoint_support()
    image = build_task_image(engine, builtin_tasks())
    rows = []
    try:
        for p in args.probabilities:
            for policy in args.policies:
                row = await one_run(engine, image, policy, p, args)
                print(
                    f"p={p} {policy}: {row['wall_s']:.1f} s, {row['num_failures']} failures", file=sys.stderr
                )
                rows.append(row)
    finally:
        engine.close()
    text = table(rows)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(args), "rows": rows, "table": text}, indent=1) + "\n")


if __name__ == "__main__":
    anyio.run(main)
