"""Bad input gets a typed error that says what to do, and no saved checkpoint is touched."""

from __future__ import annotations

import os
import stat

import attrs
import pytest
from conftest import BUSYBOX, TEST_LABELS

from belayer_envckpt import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointStore,
    ContainerNotFoundError,
    CriuUnavailableError,
    ExperimentalDisabledError,
    InvalidIdError,
    OutsideGuaranteeError,
    Sandbox,
    SandboxConfig,
    check_criu,
    full_checkpoint,
    full_restore,
)
from belayer_envckpt._docker import Engine


def test_unknown_container(engine):
    with pytest.raises(ContainerNotFoundError, match="docker ps -a"):
        Sandbox.attach(engine, "no-such-container-belayer")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"network_mode": "bridge"},
        {"network_mode": "none", "volumes": {"/tmp": {"bind": "/host", "mode": "rw"}}},
        {"network_mode": "none", "volumes": ["/data"]},
        {"network_mode": "none", "tmpfs": {"/scratch": ""}},
    ],
    ids=["network", "bind-mount", "volume", "tmpfs"],
)
def test_container_outside_the_guarantee_is_refused(kwargs, engine, tmp_path):
    container = engine._client.containers.create(BUSYBOX, ["sleep", "60"], labels=TEST_LABELS, **kwargs)
    try:
        container.start()
        with pytest.raises(OutsideGuaranteeError, match="outside the checkpoint guarantee"):
            sandbox = Sandbox.attach(engine, container.id)
        # Even a sandbox object built around it cannot be checkpointed.
        sandbox = Sandbox(engine, container, SandboxConfig(image=BUSYBOX))
        with pytest.raises(OutsideGuaranteeError):
            full_checkpoint(sandbox, "outside", store=CheckpointStore(tmp_path))
        assert CheckpointStore(tmp_path).leftovers() == []
    finally:
        container.remove(force=True, v=True)


@pytest.mark.parametrize("bad", ["../up", "a/b", "", ".hidden", "x" * 200, "sp ace", "semi;colon"])
def test_unsafe_ids(bad, make_sandbox, tmp_path):
    sandbox = make_sandbox(trajectory="ids")
    with pytest.raises(InvalidIdError, match="unsafe"):
        full_checkpoint(sandbox, bad, store=CheckpointStore(tmp_path))
    with pytest.raises(InvalidIdError):
        CheckpointStore(tmp_path).latest_ready(bad)
    assert not any(tmp_path.iterdir())


@pytest.fixture
def saved(make_sandbox, tmp_path):
    """A ready checkpoint whose original container is still alive."""
    store = CheckpointStore(tmp_path / "store")
    sandbox = make_sandbox(trajectory="saved")
    sandbox.exec("echo keep > /work/k")
    return sandbox, store, full_checkpoint(sandbox, "saved", store=store)


def _criu_image(ckpt):
    return sorted((ckpt.path / "criu").glob("pages-*.img"))[0]


@pytest.mark.parametrize("damage", ["flip-byte", "truncate-layer", "no-manifest", "no-image", "bad-manifest"])
def test_corrupt_checkpoint_is_refused_before_anything_changes(damage, saved, engine):
    sandbox, store, ckpt = saved
    if damage == "flip-byte":
        image = _criu_image(ckpt)
        data = bytearray(image.read_bytes())
        data[len(data) // 2] ^= 0xFF
        image.write_bytes(bytes(data))
    elif damage == "truncate-layer":
        os.truncate(ckpt.path / "layer.tar", 1024)
    elif damage == "no-manifest":
        (ckpt.path / "manifest.json").unlink()
    elif damage == "no-image":
        _criu_image(ckpt).unlink()
    else:
        (ckpt.path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointCorruptError):
        full_restore(ckpt, engine=engine)
    # Nothing was touched: the original container still runs, the files are where they were, and
    # no other container of the trajectory is left (a flipped page byte is found only after the new
    # container was created: page images are hashed beside its creation).
    assert sandbox.status() == "running"
    labels = [f"{key}={value}" for key, value in {**TEST_LABELS, "belayer.trajectory": "saved"}.items()]
    assert [c.id for c in engine._client.containers.list(all=True, filters={"label": labels})] == [sandbox.id]
    assert ckpt.path.is_dir()
    with pytest.raises(CheckpointCorruptError):
        store.verify(ckpt)


def test_no_checkpoint_for_trajectory(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="restart the trajectory"):
        CheckpointStore(tmp_path).get("never-saved")


def test_publish_never_overwrites(saved):
    _sandbox, store, ckpt = saved
    tmp = store.begin("saved", "other")
    with pytest.raises(CheckpointCorruptError, match="refusing to overwrite"):
        store.publish(tmp, attrs.evolve(ckpt, path=tmp))
    assert store.verify(ckpt) == ckpt


def test_engine_without_experimental_features():
    engine = Engine(FakeDockerClient(experimental=False))
    with pytest.raises(ExperimentalDisabledError, match=r"daemon\.json"):
        engine.require_checkpoint_support()


class FakeDockerClient:
    """Stands in for an engine we cannot reconfigure in a test: one without experimental mode."""

    def __init__(self, experimental: bool) -> None:
        self._experimental = experimental

    def version(self):
        return {"Version": "20.10", "Experimental": self._experimental}


def test_criu_missing_or_failing(tmp_path, monkeypatch):
    monkeypatch.setenv("BELAYER_CRIU", str(tmp_path / "no-criu"))
    with pytest.raises(CriuUnavailableError, match="setup-system"):
        check_criu()
    broken = tmp_path / "criu"
    broken.write_text("#!/bin/sh\necho 'Error: vdso: Unexpected rt vDSO area bounds' >&2\nexit 1\n")
    broken.chmod(stat.S_IRWXU)
    monkeypatch.setenv("BELAYER_CRIU", str(broken))
    with pytest.raises(CriuUnavailableError, match="vDSO"):
        check_criu()


def test_missing_image(engine):
    from belayer_envckpt import ContainerEngineError, ImageNotFoundError

    with pytest.raises(ImageNotFoundError, match="no registry") as caught:
        Sandbox.create(engine, SandboxConfig(image="belayer/not-built-here:1"))
    assert isinstance(caught.value, ContainerEngineError)
