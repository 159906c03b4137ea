"""The engine boundary: what belayer-grpo needs, and no Docker error ever crossing it."""

from __future__ import annotations

import ast
import io
import tarfile
import uuid
from pathlib import Path

import pytest
from conftest import BUSYBOX, TEST_LABEL, TEST_LABELS, TEST_SESSION

import belayer_envckpt
from belayer_envckpt import (
    BelayerEnvckptError,
    ContainerEngineError,
    ContainerNotFoundError,
    Engine,
    ImageNotFoundError,
)

SRC = Path(belayer_envckpt.__file__).parent
# The only modules that may touch the Docker SDK; every other one sees belayer-envckpt errors only.
DOCKER_MODULES = {"_boundary.py", "_docker.py", "_exec.py", "_sandbox.py"}


def test_only_the_engine_layer_imports_docker():
    importers = set()
    for module in SRC.glob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "docker" or n.startswith("docker.") for n in names):
                importers.add(module.name)
    assert importers <= DOCKER_MODULES


def test_an_unreachable_engine_is_a_typed_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")
    with pytest.raises(ContainerEngineError, match="setup-system"):
        Engine.connect()


def test_probe_runs_without_counting_an_action(make_sandbox):
    sandbox = make_sandbox(trajectory="probe")
    sandbox.exec("mkdir -p /work/repo && echo x > /work/repo/f")
    result = sandbox.probe(["sh", "-c", "pwd; cat f"], workdir="/work/repo")
    assert (result.stdout, result.exit_code, result.ok) == ("/work/repo\nx\n", 0, True)
    assert sandbox.prefix == 1
    assert not sandbox.probe("exit 4").ok
    assert sandbox.is_running()


def test_a_removed_sandbox_raises_typed_errors(make_sandbox):
    sandbox = make_sandbox(trajectory="gone")
    sandbox.remove()
    assert sandbox.status() == "removed"
    assert not sandbox.is_running()
    with pytest.raises(ContainerNotFoundError):
        sandbox.exec("true")
    with pytest.raises(ContainerNotFoundError):
        sandbox.kill()
    sandbox.remove()  # idempotent


def test_killing_a_stopped_sandbox_is_an_engine_error(make_sandbox):
    sandbox = make_sandbox(trajectory="stopped")
    sandbox.kill()
    assert sandbox.status() == "exited"
    with pytest.raises(ContainerEngineError, match="killing a sandbox"):
        sandbox.kill()


def test_images_list_and_throwaway_runs(engine):
    assert engine.has_image(BUSYBOX)
    assert engine.image_id(BUSYBOX).startswith("sha256:")
    assert not engine.has_image("belayer/not-built-here:1")
    with pytest.raises(ImageNotFoundError):
        engine.image_id("belayer/not-built-here:1")
    mark = uuid.uuid4().hex[:8]
    result = engine.run(
        BUSYBOX, ["sh", "-c", "echo hi; echo oops >&2; exit 5"], labels={**TEST_LABELS, "belayer.mark": mark}
    )
    assert (result.stdout, result.stderr, result.exit_code, result.timed_out) == ("hi\n", "oops\n", 5, False)
    assert engine.list_containers([f"belayer.mark={mark}"]) == []  # the throwaway container is gone
    with pytest.raises(ImageNotFoundError):
        engine.run("belayer/not-built-here:1", ["true"])


def test_a_throwaway_run_past_its_timeout_is_killed(engine):
    result = engine.run(BUSYBOX, ["sleep", "600"], timeout_s=1.0, labels=TEST_LABELS)
    assert result.timed_out
    assert result.exit_code == -1


def test_commit_archive_builds_an_image_with_the_files(engine, make_sandbox):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        data = b"from the archive\n"
        info = tarfile.TarInfo("opt/task/README")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    tag = uuid.uuid4().hex[:12]
    name = engine.commit_archive(
        BUSYBOX, buffer.getvalue(), repository="belayer/envckpt-test", tag=tag, labels=TEST_LABELS
    )
    try:
        assert name == f"belayer/envckpt-test:{tag}"
        sandbox = make_sandbox(image=name, trajectory="committed")
        assert sandbox.exec("cat /opt/task/README").stdout == "from the archive\n"
        listed = engine.list_containers([f"{TEST_LABEL}={TEST_SESSION}", "belayer.trajectory=committed"])
        assert [c.id for c in listed] == [sandbox.id]
        assert listed[0].status == "running"
    finally:
        for sandbox_info in engine.list_containers(
            [f"{TEST_LABEL}={TEST_SESSION}", "belayer.trajectory=committed"]
        ):
            engine.remove(sandbox_info.id)
        engine._client.images.remove(name, force=True)
    with pytest.raises(BelayerEnvckptError):
        engine.commit_archive("belayer/not-built-here:1", b"", repository="belayer/x", tag="y")
