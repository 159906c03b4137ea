"""The scale simulation: hand-computed cases, properties over seeds, typed errors, the CLI's --json.

Pure computation (no Ray is started): the whole module runs in seconds.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from belayer_cluster import BelayerClusterError, ClusterConfigError
from belayer_cluster._cli import main
from belayer_cluster.simulate import (
    INPUT_SOURCES,
    MEASURED_INPUTS,
    Failure,
    FailureKind,
    ScaleResult,
    SimInputs,
    Strategy,
    checkpoint_every_steps,
    draw_failures,
    load_measured_inputs,
    markdown_table,
    run_job,
    simulate_scale,
)

# A step of 100 s rollout + 50 s train + 10 s sync, a 40 s checkpoint every 2 steps (320 s), so
# one failure-free cycle is 360 s and 3,600 s hold 10 cycles = 20 steps = 3,200 s of useful time.
SMALL = SimInputs(
    rollout_s=100.0,
    train_s=50.0,
    weight_sync_s=10.0,
    checkpoint_write_s=40.0,
    checkpoint_interval_s=320.0,
    checkpoint_restart_s=200.0,
    detection_s=0.0,
    worker_restart_s=30.0,
    shadow_handover_s=1.0,
    node_loss_resume_s=3.0,
    sandbox_restore_s=2.0,
    sandbox_restart_s=7.0,
)
GPUS = 64
USEFUL_S = 3200.0


def _ratio(strategy: Strategy, failures: list[Failure], horizon_s: float, inputs: SimInputs = SMALL) -> float:
    return run_job(inputs, strategy, GPUS, horizon_s, failures).ratio


@pytest.mark.parametrize("strategy", list(Strategy))
def test_without_failures_the_ratio_is_one_minus_the_checkpoint_overhead(strategy: Strategy) -> None:
    result = run_job(SMALL, strategy, GPUS, 3600.0, [])
    assert result.checkpoint_every_steps == 2
    assert result.steps == 20
    assert result.checkpoint_s == pytest.approx(400.0)
    assert result.ratio == pytest.approx(1 - 40.0 / 360.0)


# A worker crash 90 s into step 2's rollout (t = 250 s; step 1 ended at 160 s, no checkpoint yet):
# (a) loses everything since t = 0 and restarts: 250 + 200 s lost; (b) regenerates the worker's
# requests after a 30 s restart: the rollout ends 90 + 30 s late; (c) hands over in 1 s.
@pytest.mark.parametrize(
    ("strategy", "lost_s"),
    [(Strategy.JOB_RESTART, 450.0), (Strategy.ROLE_RESTART, 120.0), (Strategy.BELAYER, 1.0)],
)
def test_one_worker_crash_costs_exactly_what_each_strategy_loses(strategy: Strategy, lost_s: float) -> None:
    failures = [Failure(250.0, FailureKind.WORKER_CRASH)]
    assert _ratio(strategy, failures, 3600.0 + lost_s) == pytest.approx(USEFUL_S / (3600.0 + lost_s))
    # the 20th step ends exactly 40 s (its checkpoint) before that horizon, not a second earlier
    assert run_job(SMALL, strategy, GPUS, 3560.0 + lost_s, failures).steps == 20
    assert run_job(SMALL, strategy, GPUS, 3559.0 + lost_s, failures).steps == 19


@pytest.mark.parametrize(
    ("kind", "strategy", "lost_s"),
    [
        (FailureKind.NODE_LOSS, Strategy.JOB_RESTART, 450.0),
        (FailureKind.NODE_LOSS, Strategy.ROLE_RESTART, 120.0),
        (FailureKind.NODE_LOSS, Strategy.BELAYER, 3.0),
        (FailureKind.SANDBOX_LOSS, Strategy.JOB_RESTART, 97.0),  # a fresh sandbox (7 s), trajectory again
        (FailureKind.SANDBOX_LOSS, Strategy.ROLE_RESTART, 97.0),
        (FailureKind.SANDBOX_LOSS, Strategy.BELAYER, 2.0),  # restored from its checkpoint
        (FailureKind.TRAINER_FAILURE, Strategy.JOB_RESTART, 450.0),  # every strategy reloads the checkpoint
        (FailureKind.TRAINER_FAILURE, Strategy.ROLE_RESTART, 450.0),
        (FailureKind.TRAINER_FAILURE, Strategy.BELAYER, 450.0),
    ],
)
def test_one_failure_of_each_class_at_a_known_time(
    kind: FailureKind, strategy: Strategy, lost_s: float
) -> None:
    failures = [Failure(250.0, kind)]
    assert _ratio(strategy, failures, 3600.0 + lost_s) == pytest.approx(USEFUL_S / (3600.0 + lost_s))


def test_a_rollback_after_a_checkpoint_loses_only_the_steps_since_it() -> None:
    # the first checkpoint ends at 360 s; a trainer failure at 400 s (step 3's rollout) loses 40 s + 200 s
    failures = [Failure(400.0, FailureKind.TRAINER_FAILURE)]
    assert _ratio(Strategy.BELAYER, failures, 3840.0) == pytest.approx(USEFUL_S / 3840.0)


def test_a_worker_lost_during_training_only_delays_the_next_rollout_by_what_is_left() -> None:
    failures = [Failure(270.0, FailureKind.WORKER_CRASH)]  # step 2 trains from 260 s; next rollout at 360 s
    slow = SMALL.replace(worker_restart_s=100.0)  # back at 370 s: 10 s late
    assert _ratio(Strategy.ROLE_RESTART, failures, 3610.0, slow) == pytest.approx(USEFUL_S / 3610.0)
    assert _ratio(Strategy.ROLE_RESTART, failures, 3600.0) == pytest.approx(USEFUL_S / 3600.0)  # back in time


def test_overlapping_failures_in_one_rollout_cost_the_slowest_not_the_sum() -> None:
    failures = [Failure(180.0, FailureKind.WORKER_CRASH), Failure(200.0, FailureKind.WORKER_CRASH)]
    # step 2's rollout starts at 160 s: the later failure ends at 200 + 30 + 100 = 330 s (70 s late)
    assert _ratio(Strategy.ROLE_RESTART, failures, 3670.0) == pytest.approx(USEFUL_S / 3670.0)


def test_youngs_interval_is_shorter_where_more_failures_roll_back() -> None:
    inputs = SimInputs()
    job = checkpoint_every_steps(inputs, 16384, Strategy.JOB_RESTART)
    role = checkpoint_every_steps(inputs, 16384, Strategy.ROLE_RESTART)
    small = checkpoint_every_steps(inputs, 1024, Strategy.JOB_RESTART)
    assert 1 <= job < role
    assert job < small


def test_the_failure_trace_follows_the_published_rate_and_shares() -> None:
    import random

    inputs = SimInputs(sandbox_losses_per_node_day=0.0)
    failures = draw_failures(inputs, 16384, 540 * 86400.0, random.Random(1))  # ten Llama 3 snapshots
    assert len(failures) == pytest.approx(4190, rel=0.1)
    trainer = sum(f.kind is FailureKind.TRAINER_FAILURE for f in failures) / len(failures)
    crash = sum(f.kind is FailureKind.WORKER_CRASH for f in failures) / len(failures)
    assert trainer == pytest.approx(0.5, abs=0.05)
    assert crash == pytest.approx(0.5 * 63 / 419, abs=0.03)
    assert all(a.time_s <= b.time_s for a, b in itertools.pairwise(failures))


def _means(inputs: SimInputs, gpus: int) -> dict[Strategy, float]:
    results = simulate_scale(inputs, gpus=[gpus], days=8.0, repetitions=4, seed=3)
    return {r.strategy: r.mean for r in results}


def test_more_failures_give_a_lower_ratio_for_every_strategy() -> None:
    base = _means(SimInputs(), 4096)
    worse = _means(SimInputs(failures_per_gpu_day=4 * SimInputs().failures_per_gpu_day), 4096)
    for strategy in Strategy:
        assert worse[strategy] < base[strategy]


def test_belayer_beats_role_restart_beats_job_restart_when_its_recoveries_are_faster() -> None:
    for gpus in (2048, 16384):
        means = _means(SimInputs(), gpus)
        assert means[Strategy.BELAYER] >= means[Strategy.ROLE_RESTART] >= means[Strategy.JOB_RESTART]


def test_results_are_reproducible_from_the_seed_and_carry_an_interval() -> None:
    first = simulate_scale(SimInputs(), gpus=[1024], days=4.0, repetitions=3, seed=5)
    again = simulate_scale(SimInputs(), gpus=[1024], days=4.0, repetitions=3, seed=5)
    assert [r.ratios for r in first] == [r.ratios for r in again]
    assert all(0 < r.mean <= 1 and r.ci95 >= 0 for r in first)
    pair = ScaleResult(1024, Strategy.BELAYER, (0.9, 0.8), (1, 1), (0, 0), 3)
    assert pair.ci95 == pytest.approx(12.706 * 0.070710678 / 2**0.5, rel=1e-4)
    assert "| 1,024 |" in markdown_table(first)


@pytest.mark.parametrize(
    "changes",
    [
        {"rollout_s": 0.0},
        {"train_s": -1.0},
        {"rollout_fraction": 1.5},
        {"worker_crash_share": -0.1},
        {"gpus_per_node": 0},
        {"failures_per_gpu_day": float("nan")},
        {"not_an_input": 1.0},
    ],
)
def test_bad_inputs_raise_a_typed_error_naming_the_input(changes: dict[str, float]) -> None:
    with pytest.raises(ClusterConfigError, match=next(iter(changes))) as caught:
        SimInputs().replace(**changes)
    assert isinstance(caught.value, BelayerClusterError)


def test_bad_scales_and_traces_raise_typed_errors() -> None:
    with pytest.raises(ClusterConfigError, match="multiple of gpus_per_node"):
        run_job(SMALL, Strategy.BELAYER, 1001, 3600.0, [])
    with pytest.raises(ClusterConfigError, match="sorted"):
        run_job(
            SMALL,
            Strategy.BELAYER,
            64,
            3600.0,
            [Failure(9.0, FailureKind.NODE_LOSS), Failure(1.0, FailureKind.NODE_LOSS)],
        )
    with pytest.raises(ClusterConfigError, match="days"):
        simulate_scale(SMALL, gpus=[64], days=0.0)
    with pytest.raises(ClusterConfigError, match="repetitions"):
        simulate_scale(SMALL, gpus=[64], repetitions=0)


def _write_results(root: Path, node_loss: object = None) -> None:
    shadow = root / "packages/belayer-shadow/benchmarks/results"
    shadow.mkdir(parents=True)
    (shadow / "bench_handover_vllm.json").write_text(
        json.dumps(
            {
                "conventional": {"detection_s": 20.0, "all_resumed_s": 50.0},
                "shadow": [{"all_resumed_s": 0.5}, {"all_resumed_s": 0.7}, {"all_resumed_s": 2.0}],
            }
        )
    )
    envckpt = root / "packages/belayer-envckpt/benchmarks/results"
    envckpt.mkdir(parents=True)
    (envckpt / "bench_checkpoint.json").write_text(
        json.dumps([{"restore_total_ms": 900}, {"restore_total_ms": 4000}])
    )
    cluster = root / "packages/belayer-cluster/benchmarks/results"
    cluster.mkdir(parents=True)
    node_loss = {"summary": {"node_loss_recovery_s": 4.5}} if node_loss is None else node_loss
    (cluster / "bench_node_loss.json").write_text(json.dumps(node_loss))


def _update_script() -> ModuleType:
    """benchmarks/update_measured_inputs.py, the only code that reads the siblings' results files."""
    path = Path(__file__).parents[1] / "benchmarks" / "update_measured_inputs.py"
    spec = importlib.util.spec_from_file_location("update_measured_inputs", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_update_script_reads_the_siblings_results_files(tmp_path: Path) -> None:
    script = _update_script()
    _write_results(tmp_path)
    assert script.read_results(tmp_path) == {
        "detection_s": 20.0,
        "worker_restart_s": 50.0,
        "shadow_handover_s": 0.7,
        "sandbox_restore_s": 4.0,
        "sandbox_restart_s": 4.0,
        "node_loss_resume_s": 4.5,
    }
    out = tmp_path / "inputs.json"
    assert script.main(["--repo", str(tmp_path), "--out", str(out)]) == 0
    loaded = load_measured_inputs(out)
    assert loaded["shadow_handover_s"][0] == 0.7
    assert "bench_handover_vllm.json" in loaded["shadow_handover_s"][1]
    assert script.main(["--repo", str(tmp_path), "--out", str(out), "--check"]) == 0
    (tmp_path / "packages/belayer-envckpt/benchmarks/results/bench_checkpoint.json").write_text("[{}]")
    with pytest.raises(ClusterConfigError, match="restore_total_ms"):
        script.read_results(tmp_path)


def test_the_update_script_refuses_a_node_loss_file_without_its_key(tmp_path: Path) -> None:
    _write_results(tmp_path, node_loss={"another": "shape"})
    with pytest.raises(ClusterConfigError, match="node_loss_recovery_s"):
        _update_script().read_results(tmp_path)


def test_the_committed_measured_inputs_are_the_siblings_committed_results() -> None:
    # The committed file is what the update script writes from this checkout's results files: a
    # sibling that re-ran its benchmark without regenerating it fails here, naming the command.
    script = _update_script()
    if not (script.REPO / script.SHADOW_VLLM).is_file():
        pytest.skip("not a Belayer checkout (an installed package): no sibling results to compare")
    assert MEASURED_INPUTS.read_text() == script.document(script.read_results(script.REPO)), (
        "measured_inputs.json is stale: run python packages/belayer-cluster/benchmarks/update_measured_inputs.py"
    )


def test_the_defaults_are_the_committed_measured_inputs() -> None:
    measured = load_measured_inputs()
    assert {name: getattr(SimInputs(), name) for name in measured} == {n: v for n, (v, _) in measured.items()}
    assert set(measured) < set(INPUT_SOURCES)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("not json", "cannot read"),
        ("[]", "expected"),
        ('{"inputs": {"detection_s": {"value": 1, "source": "x"}}}', "missing"),
        ("BAD_VALUE", "inputs.detection_s"),
    ],
)
def test_a_bad_measured_inputs_file_is_a_typed_error(tmp_path: Path, text: str, says: str) -> None:
    if text == "BAD_VALUE":
        document = json.loads(MEASURED_INPUTS.read_text())
        document["inputs"]["detection_s"]["value"] = "fast"
        text = json.dumps(document)
    path = tmp_path / "inputs.json"
    path.write_text(text)
    with pytest.raises(ClusterConfigError, match=says):
        load_measured_inputs(path)


