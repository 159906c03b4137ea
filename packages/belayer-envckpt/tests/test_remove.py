"""Removing a container that another removal is already taking away (the engine's 409)."""

from __future__ import annotations

import threading
from typing import Any

import docker
import pytest

from belayer_envckpt import ContainerEngineError, Engine


class _FakeResponse:
    def __init__(self, status_code: int) -> None:
        self.status_code = status_code
        self.reason = "Conflict"
        self.url = "http+docker://localhost/containers/c1"


class FakeContainers:
    """Stands in for the Docker engine's container API: it answers `remove` with 409s of the given
    explanation `busy` times, and the container is gone after that."""

    def __init__(self, explanation: str, busy: int) -> None:
        self.explanation = explanation
        self.busy = busy
        self.removes = 0

    def get(self, ref: str) -> Any:
        if self.removes > self.busy:
            raise docker.errors.NotFound(f"No such container: {ref}")
        return self

    def remove(self, force: bool) -> None:
        assert force
        self.removes += 1
        if self.removes <= self.busy:
            raise docker.errors.APIError("409", response=_FakeResponse(409), explanation=self.explanation)  # type: ignore[no-untyped-call]


class FakeDockerClient:
    def __init__(self, containers: FakeContainers) -> None:
        self.containers = containers


IN_PROGRESS = "removal of container c1 is already in progress"


def test_a_removal_already_in_progress_is_waited_for() -> None:
    containers = FakeContainers(IN_PROGRESS, busy=2)
    assert Engine(FakeDockerClient(containers)).remove("c1", timeout_s=30) is True  # type: ignore[arg-type]
    assert containers.removes == 3  # asked again until the engine said it is gone


def test_another_conflict_is_an_engine_error_at_once() -> None:
    containers = FakeContainers("container c1 is paused, unpause it first", busy=5)
    with pytest.raises(ContainerEngineError, match="paused"):
        Engine(FakeDockerClient(containers)).remove("c1", timeout_s=30)  # type: ignore[arg-type]
    assert containers.removes == 1


def test_a_removal_that_never_ends_is_an_engine_error_after_the_timeout() -> None:
    containers = FakeContainers(IN_PROGRESS, busy=10**6)
    with pytest.raises(ContainerEngineError, match="already in progress"):
        Engine(FakeDockerClient(containers)).remove("c1", timeout_s=0.3)  # type: ignore[arg-type]
    assert containers.removes >= 2


def test_two_removals_of_one_real_container_at_once(engine: Engine, make_sandbox: Any) -> None:
    sandbox = make_sandbox()
    results: list[bool] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def remove() -> None:
        start.wait()
        try:
            results.append(engine.remove(sandbox.id))
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=remove) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert True in results
    with pytest.raises(docker.errors.NotFound):
        engine._client.containers.get(sandbox.id)
