"""End to end on CPU: the real router, engine slots (memory servers, main and shadow workers) and
trainer; GRPO raises the reward on the math workload while a worker is killed mid-rollout."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest

from belayer_grpo._config import load_config
from belayer_grpo._run import run_training

pytestmark = pytest.mark.e2e


def test_short_run_raises_accuracy_and_survives_a_worker_kill(tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            "data.workload=math",
            f"system.run_dir={str(tmp_path / 'run')!r}",
            "algorithm.steps=12",
            "chaos.kill_worker_at_steps=[3]",
            "system.checkpoint_every=6",
            "logging.progress=false",
        ],
    )
    out = io.StringIO()
    summary = anyio.run(lambda: run_training(config, stream=out))
    run_dir = tmp_path / "run"
    assert summary["status"] == "completed", out.getvalue()
    assert summary["eval_accuracy_after"] > summary["eval_accuracy_before"], out.getvalue()
    # The injected failure was recovered by the shadow, and requests in flight were resumed.
    (failure,) = summary["failures"]
    assert failure["step"] == 3
    assert failure["recovery"] == "shadow"
    assert failure["recovery_s"] is not None
    assert summary["num_resumed"] > 0
    assert "recovered by shadow" in out.getvalue()
    # Every step served the weights of the step before: router logprobs equal the trainer's.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert [m["weight_version"] for m in metrics] == list(range(2, 14))
    assert max(m["logprob_gap"] for m in metrics) < 1e-3
    # The step-0 checkpoint (the policy after the warm-up: a kill before step 6 is resumable), then
    # every `checkpoint_every` steps.
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_000000.pt", "step_000006.pt", "step_000012.pt"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run_dir / "report.json").read_text())["status"] == "completed"
    # Nothing left running: no memory-server sockets remain.
    assert not list(run_dir.rglob("*.sock"))
