"""What `full_checkpoint` and `full_restore` say when the outcome is not the plain one: a sandbox
that will not thaw, a publication not known durable, no checkpoint to restore (real Docker and
CRIU; fakes only for the Docker SDK's unpause and the operating system's fsync)."""

from __future__ import annotations

import docker
import pytest
from conftest import fail_fsync_of

from belayer_envckpt import (
    CheckpointDurabilityError,
    CheckpointNotFoundError,
    CheckpointStore,
    SandboxStillPausedError,
    full_checkpoint,
    full_restore,
)


class FakeBusyUnpause:
    """The Docker SDK's `Container.unpause` answering 500 for its first ``failures`` calls."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.real = docker.models.containers.Container.unpause

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(docker.models.containers.Container, "unpause", lambda container: self(container))

    def __call__(self, container: docker.models.containers.Container) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise docker.errors.APIError("500 Server Error: engine busy")
        self.real(container)


def test_a_sandbox_that_stays_paused_is_reported_after_the_publication(make_sandbox, tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    sandbox = make_sandbox(trajectory="frozen")
    busy = FakeBusyUnpause(failures=2)
    busy.install(monkeypatch)
    with pytest.raises(SandboxStillPausedError, match=r"published and is ready.*still paused") as caught:
        full_checkpoint(sandbox, "frozen", store=store)
    assert busy.calls == 2  # tried once more before giving up
    assert sandbox.status() == "paused"
    latest = store.latest_ready("frozen")
    assert latest is not None
    assert store.verify(latest) == caught.value.checkpoint
    monkeypatch.undo()
    sandbox.unpause()
    assert sandbox.exec("echo thawed").stdout == "thawed\n"


def test_one_failed_unpause_is_retried(make_sandbox, tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path)
    sandbox = make_sandbox(trajectory="retried")
    FakeBusyUnpause(failures=1).install(monkeypatch)
    checkpoint = full_checkpoint(sandbox, "retried", store=store)
    assert sandbox.status() == "running"
    assert store.latest_ready("retried") == checkpoint


def test_a_failed_fsync_after_the_rename_is_not_reported_as_nothing_published(
    make_sandbox, tmp_path, monkeypatch
):
    store = CheckpointStore(tmp_path)
    sandbox = make_sandbox(trajectory="durable")
    first = full_checkpoint(sandbox, "durable", store=store)
    fail_fsync_of(monkeypatch, tmp_path / "durable")
    with pytest.raises(CheckpointDurabilityError, match="IS published") as caught:
        full_checkpoint(sandbox, "durable", store=store)
    monkeypatch.undo()
    assert store.latest_ready("durable") == caught.value.checkpoint
    assert store.latest_ready("durable") != first
    assert sandbox.status() == "running"
    assert store.leftovers() == []


def test_full_restore_of_no_checkpoint_says_what_to_do(tmp_path):
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match=r"no ready checkpoint.*base image"):
        full_restore(store.latest_ready("never-checkpointed"))
