"""Configuration: layering, overrides, and errors that name the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from belayer_grpo import ExitCode, GrpoConfigError
from belayer_grpo._config import load_config, parse_override


def test_embedded_default_loads() -> None:
    config = load_config()
    assert config.rollout.samples_per_prompt >= 2
    assert config.chaos.kill_worker_at_steps  # the main job injects one worker failure
    assert config.data.workload == "tooluse"  # the main job is agentic (issue 17)
    assert config.rollout.env_checkpoint_policy == "adaptive"
    assert 0 < config.chaos.sandbox_kill_p < 0.2
    assert config.system.sandbox_recovery == "checkpoint"
    assert config.system.engine == "belayer"


def test_each_workload_layers_its_own_defaults_under_the_file_and_overrides(tmp_path: Path) -> None:
    math = load_config(None, ["data.workload=math"])
    assert (math.rollout.batch_size, math.rollout.max_tokens, math.algorithm.steps) == (16, 4, 80)
    assert math.chaos.sandbox_kill_p == 0.0
    swe = load_config(None, ["data.workload=swe"])
    assert (swe.rollout.batch_size, swe.algorithm.steps) == (3, 5)
    toml = tmp_path / "math.toml"
    toml.write_text('[data]\nworkload = "math"\n[algorithm]\nsteps = 7\n')
    assert load_config(toml, ["rollout.batch_size=8"]).algorithm.steps == 7
    assert load_config(toml, ["rollout.batch_size=8"]).rollout.batch_size == 8


def test_engine_and_sandbox_recovery_are_validated() -> None:
    assert load_config(None, ["system.sandbox_recovery=image"]).system.sandbox_recovery == "image"
    with pytest.raises(GrpoConfigError, match=r"system\.engine"):
        load_config(None, ["system.engine=tensorrt"])
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(GrpoConfigError, match="belayer-shadow\\[vllm\\]"):
            load_config(None, ["system.engine=vllm"])
    else:
        assert load_config(None, ["system.engine=vllm"]).system.engine == "vllm"


def test_file_then_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[algorithm]\nsteps = 7\nbeta = 0.05\n[chaos]\nkill_worker_at_s = [1, 2.5]\n")
    config = load_config(toml, ["algorithm.steps=9", "system.run_dir=out"])
    assert config.algorithm.steps == 9
    assert config.algorithm.beta == 0.05
    assert config.chaos.kill_worker_at_s == (1.0, 2.5)
    assert config.system.run_dir == "out"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("rollout:\n  batch_size: 4\n  samples_per_prompt: 4\n")
    assert load_config(yaml_file).rollout.batch_size == 4


def test_override_values_are_toml_literals_or_strings() -> None:
    assert parse_override("data.operations=['+', '*']") == ("data.operations", ["+", "*"])
    assert parse_override("system.recovery=conventional") == ("system.recovery", "conventional")
    assert parse_override("logging.progress=false") == ("logging.progress", False)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.epsilon=2"], "algorithm.epsilon"),
        (["algorithm.epsilonn=0.1"], "algorithm.epsilonn"),
        (["bogus.x=1"], "bogus.x"),
        (["model.hidden_size=abc"], "model.hidden_size"),
        (["model.hidden_size=1.5"], "model.hidden_size"),
        (["logging.progress=1"], "logging.progress"),
        (["data.min_operand=5", "data.max_operand=3"], "data.max_operand"),
        (["algorithm.loss_aggregation=mean"], "algorithm.loss_aggregation"),
        (["data.operations=['/']"], "data.operations"),
        (["algorithm.epsilon_high=0.1"], "algorithm.epsilon_high"),
        (["algorithm.num_minibatches=3"], "algorithm.num_minibatches"),
        (["chaos.sandbox_kill_p=1.5"], "chaos.sandbox_kill_p"),
        (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt"),
        (["steps=3"], "steps"),
        (["rollout.env_checkpoint_policy=sometimes"], "rollout.env_checkpoint_policy"),
        (["rollout.invalid_action=retry"], "rollout.invalid_action"),
        (["rollout.spare_sandboxes=-1"], "rollout.spare_sandboxes"),
        (["data.workload=swe", "data.source=arithmetic"], "data.source"),
        (["data.workload=chess"], "data.workload"),
        (["system.engine=tensorrt"], "system.engine"),
        (["system.sandbox_recovery=none"], "system.sandbox_recovery"),
        (["chaos.sandbox_kill_at_actions=[0]"], "chaos.sandbox_kill_at_actions"),
        (["data.source=tasks.jsonl"], "data.source"),
    ],
)
def test_errors_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(GrpoConfigError) as caught:
        load_config(None, overrides)
    assert caught.value.key == key
    assert repr(key) in str(caught.value)


def test_a_negative_spare_count_says_what_the_key_means() -> None:
    assert load_config(None, []).rollout.spare_sandboxes == 1
    assert load_config(None, ["rollout.spare_sandboxes=0"]).rollout.spare_sandboxes == 0
    with pytest.raises(GrpoConfigError, match=r"must be >= 0, got -2: .*\(0: none"):
        load_config(None, ["rollout.spare_sandboxes=-2"])


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(GrpoConfigError, match="no such file"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[algorithm\n")
    with pytest.raises(GrpoConfigError, match="not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[rollouts]\nbatch_size = 2\n")
    with pytest.raises(GrpoConfigError) as caught:
        load_config(unknown)
    assert caught.value.key == "rollouts"
    other = tmp_path / "run.ini"
    other.write_text("x")
    with pytest.raises(GrpoConfigError, match=r"\.toml, \.yaml or \.yml"):
        load_config(other)


def test_cli_reports_config_errors_with_exit_status_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "belayer_grpo", "train", "algorithm.steps=0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == ExitCode.USAGE
    assert int(ExitCode.USAGE) == 2
    # The root README's contract: one line, `belayer-grpo: error: ...`, no traceback.
    assert done.stderr.startswith("belayer-grpo: error: config key 'algorithm.steps'"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""
    debug = subprocess.run(
        [sys.executable, "-m", "belayer_grpo", "--debug", "train", "algorithm.steps=0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert debug.returncode == 2
    assert "Traceback" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1].startswith("belayer-grpo: error: ")
    as_json = subprocess.run(
        [sys.executable, "-m", "belayer_grpo", "config", "--json", "rollout.batch_size=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert as_json.returncode == ExitCode.OK
    assert json.loads(as_json.stdout)["rollout"]["batch_size"] == 3
    shown = subprocess.run(
        [sys.executable, "-m", "belayer_grpo", "config", "rollout.batch_size=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0
    assert '"batch_size": 3' in shown.stdout


def test_swe_workload_settings_reach_the_agent_loop(tmp_path: Path) -> None:
    from belayer_grpo._data import BytePolicyTokenizer
    from belayer_grpo._model import build_tokenizer
    from belayer_grpo._rollout_agentic import agentic_config, load_tasks

    config = load_config(
        None,
        ["data.workload=swe", "rollout.max_rounds=5", "rollout.env_checkpoint_policy=every:2",
         "chaos.sandbox_kill_p=0.2", "rollout.max_tokens=32"],
    )  # fmt: skip
    tokenizer = build_tokenizer(config.model, config.data.workload)
    assert isinstance(tokenizer, BytePolicyTokenizer)
    text = "fix calc.py: add(2, 3) == 5 \u00e9"
    assert tokenizer.decode([*tokenizer.encode(text), tokenizer.eos_token_id]) == text
    assert max(tokenizer.encode(text)) < tokenizer.eos_token_id < tokenizer.vocab_size
    agentic = agentic_config(config, tmp_path, tokenizer, step=3)
    assert (agentic.max_rounds, agentic.max_response_tokens, agentic.checkpoint_policy) == (5, 32, "every:2")
    assert agentic.sandbox_kill_probability == 0.2
    assert agentic.stop_token_ids == (256,)
    assert agentic.checkpoint_root == tmp_path / "env-checkpoints"
    assert [t.instance_id for t in load_tasks(config)][:1] == ["belayer__calc-1"]
    with pytest.raises(GrpoConfigError) as caught:
        load_tasks(load_config(None, ["data.workload=swe", "data.source=tasks.parquet"]))
    assert caught.value.key == "data.source"


def test_each_recovery_mode_is_matched_to_its_slot_event() -> None:
    from belayer_grpo._chaos import FailureRecord, match_recoveries

    assert load_config(None, ["system.recovery=restart"]).system.recovery == "restart"
    failures = [FailureRecord("slot0", 1, 10.0, "step"), FailureRecord("slot1", 2, 20.0, "step"),
                FailureRecord("slot0", 3, 30.0, "step")]  # fmt: skip
    events = [
        {"slot": "slot0", "event": "restart.restart", "time": 9.0},  # before the kill: not this one
        {"slot": "slot0", "event": "restart.restart", "time": 11.5},
        {"slot": "slot1", "event": "conventional.restart", "time": 50.0},
        {"slot": "slot0", "event": "handover.complete", "time": 30.25},
    ]
    match_recoveries(failures, events)
    assert [(f.recovery, f.recovery_s) for f in failures] == [
        ("restart", 1.5),
        ("conventional", 30.0),
        ("shadow", 0.25),
    ]
