"""`belayer-grpo train data.workload=swe` end to end: the real router, engine slot (main and shadow
worker), Docker + CRIU sandboxes, checkpoint policy and GRPO trainer, with sandboxes killed at
p = 0.2 per environment step and the main worker killed mid-rollout.

The policy is tiny and random apart from a brief warm-up on the action format, so it takes
environment steps (``ACTION: ls`` and the like) but solves nothing: the reward is 0, and the test
is about the system: every sample arrives, every recovery is prefix-consistent, nothing remains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from test_sigint import _tagged_pids

from belayer_envckpt import Engine
from belayer_grpo._agentic.pool import POOL_LABEL
from belayer_grpo._guardian import RUN_LABEL, run_marker
from belayer_grpo._rollout_agentic import run_tag
from belayer_policy import load_trace

pytestmark = [pytest.mark.e2e, pytest.mark.docker]

TASKS, SAMPLES, STEPS = 3, 2, 2


def test_swe_training_survives_sandbox_and_worker_kills_and_leaves_nothing(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "belayer_grpo",
        "train",
        "data.workload=swe",
        f"system.run_dir={str(run_dir)!r}",
    ]
    argv += [
        f"algorithm.steps={STEPS}", f"rollout.batch_size={TASKS}", f"rollout.samples_per_prompt={SAMPLES}",
        "rollout.max_rounds=4", "rollout.max_tokens=24", "algorithm.num_minibatches=2",
        "rollout.env_checkpoint_policy=always", "chaos.sandbox_kill_p=0.2", "chaos.kill_worker_at_steps=[1]",
        "model.warmup_steps=40", "model.warmup_batch_size=8", "system.checkpoint_every=0",
        "logging.tensorboard=false", "logging.progress=false",
    ]  # fmt: skip
    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, env={**os.environ, "BELAYER_TEST_TAG": tag}
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log

    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed"
    assert report["workload"] == "swe"
    # No sample lost: every task's group is complete in every step.
    assert report["num_samples"] == STEPS * TASKS * SAMPLES
    trajectories = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trajectories] == [1] * TASKS * SAMPLES + [2] * TASKS * SAMPLES
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["num_trajectories"] for m in metrics] == [TASKS * SAMPLES] * STEPS
    assert [m["weight_version"] for m in metrics] == [2, 3]

    # Sandboxes were killed and every recovery put environment and context back on the same prefix.
    env = report["env"]
    assert env["sandbox_failures"] >= 1, log
    assert env["sandbox_failures"] == sum(t["num_failures"] for t in trajectories)
    assert env["checkpoints"] >= 1
    assert env["all_prefix_consistent"] is True
    for trajectory in trajectories:
        assert trajectory["prefix_consistent"] is True
        assert all(r["prefix_consistent"] for r in trajectory["recoveries"])
        assert trajectory["rounds"] >= 1
    assert "sandbox failures" in log
    assert "prefix-consistent: yes" in log

    # The agentic trace, in belayer-policy's format (its own loader reads it): one line per
    # trajectory that committed a step, with the measured step times.
    lines = [json.loads(line) for line in (run_dir / "trace.jsonl").read_text().splitlines()]
    trace = load_trace(run_dir / "trace.jsonl")
    assert len(trace) == len(lines) == sum(1 for t in trajectories if t["num_actions"] >= 1)
    for (
        line,
        loaded,
    ) in zip(lines, trace, strict=True):
        assert loaded.num_steps == len(line["response_s"]) >= 1
        assert loaded.task in {t["task_id"] for t in trajectories}
        assert line["meta"]["step"] in (1, 2)
        # Each step with its checkpoint measured says the checkpoint's kind (issue 34).
        kinds = line.get("checkpoint_kind", [None] * loaded.num_steps)
        for seconds, kind in zip(line["checkpoint_s"], kinds, strict=True):
            assert seconds is None or kind in ("full", "fresh-runtime", "reference")
    assert sum(len(line["restore_s"]) for line in lines) <= env["sandbox_failures"]

    # The worker killed in step 1 was replaced by the shadow; responses in flight were resumed.
    (failure,) = report["failures"]
    assert (failure["step"], failure["recovery"]) == (1, "shadow")
    assert failure["recovery_s"] is not None
    assert "recovered by shadow" in log
    # The kill is aimed at the slot with responses in flight; each such response the router
    # resumed is counted on its sample. (A response can end between the router's answer and the
    # kill: then none was cut, the router resumed none, and there is nothing to count.)
    assert failure["requests_in_flight"] >= 1
    assert failure["requests_resumed"] >= 0
    if failure["requests_resumed"] >= 1:
        assert report["num_resumed"] >= 1
    assert "resumed by the router" in log

    # Nothing left behind: no process of the run, no sandbox container of its pools, no socket.
    assert _tagged_pids(tag) == []
    engine = Engine.connect()
    try:
        containers = engine.list_containers([POOL_LABEL])
        ours = [
            c.name
            for c in containers
            if c.labels.get("belayer.trajectory", "").startswith(run_tag(run_dir))
            or c.labels.get(RUN_LABEL) == run_marker(run_dir)  # its spares and restores into them
        ]
    finally:
        engine.close()
    assert ours == []
    assert not list(run_dir.rglob("*.sock"))
    assert not list((run_dir / "env-checkpoints").rglob("*"))