def test_cli_json_is_one_document_with_sourced_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_results(tmp_path)  # a checkout's results files around the command: not read any more
    monkeypatch.chdir(tmp_path)
    argv = ["scale", "--gpus", "1024", "2048", "--days", "2", "--reps", "2", "--seed", "7", "--json"]
    assert main([*argv, "--rollout-s", "200"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["seed"] == 7
    assert document["repetitions"] == 2
    assert set(document["inputs"]) == set(INPUT_SOURCES)
    assert document["inputs"]["rollout_s"] == {**document["inputs"]["rollout_s"], "value": 200.0}
    assert document["inputs"]["rollout_s"]["source"] == "command-line flag"
    committed = load_measured_inputs()["shadow_handover_s"]
    assert document["inputs"]["shadow_handover_s"]["value"] == committed[0]
    assert document["inputs"]["shadow_handover_s"]["source"] == committed[1]
    assert {(r["gpus"], r["strategy"]) for r in document["results"]} == {
        (g, s.value) for g in (1024, 2048) for s in Strategy
    }
    assert all(len(r["ratios"]) == 2 and 0 < r["ratio_mean"] <= 1 for r in document["results"])


def test_cli_inputs_file_gives_the_measured_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_results(tmp_path)
    inputs = tmp_path / "inputs.json"
    assert _update_script().main(["--repo", str(tmp_path), "--out", str(inputs)]) == 0
    capsys.readouterr()
    argv = ["scale", "--gpus", "1024", "--days", "1", "--reps", "1", "--json", "--inputs", str(inputs)]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["inputs"]["shadow_handover_s"]["value"] == 0.7
    assert document["inputs"]["node_loss_resume_s"]["value"] == 4.5
    assert document["inputs"]["node_loss_resume_s"]["source"].startswith(str(inputs))


def test_cli_repo_is_gone_with_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scale", "--days", "1", "--reps", "1", "--repo", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("belayer-cluster: error: --repo is gone")
    assert "update_measured_inputs.py" in err


def test_cli_usage_errors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["scale", "--gpus", "1001", "--days", "1", "--reps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("belayer-cluster: error: gpus must be a multiple")
    assert err.count("\n") == 1
    assert main(["scale", "--checkpoint-write-s", "-5"]) == 2
    assert "checkpoint_write_s" in capsys.readouterr().err


def test_the_simulation_modules_import_neither_ray_nor_other_third_party_code() -> None:
    allowed = set(sys.stdlib_module_names) | {"attrs", "belayer_cluster"}
    folder = Path(__file__).parents[1] / "src" / "belayer_cluster"
    files = [*folder.glob("_simulate*.py"), folder / "simulate.py", folder / "_errors.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("belayer_cluster.")
            ):
                assert node.module.split(".")[1].startswith(("_simulate", "_errors")), (
                    f"{path.name}: {node.module}"
                )


def test_the_simulate_command_starts_without_importing_ray(tmp_path: Path) -> None:
    # The installed `belayer-cluster` entry point, run in a fresh interpreter as the shell would.
    script = (
        "import json, sys\n"
        "from importlib.metadata import entry_points\n"
        "(entry,) = entry_points(group='console_scripts', name='belayer-cluster')\n"
        "code = entry.load()(['scale', '--gpus', '1024', '--days', '1', '--reps', '1', '--json'])\n"
        "print(json.dumps({'code': code, 'ray': 'ray' in sys.modules, 'torch': 'torch' in sys.modules}),"
        " file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "ray": False, "torch": False}
    assert json.loads(done.stdout)["results"]  # it did run the simulation


def test_the_former_command_name_still_works_and_says_it_is_deprecated(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--gpus", "1024", "--days", "1", "--reps", "1", "--json"]
    assert main(["simulate", *argv]) == 0
    old = capsys.readouterr()
    assert "`belayer-cluster simulate` is deprecated; use `belayer-cluster scale`" in old.err
    assert main(["--debug", "scale", *argv]) == 0
    new = capsys.readouterr()
    assert json.loads(old.out) == json.loads(new.out)
    assert "deprecated" not in new.err
