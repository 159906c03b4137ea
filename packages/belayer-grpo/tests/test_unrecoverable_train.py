"""`belayer-grpo train` where trajectories cannot be recovered: the run goes on to the end.

The default tool-use workload with ``rollout.max_recoveries=0`` and sandboxes killed with
p = 0.2 per action: every killed trajectory is unrecoverable.  With the default
``rollout.on_unrecoverable = resample`` its group is sampled again (up to
``rollout.max_resamples`` times) and then dropped.  The run must complete, every step's batch
must be whole groups of trajectories that finished, and the report and ``metrics.jsonl`` must
count the resampled and dropped groups.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.docker]

STEPS = 3
GROUP = 2


def test_unrecoverable_trajectories_are_resampled_or_dropped_and_the_run_completes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "belayer_grpo", "train", f"system.run_dir={str(run_dir)!r}",
            f"algorithm.steps={STEPS}", "system.checkpoint_every=0", "logging.progress=false",
            "logging.tensorboard=false", "data.held_out=2", "model.warmup_steps=40",
            "rollout.batch_size=3", f"rollout.samples_per_prompt={GROUP}", "rollout.max_recoveries=0",
            "rollout.max_resamples=1", "chaos.sandbox_kill_p=0.2", "chaos.kill_worker_at_steps=[]"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed", log
    assert report["steps"] == STEPS
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trajectories = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]

    env = report["env"]
    assert env["unrecoverable_trajectories"] >= 1, log  # the kills are seeded: this is fixed
    assert env["unrecoverable_trajectories"] == sum(m["env_unrecoverable"] for m in metrics)
    assert env["resampled_groups"] == sum(m["env_resampled_groups"] for m in metrics) >= 1
    assert env["dropped_groups"] == sum(m["env_dropped_groups"] for m in metrics)
    assert env["sandbox_failures"] == 0  # nothing recovered: every killed trajectory was given up
    assert "UnrecoverableTrajectoryError" in " ".join(env["unrecoverable_errors"])
    assert "unrecoverable:" in log
    assert "groups resampled" in log

    # Each step trained on whole groups that finished, and only on those.
    for m in metrics:
        assert m["num_groups"] + m["env_dropped_groups"] == 3
        assert m["num_trajectories"] == m["num_groups"] * GROUP
    assert report["num_samples"] == sum(m["num_trajectories"] for m in metrics) == len(trajectories)
    assert all(t["num_failures"] == 0 for t in trajectories)
