"""`SlotWeights` on real weight servers when a commit fails after another succeeded: the error is
`PartialWeightCommitError` naming the slots that committed (not "the previous ones stay"), and
only those slots keep the new folder for a restart from scratch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import attrs
import pytest
import torch
from serve_helpers import write_model_folder

from belayer_gpumem import ServerConfig, ServerProcess, WeightClient, WeightUpdate
from belayer_router import PartialWeightCommitError, WeightLoadError
from belayer_shadow import load_safetensors
from belayer_shadow._serve._weights import SlotWeights

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("partial")
    return {
        "first": write_model_folder(root / "first", seed=0),
        "second": write_model_folder(root / "second", seed=1),
    }


@pytest.fixture
def servers(tmp_path: Path, folders: dict[str, Path]) -> Iterator[list[ServerProcess]]:
    started: list[ServerProcess] = []
    try:
        for index in range(2):
            config = ServerConfig(
                kind="weights",
                socket=tmp_path / f"s{index}" / "weights.sock",
                safetensors=folders["first"] / "model.safetensors",
            )
            started.append(ServerProcess.start(config))
        yield started
    finally:
        for server in started:
            server.kill()


@attrs.define
class _KillBeforeCommit:
    """The real update of the second server; its server is SIGKILLed just before the commit."""

    update: WeightUpdate
    server: ServerProcess

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.update.tensors())

    def commit(self) -> None:
        self.server.kill()
        self.update.commit()


@attrs.define
class _Dying(SlotWeights):
    servers: list[ServerProcess] = attrs.Factory(list)

    def _open(  # type: ignore[override]
        self,
        socket: Path,
        stack: ExitStack,
        tensors: dict[str, torch.Tensor],
        source: str,
        timeout_s: float = 30.0,
    ) -> WeightUpdate | _KillBeforeCommit:
        update = SlotWeights._open(socket, stack, tensors, source, timeout_s)
        if socket == self.sockets[1]:
            return _KillBeforeCommit(update, self.servers[1])
        return update


def _live(socket: Path) -> dict[str, torch.Tensor]:
    client = WeightClient.attach(socket)
    try:
        return {name: view.clone() for name, view in client.tensors().items()}
    finally:
        client.detach()


def test_a_commit_failing_after_another_names_the_committed_slots(
    servers: list[ServerProcess], folders: dict[str, Path]
) -> None:
    sockets = [server.config.socket for server in servers]
    kept: list[tuple[int, Path]] = []
    weights = _Dying(
        sockets=sockets,
        keepers=[lambda p: kept.append((0, p)), lambda p: kept.append((1, p))],
        names=["slot0", "slot1"],
        servers=servers,
    )
    with pytest.raises(PartialWeightCommitError) as caught:
        weights.load_weights(str(folders["second"]))
    assert not isinstance(caught.value, WeightLoadError)
    assert caught.value.committed == ("slot0",)
    assert "previous ones stay" not in str(caught.value)
    assert kept == [(0, folders["second"])]  # only the committed slot reloads it from scratch
    expected = load_safetensors(folders["second"])
    live = _live(sockets[0])
    assert all(torch.equal(live[name], expected[name]) for name in live)  # slot0 serves new weights


def test_a_failure_before_any_commit_is_a_weight_load_error(
    servers: list[ServerProcess], folders: dict[str, Path]
) -> None:
    sockets = [server.config.socket for server in servers]
    servers[1].kill()  # the second server is gone before the update opens
    weights = SlotWeights(sockets=sockets, names=["slot0", "slot1"])
    with pytest.raises(WeightLoadError, match="previous ones stay"):
        weights.load_weights(str(folders["second"]))
    live = _live(sockets[0])
    first = load_safetensors(folders["first"])
    assert all(torch.equal(live[name], first[name]) for name in live)
