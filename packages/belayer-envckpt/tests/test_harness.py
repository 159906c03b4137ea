"""`SandboxEnvironment`: mini-swe-agent's environment protocol over a checkpointed sandbox.

Real Docker and CRIU: actions run in a busybox sandbox, checkpoints are taken where ``decide``
says, and a sandbox killed between actions or under one is restored and brought back to the
agent's context (the latest checkpoint plus the actions since), so the agent sees the same outputs
as in a failure-free run.
"""

from __future__ import annotations

import threading

from conftest import wait_for_layer_file

from belayer_envckpt import CheckpointStore
from belayer_envckpt.harness import ActionStep, SandboxEnvironment

ACTIONS = [
    "echo one >> /work/notes.txt",
    "echo two >> /work/notes.txt; echo made",
    "echo three >> /work/notes.txt; ls /nonexistent",
    "cat /work/notes.txt",
]


def run_all(env: SandboxEnvironment, kill_before: int | None = None) -> list[dict[str, object]]:
    outputs = []
    for index, command in enumerate(ACTIONS):
        if index == kill_before:
            env.sandbox.kill()
        outputs.append(env.execute({"command": command}))
    return outputs


def test_outputs_match_a_failure_free_run_after_a_kill_between_actions(make_sandbox, tmp_path):
    clean = SandboxEnvironment(make_sandbox(trajectory="clean"), CheckpointStore(tmp_path / "a"), "clean")
    expected = run_all(clean)
    clean.cleanup()
    # A checkpoint after every action: the layer changed after 1-3, the reading action 4 changed nothing.
    assert clean.state.checkpoint_kinds == ["fresh-runtime", "fresh-runtime", "fresh-runtime", "reference"]
    assert expected[3]["output"] == "one\ntwo\nthree\n"
    assert expected[2]["returncode"] != 0
    assert "nonexistent" in str(expected[2]["output"])  # stderr is part of the output

    steps: list[ActionStep] = []

    def every_second(step: ActionStep) -> bool:
        steps.append(step)
        return step.step_index % 2 == 0

    env = SandboxEnvironment(
        make_sandbox(trajectory="killed"), CheckpointStore(tmp_path / "b"), "killed", decide=every_second
    )
    try:
        outputs = run_all(env, kill_before=3)  # checkpoint after action 2, action 3 since
    finally:
        env.cleanup()
    assert outputs == expected
    assert env.state.num_checkpoints == 2  # after actions 2 and 4
    assert env.state.num_restores == 1
    assert env.state.num_replayed == 1  # action 3 re-run on the restored sandbox
    assert env.state.replay_mismatches == []
    assert [s.step_index for s in steps] == [1, 2, 3, 4]
    assert steps[2].actions_since_checkpoint == 1
    assert set(steps[0].observation()) == {"step_index", "response_s", "action_s", "now", "checkpoint_kind"}
    assert [s.checkpoint_kind for s in steps] == ["fresh-runtime"] * 4
    assert env.state.checkpoint_kinds == ["fresh-runtime", "fresh-runtime"]


def test_kinds_off_takes_full_checkpoints_and_reports_no_kind(make_sandbox, tmp_path):
    steps: list[ActionStep] = []

    def record(step: ActionStep) -> bool:
        steps.append(step)
        return True

    env = SandboxEnvironment(
        make_sandbox(trajectory="full"), CheckpointStore(tmp_path), "full", decide=record, kinds=False
    )
    try:
        env.execute({"command": "echo one > /work/f"})
        env.execute({"command": "cat /work/f"})
        env.sandbox.kill()
        assert env.execute({"command": "cat /work/f"})["output"] == "one\n"
    finally:
        env.cleanup()
    assert env.state.checkpoint_kinds == ["full", "full", "full"]
    assert set(steps[0].observation()) == {"step_index", "response_s", "action_s", "now"}


def test_a_sandbox_killed_under_an_action_reruns_it_after_the_restore(make_sandbox, tmp_path):
    env = SandboxEnvironment(make_sandbox(trajectory="under"), CheckpointStore(tmp_path), "under")
    try:
        env.execute({"command": "echo before > /work/f"})
        sandbox = env.sandbox

        def kill_under_the_action() -> None:
            wait_for_layer_file(sandbox, "work/started")  # the action runs: kill under it
            sandbox.kill()

        killer = threading.Thread(target=kill_under_the_action)
        killer.start()
        output = env.execute({"command": "touch /work/started; sleep 4; echo after >> /work/f; cat /work/f"})
        killer.join()
        assert output == {"output": "before\nafter\n", "returncode": 0, "exception_info": ""}
        assert env.state.num_restores == 1
        assert env.execute({"command": "cat /work/f"})["output"] == "before\nafter\n"
    finally:
        env.cleanup()


def test_template_vars_and_serialize_are_json_ready(make_sandbox, tmp_path):
    env = SandboxEnvironment(make_sandbox(trajectory="vars"), CheckpointStore(tmp_path), "vars", cwd="/work")
    try:
        assert env.get_template_vars(task="x")["cwd"] == "/work"
        assert env.get_template_vars(task="x")["task"] == "x"
        info = env.serialize()["info"]
        assert info["config"]["environment"]["image"].startswith("belayer/busybox")
        assert info["belayer_envckpt"]["num_actions"] == 0
    finally:
        env.cleanup()


def test_a_restored_sandbox_that_dies_before_a_new_checkpoint_is_removed(make_sandbox, tmp_path):
    env = SandboxEnvironment(
        make_sandbox(trajectory="twice"),
        CheckpointStore(tmp_path),
        "twice",
        decide=lambda step: step.step_index == 1,  # one checkpoint, after the first action only
    )
    restored = []
    try:
        env.execute({"command": "echo one > /work/f"})
        env.sandbox.kill()
        env.execute({"command": "echo two >> /work/f"})  # restored from the checkpoint
        restored.append(env.sandbox)
        env.sandbox.kill()  # dies too, before any new checkpoint
        output = env.execute({"command": "cat /work/f"})
        assert output["output"] == "one\ntwo\n"
        assert env.state.num_restores == 2
        assert restored[0].status() == "removed"  # not left behind, dead, for the engine to keep
    finally:
        env.cleanup()
        for sandbox in restored:
            sandbox.remove()
