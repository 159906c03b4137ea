"""`SlotWeights` on real weight servers. A commit failing after another succeeded: the error is
`PartialWeightCommitError` naming the slots that committed (not "the previous ones stay"), and
only those slots keep the new folder for a restart from scratch. A slot that is out is skipped
(it keeps the folder for its restart), one back meanwhile is written last, a bad folder is kept
for none, and with every slot out nothing is loaded."""

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


# Slots that are out (unhealthy, or their memory restarting from scratch) are skipped, not waited for.


def _record(kept: list[Path], folder: Path) -> bool:
    """`keep_if_out` of a slot that stays out: it keeps the folder (here: records it)."""
    kept.append(folder)
    return True


def _same_as(socket: Path, folder: Path) -> bool:
    live, expected = _live(socket), load_safetensors(folder)
    return all(torch.equal(live[name], expected[name]) for name in live)


def test_a_slot_that_is_out_is_skipped_and_keeps_the_folder_for_its_restart(
    servers: list[ServerProcess], folders: dict[str, Path]
) -> None:
    sockets = [server.config.socket for server in servers]
    servers[1].kill()  # out: a dead weight server (attaching would wait attach_timeout_s, then fail)
    kept_out: list[Path] = []
    weights = SlotWeights(
        sockets=sockets,
        names=["slot0", "slot1"],
        accepts=[lambda: True, lambda: False],
        keep_if_out=[lambda p: False, lambda p: _record(kept_out, p)],
        attach_timeout_s=60.0,  # were slot1 attached, the update would fail, not skip it
    )
    assert weights.load_weights(str(folders["second"])) > 0
    assert weights.skipped == ["slot1"]
    assert kept_out == [folders["second"]]  # what its restart loads: the current version
    assert _same_as(sockets[0], folders["second"])


def test_a_slot_back_during_the_update_is_written_last(
    servers: list[ServerProcess], folders: dict[str, Path]
) -> None:
    sockets = [server.config.socket for server in servers]
    weights = SlotWeights(
        sockets=sockets,
        names=["slot0", "slot1"],
        accepts=[lambda: True, lambda: False],  # out when the update began...
        keep_if_out=[lambda p: False, lambda p: False],  # ...back by the time the others committed
    )
    weights.load_weights(str(folders["second"]))
    assert weights.skipped == []
    assert _same_as(sockets[0], folders["second"])
    assert _same_as(sockets[1], folders["second"])


def test_a_bad_folder_is_not_kept_for_a_slot_that_is_out(
    servers: list[ServerProcess], folders: dict[str, Path], tmp_path: Path
) -> None:
    sockets = [server.config.socket for server in servers]
    kept_out: list[Path] = []
    weights = SlotWeights(
        sockets=sockets,
        names=["slot0", "slot1"],
        accepts=[lambda: True, lambda: False],
        keep_if_out=[lambda p: False, lambda p: _record(kept_out, p)],
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightLoadError, match="previous ones stay"):
        weights.load_weights(str(tmp_path / "empty"))
    assert kept_out == []  # checked against slot0's table first: nothing kept for slot1
    everyone_out = SlotWeights(sockets=sockets, accepts=[lambda: False, lambda: False])
    with pytest.raises(WeightLoadError, match="every slot is out"):
        everyone_out.load_weights(str(folders["second"]))
    assert _same_as(sockets[1], folders["first"])


def test_a_slot_killed_just_before_the_update_is_skipped_once_its_supervisor_sees_it(
    servers: list[ServerProcess], folders: dict[str, Path]
) -> None:
    """The race a served update met: slot1's weight server is SIGKILLed and the update opens at
    once, while the supervisor still says the slot takes weights. Its connection is refused; the
    update waits (briefly) for the supervisor to see it out, then skips it and keeps the folder for
    its restart, instead of failing the whole update with a 400."""
    sockets = [server.config.socket for server in servers]
    servers[1].kill()
    kept_out: list[Path] = []
    asked = {"n": 0}

    def slot1_accepts() -> bool:  # the supervisor notices the dead process on its third look
        asked["n"] += 1
        return asked["n"] <= 2

    weights = SlotWeights(
        sockets=sockets,
        names=["slot0", "slot1"],
        accepts=[lambda: True, slot1_accepts],
        keep_if_out=[lambda p: False, lambda p: _record(kept_out, p)],
    )
    assert weights.load_weights(str(folders["second"])) > 0
    assert weights.skipped == ["slot1"]
    assert kept_out == [folders["second"]]
    assert _same_as(sockets[0], folders["second"])
    # A slot whose supervisor goes on saying it takes weights is a real failure: nothing changes.
    stubborn = SlotWeights(sockets=sockets, names=["slot0", "slot1"], accepts=[lambda: True, lambda: True])
    with pytest.raises(WeightLoadError, match="previous ones stay"):
        stubborn.load_weights(str(folders["first"]))
    assert _same_as(sockets[0], folders["second"])
