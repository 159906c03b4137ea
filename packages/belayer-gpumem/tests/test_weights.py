"""Weight server with the host backend: real server process, real client processes."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import run_worker, sample_weights, start_worker, wait_line

from belayer_gpumem import ServerConfig, ServerProcess, UpdateBusyError, WeightClient


def test_attach_views_match_the_safetensors_file(weights_server: ServerProcess, weights_file: Path) -> None:
    expected = sample_weights()
    with WeightClient.attach(weights_server.config.socket) as client:
        assert client.version == 1
        tensors = client.tensors()
        assert set(tensors) == set(expected)
        for name, tensor in tensors.items():
            assert tensor.dtype == expected[name].dtype
            assert torch.equal(tensor, expected[name])
        # Zero copy: every view lies inside this process's one mapping of the region.
        base = client.region.data_ptr()
        for tensor in tensors.values():
            assert base <= tensor.data_ptr() < base + client.region.numel()


def test_a_merged_tensor_is_one_view_of_the_parts_written_by_name(tmp_path: Path) -> None:
    from belayer_gpumem import FusedSpec, WeightLayout

    entries = [("q", "bfloat16", (6, 8)), ("k", "bfloat16", (3, 8)), ("v", "bfloat16", (3, 8))]
    layout = WeightLayout.pack([*entries, ("o", "bfloat16", (8, 6))], [FusedSpec("qkv", ["q", "k", "v"])])
    layout_file = tmp_path / "layout.json"
    layout_file.write_text(json.dumps(layout.to_json()))
    sockets = tmp_path / "s"
    sockets.mkdir(mode=0o700)
    server = ServerProcess.start(
        ServerConfig(kind="weights", socket=sockets / "w.sock", layout_file=layout_file)
    )
    try:
        with WeightClient.attach(server.config.socket) as client:
            with client.update() as update:  # writers write the parts by their own names
                for i, view in enumerate(update.tensors().values()):
                    view.fill_(i + 1)
            merged = client.fused_tensors()["qkv"]
            assert merged.shape == (12, 8)
            assert merged.dtype == torch.bfloat16
            parts = client.tensors()
            assert merged.data_ptr() == parts["q"].data_ptr()
            assert merged.untyped_storage().data_ptr() == client.region.untyped_storage().data_ptr()
            assert [
                bool(merged[rows].eq(i + 1).all())
                for i, rows in enumerate((slice(0, 6), slice(6, 9), slice(9, 12)))
            ] == [True] * 3
            parts["k"].fill_(7)  # the same bytes, no copy
            assert merged[6:9].eq(7).all()
    finally:
        server.stop()


def test_our_reader_agrees_with_the_safetensors_library(weights_file: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from belayer_gpumem._safetensors_io import read_safetensors

    loaded = safetensors_torch.load_file(str(weights_file))
    parsed = read_safetensors(weights_file)
    assert {
        t.name: (str(loaded[t.name].dtype), tuple(loaded[t.name].shape)) for t in parsed.layout.tensors
    } == {name: (str(t.dtype), tuple(t.shape)) for name, t in loaded.items()}


def test_a_write_by_one_process_is_seen_by_another(weights_server: ServerProcess) -> None:
    socket = str(weights_server.config.socket)
    run_worker("weights-fill", socket, "3.5")
    out = run_worker("weights-checksum", socket)
    assert "VERSION 2" in out
    with WeightClient.attach(socket) as client:
        q = client.tensors()["layers.0.attn.q_proj.weight"]
        assert bool((q == 3.5).all())
        assert f"layers.0.attn.q_proj.weight:{float(q.double().sum()):.6f}" in out


def test_sigkill_of_a_client_leaves_the_region_intact(weights_server: ServerProcess) -> None:
    socket = str(weights_server.config.socket)
    holder = start_worker("weights-write-hold", socket, "2.25")
    assert wait_line(holder, "HOLDING") == "HOLDING 2"
    with WeightClient.attach(socket) as survivor:
        before = {name: t.clone() for name, t in survivor.tensors().items()}
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert survivor.ping()["ok"]
        for name, tensor in survivor.tensors().items():
            assert torch.equal(tensor, before[name])
    out = run_worker("weights-checksum", socket)  # a fresh client attaches after the death
    assert "VERSION 2" in out
    assert f"layers.0.attn.q_proj.weight:{2.25 * 32 * 32:.6f}" in out


def test_a_writer_that_dies_mid_update_publishes_nothing(weights_server: ServerProcess) -> None:
    socket = str(weights_server.config.socket)
    with WeightClient.attach(socket) as reader:
        before = {name: t.clone() for name, t in reader.tensors().items()}
        dying = start_worker("weights-begin-die", socket)
        wait_line(dying, "DYING")
        dying.wait()
        assert reader.latest_version() == 1
        assert not reader.refresh()
        for name, tensor in reader.tensors().items():
            assert torch.equal(tensor, before[name])
        with reader.update(timeout_s=10) as update:  # the dead writer's lock is gone
            update.tensors()["step"].fill_(8)
        assert reader.version == 2


def test_partial_update_with_copy_current_keeps_the_rest(weights_server: ServerProcess) -> None:
    with WeightClient.attach(weights_server.config.socket) as client:
        before = {name: t.clone() for name, t in client.tensors().items()}
        with client.update(copy_current=True) as update:
            update.tensors()["step"].fill_(99)
        after = client.tensors()
        assert int(after["step"]) == 99
        for name in before:
            if name != "step":
                assert torch.equal(after[name], before[name])


def test_readers_keep_their_version_until_refresh(weights_server: ServerProcess) -> None:
    socket = weights_server.config.socket
    with WeightClient.attach(socket) as reader, WeightClient.attach(socket) as writer:
        old = reader.tensors()["layers.0.norm.weight"].clone()
        with writer.update() as update:
            for tensor in update.tensors().values():
                tensor.fill_(1)
        assert reader.version == 1
        assert reader.latest_version() == 2
        assert torch.equal(reader.tensors()["layers.0.norm.weight"], old)
        # The old slot is pinned by the reader, so the next update has to wait for it.
        with pytest.raises(UpdateBusyError, match="refresh"):
            writer.update(timeout_s=0.2)
        assert reader.refresh()
        assert bool((reader.tensors()["layers.0.norm.weight"] == 1).all())
        writer.update(timeout_s=5).abort()
        assert writer.latest_version() == 2


def test_a_released_reader_never_holds_an_update_back(weights_server: ServerProcess) -> None:
    socket = weights_server.config.socket
    with WeightClient.attach(socket) as standby, WeightClient.attach(socket) as writer:
        standby.release()  # an idle shadow: it will not read until it refreshes
        for value in (1, 2, 3):  # without the release the second update would wait for it
            with writer.update(timeout_s=0.2) as update:
                for tensor in update.tensors().values():
                    tensor.fill_(value)
        assert standby.refresh()
        assert standby.version == writer.latest_version() == 4
        assert bool((standby.tensors()["layers.0.norm.weight"] == 3).all())
        # Pinned again: the next-but-one update waits for it, as for any reader.
        with writer.update(timeout_s=5) as update:
            update.tensors()["layers.0.norm.weight"].fill_(4)
        with pytest.raises(UpdateBusyError):
            writer.update(timeout_s=0.2)


def test_update_atomicity_hammer(run_dir: Path, tmp_path: Path) -> None:
    layout = tmp_path / "layout.json"
    tensors = [{"name": f"w{i}", "dtype": "float32", "shape": [64, 256]} for i in range(8)]
    layout.write_text(json.dumps({"tensors": tensors}))
    rounds = 40
    config = ServerConfig(kind="weights", socket=run_dir / "hammer.sock", layout_file=layout)
    with ServerProcess.start(config) as server:
        socket = str(server.config.socket)
        readers = [start_worker("weights-hammer-read", socket, str(rounds)) for _ in range(2)]
        for reader in readers:  # every reader pins a version before the first update
            wait_line(reader, "ATTACHED")
        run_worker("weights-hammer-write", socket, str(rounds))
        for reader in readers:
            line = wait_line(reader, "READS")
            assert reader.wait() == 0
            fields = line.split()
            assert fields[3] == "0", f"a reader saw a torn update: {line}"
            assert fields[7] == str(rounds)
            assert int(fields[5]) >= 2  # it saw updates land while it was reading


def test_a_layout_server_started_at_a_version_commits_the_next_one(run_dir: Path, tmp_path: Path) -> None:
    # A slot restarted from scratch refills its weights as version N again: it starts at N - 1.
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"tensors": [{"name": "w", "dtype": "float32", "shape": [4]}]}))
    config = ServerConfig(kind="weights", socket=run_dir / "v.sock", layout_file=layout, start_version=6)
    assert "--start-version" in config.to_argv()
    with ServerProcess.start(config) as server:
        client = WeightClient.attach(server.config.socket)
        try:
            assert client.version == 6
            with client.update() as update:
                update.tensors()["w"].fill_(2)
                assert update.commit() == 7
            assert client.latest_version() == 7
        finally:
            client.detach()


def test_a_start_version_is_refused_where_it_means_nothing(tmp_path: Path) -> None:
    from belayer_gpumem import LayoutError

    with pytest.raises(LayoutError, match="needs --layout"):
        ServerConfig(
            kind="weights", socket=tmp_path / "w.sock", safetensors=tmp_path / "w.st", start_version=3
        )
    with pytest.raises(LayoutError, match="0 or more"):
        ServerConfig(kind="weights", socket=tmp_path / "w.sock", layout_file=tmp_path / "l", start_version=-1)
