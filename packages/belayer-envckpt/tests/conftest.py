"""Fixtures over the real Docker engine and CRIU (installed by scripts/setup-system)."""

from __future__ import annotations

import os
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from belayer_envckpt import BelayerEnvckptError, Engine, Sandbox, SandboxConfig

BUSYBOX = "belayer/busybox:latest"
DEBIAN = "belayer/debian-python:latest"
TEST_LABEL = "belayer.test"
# One value per test session: the leak check sees only this session's containers, not those of
# another session running beside it on the same engine.
TEST_SESSION = uuid.uuid4().hex[:12]
TEST_LABELS = {TEST_LABEL: TEST_SESSION}


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    try:
        eng = Engine.connect()
        eng.require_checkpoint_support()
    except BelayerEnvckptError as exc:
        pytest.fail(f"the envckpt tests need Docker (experimental) and CRIU: {exc}", pytrace=False)
    before = {c.id for c in eng._client.containers.list(all=True)}
    yield eng
    # No leaks: every container the suite created is gone.
    leaked = [
        c.name
        for c in eng._client.containers.list(all=True, filters={"label": f"{TEST_LABEL}={TEST_SESSION}"})
        if c.id not in before
    ]
    eng.close()
    assert not leaked, f"test containers leaked: {leaked}"


@pytest.fixture
def make_sandbox(engine: Engine) -> Iterator[Callable[..., Sandbox]]:
    """Create sandboxes that are removed after the test, whatever happens."""
    created: list[Sandbox] = []

    def make(image: str = BUSYBOX, trajectory: str = "t", **config: Any) -> Sandbox:
        labels = dict(TEST_LABELS)
        sandbox = Sandbox.create(
            engine, SandboxConfig(image=image, labels=labels, **config), trajectory=trajectory
        )
        created.append(sandbox)
        return sandbox

    yield make
    for sandbox in created:
        sandbox.remove()


@pytest.fixture
def track(engine: Engine) -> Iterator[Callable[[Sandbox], Sandbox]]:
    """Register restored sandboxes for removal."""
    tracked: list[Sandbox] = []

    def add(sandbox: Sandbox) -> Sandbox:
        tracked.append(sandbox)
        return sandbox

    yield add
    for sandbox in tracked:
        sandbox.remove()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def wait_for_layer_file(sandbox: Sandbox, member: str, timeout_s: float = 60.0) -> None:
    """Poll the container's writable layer until an action running in it has written ``member``.

    An action holds the sandbox, so a probe inside it would wait; the host sees the layer directly.
    """
    path = sandbox.engine.upper_dir(sandbox._container) / member
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{member} never appeared in the sandbox's layer"
        time.sleep(0.02)


def read_from_layer(layer: Path, member: str) -> bytes:
    """A file's bytes as the checkpoint captured them."""
    with tarfile.open(layer) as tar:
        extracted = tar.extractfile(f"./{member}")
        assert extracted is not None
        return extracted.read()


def fail_fsync_of(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Make ``os.fsync`` of ``directory`` fail with EIO (a failing disk stands in: no real disk
    fails on demand); every other fsync stays real.  ``monkeypatch.undo()`` ends it."""
    real_fsync = os.fsync
    target = str(directory)

    def fake_failing_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == target:
            raise OSError(5, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fake_failing_fsync)
