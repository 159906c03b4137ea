"""`belayer-grpo bench`: configuration errors, and a real run of the worker-failure experiment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_grpo._bench import EXPERIMENTS, load_bench_config, quick_config
from belayer_grpo._bench.agent_worker import ScriptedAgentWorker, script_for
from belayer_grpo._bench.env_failures import checkpoint_costs
from belayer_grpo._bench.report import _build_recovery
from belayer_grpo._bench.stats import relative_change, summarize
from belayer_grpo._cli import main
from belayer_grpo._errors import GrpoConfigError


def test_small_and_full_configurations_load() -> None:
    small = load_bench_config()
    full = load_bench_config(scale="full")
    assert small.scale == "small"
    assert full.scale == "full"
    assert full.worker_failure.backend == "cuda"
    assert small.worker_failure.backend == "host"
    assert quick_config(small).overhead.repeats < small.overhead.repeats


def test_unknown_key_and_bad_value_name_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[overhead]\nrepeat = 3\n")
    with pytest.raises(GrpoConfigError, match=r"overhead\.repeat"):
        load_bench_config(bad)
    bad.write_text("[env_failures]\npolicies = ['sometimes']\n")
    with pytest.raises(GrpoConfigError, match=r"env_failures\.policies"):
        load_bench_config(bad)
    bad.write_text("[worker_failure]\nrepeats = 0\n")
    with pytest.raises(GrpoConfigError, match="worker_failure"):
        load_bench_config(bad)


def test_cli_rejects_an_unknown_experiment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--experiment", "speed", "--out", str(tmp_path)]) == 2
    assert "unknown experiment 'speed'" in capsys.readouterr().err


def test_statistics() -> None:
    stats = summarize([1.0, 2.0, 3.0])
    assert stats["mean"] == 2.0
    assert stats["std"] == 1.0
    assert stats["median"] == 2.0
    assert summarize([])["mean"] is None
    assert relative_change(1.01, 1.0) == pytest.approx(0.01)


def test_scripted_agent_follows_the_script() -> None:
    worker = ScriptedAgentWorker(1, rounds=5, action_s=0.0, token_delay_s=0.0, padding=10)
    commands = script_for("calc.py", 5, 0.0)
    assert len(commands) == 5
    assert commands[0] == "cat calc.py"
    assert "unittest" in commands[-1]
    key, text = worker.response("fix calc.py\n<observation exit=0>\nx</observation>\n")
    assert key == "calc.py/1"
    assert f"```bash\n{commands[1]}\n```" in text
    assert "submit" in worker.response("calc.py" + "<observation" * 5)[1]


def test_scripted_agent_answers_a_build_task_and_the_report_compares_the_recoveries() -> None:
    worker = ScriptedAgentWorker(1, rounds=3, action_s=0.0, token_delay_s=0.0, padding=0)
    prompt = "Build 375 into file a, cat it, reply ANSWER: the number you read\n"
    assert worker.response(prompt)[1] == "ACTION: mk 375\n"
    assert worker.response(prompt + "ACTION: mk 375\nOUT 0: kqfm 375\n")[1] == "ACTION: cat a\n"
    seen = prompt + "ACTION: mk 375\nOUT 0: kqfm 375\nACTION: cat a\nOUT 0: kqfm 375\n"
    assert worker.response(seen)[1] == "ANSWER: 375\n"

    def arm(rollout_s: float, inconsistent: int) -> dict[str, object]:
        return {"batches": 1, "rollout_s_mean": rollout_s, "failures": 4, "from_checkpoint": 2,
                "from_scratch": 2, "replayed": 0, "inconsistent": inconsistent, "reward_mean": 1.0,
                "tokens_regenerated": 10, "checkpoints": {"fresh-runtime": 3, "full": 0}}  # fmt: skip

    lines = _build_recovery(
        {"arms": {"adaptive": arm(10.0, 0), "never": arm(15.0, 0), "replay": arm(12.0, 3)}}
    )
    rows = [line for line in lines if line.startswith("| replay") or line.startswith("| never")]
    assert "+50%" in rows[0]
    assert "+20%" in rows[1]
    assert "3 of 4" in rows[1]
    assert "3 fresh-runtime" in lines[2]


def test_checkpoint_cost_accounts_hidden_and_exposed_time() -> None:
    runs = [{"checkpoints": [
        {"seconds": 0.5, "waited_s": 0.0, "hidden_s": 0.5, "exposed_s": 0.0, "response_s": 1.0, "turn": 1,
         "bytes": 10},
        {"seconds": 2.0, "waited_s": 1.0, "hidden_s": 1.0, "exposed_s": 1.0, "response_s": 1.0, "turn": 2,
         "bytes": 10},
    ]}]  # fmt: skip
    costs = checkpoint_costs(runs)
    assert costs["total_s"] == 2.5
    assert costs["hidden_s"] == 1.5
    assert costs["critical_path_s"] == 1.0
    assert costs["fully_hidden"] == 1
    assert costs["hidden_fraction"] == pytest.approx(0.6)
    assert costs["arms"] is None
    variants = [
        {"blocking": False, "rollout_s": 10.0, "checkpoints": runs[0]["checkpoints"]},
        {"blocking": True, "rollout_s": 12.5, "checkpoints": [
            {"seconds": 0.5, "waited_s": 0.5, "hidden_s": 0.0, "exposed_s": 0.5, "response_s": 1.0},
            {"seconds": 2.0, "waited_s": 2.0, "hidden_s": 0.0, "exposed_s": 2.0, "response_s": 1.0},
        ]},
    ]  # fmt: skip
    arms = checkpoint_costs(runs, variants)["arms"]
    assert arms["overlapped"]["critical_path_s"] == 1.0
    assert arms["blocking"]["critical_path_s"] == 2.5
    assert arms["blocking"]["rollout_s"]["mean"] == 12.5


def _tables(report: str) -> list[tuple[list[str], list[list[str]]]]:
    tables, lines = [], report.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip("|").split("|")])
            tables.append((header, rows))
    return tables


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_bench_worker_failure_writes_a_report_with_baselines(tmp_path: Path) -> None:
    config = tmp_path / "tiny.toml"
    config.write_text(
        "[worker_failure]\nrepeats = 1\nbatch_size = 2\nhealth_interval_s = 0.5\nhealth_misses = 2\n"
    )
    out = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, "-m", "belayer_grpo", "bench", "--config", str(config), "--quick",
         "--experiment", "worker-failure", "--out", str(out)],
        capture_output=True, text=True, timeout=840, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "## Rollout-worker failure" in report
    assert "was not run here" in report
    assert (out / "worker_failure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tables = _tables(report)
    assert tables, report
    for header, rows in tables:
        baseline = [i for i, name in enumerate(header) if "baseline" in name]
        assert baseline, f"table without a baseline column: {header}"
        assert rows
        assert all(row[baseline[0]] not in ("", "-") for row in rows), rows
    results = json.loads((out / "results.json").read_text())
    modes = results["experiments"]["worker-failure"]["modes"]
    for mode in ("shadow", "restart", "conventional"):
        (repeat,) = modes[mode]["repeats"]
        assert repeat["recovered"]
        assert repeat["num_affected"] > 0
        assert repeat["outputs_equal"]
    assert set(results["experiments"]) <= set(EXPERIMENTS)
