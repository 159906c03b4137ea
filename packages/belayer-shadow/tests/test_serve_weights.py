"""Weights by folder through `belayer-shadow serve`'s control plane, on real weight servers: every
slot loads and commits one version, in-flight requests see one version, and a missing, malformed,
mismatched or truncated folder is a 400 with the previous weights still served."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serve_helpers import processes_mentioning, serve_command, serving_process, write_model_folder

from belayer_gpumem import BelayerGpumemError, WeightClient
from belayer_shadow import ModelConfig, load_safetensors

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("weights")
    first = write_model_folder(root / "first", seed=0)
    second = write_model_folder(root / "second", seed=1)
    from transformers import Qwen3ForCausalLM

    wide = ModelConfig.from_dict(ModelConfig.default().to_dict() | {"intermediate_size": 256})
    Qwen3ForCausalLM(wide.to_hf()).save_pretrained(root / "wide")
    halves = load_safetensors(second)
    (root / "bf16").mkdir()
    from safetensors.torch import save_file

    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in halves.items()},
        str(root / "bf16" / "model.safetensors"),
    )
    (root / "truncated").mkdir()
    data = (second / "model.safetensors").read_bytes()
    (root / "truncated" / "model.safetensors").write_bytes(data[: len(data) // 2])
    (root / "empty").mkdir()
    return {"first": first, "second": second, "wide": root / "wide", "bf16": root / "bf16"} | {
        "truncated": root / "truncated",
        "empty": root / "empty",
    }


def _greedy(client: httpx.Client, max_tokens: int = 12) -> list[int]:
    body = {"prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0.0}
    return list(client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"])


def _servers(run_dir: Path) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Each slot's weight server: its version and a copy of its live tensors."""
    found = []
    for socket in sorted(run_dir.glob("slots/*/mem/weights.sock")):
        client = WeightClient.attach(socket)
        try:
            found.append((client.version, {k: v.clone() for k, v in client.tensors().items()}))
        finally:
            client.detach()
    return found


def _same(tensors: dict[str, torch.Tensor], folder: Path) -> bool:
    expected = load_safetensors(folder)
    return all(torch.equal(tensors[name], expected[name]) for name in tensors)


def test_weight_updates_by_folder_reach_every_slot_and_bad_folders_change_nothing(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    run_dir = tmp_path / "run"
    command = serve_command(
        folders["first"], "--slots", "2", "--num-kv-blocks", "64", "--run-dir", str(run_dir)
    )
    with (
        serving_process(command) as (_process, ready),
        httpx.Client(base_url=ready["url"], timeout=300) as client,
    ):
        before = _greedy(client)
        start_versions = [version for version, _ in _servers(run_dir)]
        assert len(start_versions) == 2

        answer = client.post("/update_weights", json={"weight_dir": str(folders["second"])})
        assert answer.status_code == 200, answer.text
        assert answer.json()["version"] == 1
        servers = _servers(run_dir)
        assert [v for v, _ in servers] == [v + 1 for v in start_versions]  # one commit on each slot
        assert all(_same(tensors, folders["second"]) for _, tensors in servers)
        after = _greedy(client)
        assert after != before
        assert [_greedy(client) for _ in range(3)] == [after] * 3

        refused = {
            "empty": "safetensors",
            "wide": "shape",
            "bf16": "bfloat16",
            "truncated": "not loaded",
        }
        for name, why in refused.items():
            answer = client.post("/update_weights", json={"weight_dir": str(folders[name])})
            assert answer.status_code == 400, name
            assert why in answer.json()["error"]["message"], answer.text
        missing = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere")})
        assert missing.status_code == 400
        assert missing.json()["success"] is False
        assert "does not exist" in missing.json()["message"]
        servers = _servers(run_dir)
        assert [v for v, _ in servers] == [v + 1 for v in start_versions]  # nothing committed
        assert all(_same(tensors, folders["second"]) for _, tensors in servers)
        assert _greedy(client) == after  # the previous weights are still served

        back = client.post("/update_weights_from_disk", json={"model_path": str(folders["first"])})
        assert back.json() == {
            "success": True,
            "message": f"weights from {folders['first']} loaded into every slot (version 2)",
            "version": 2,
        }
        assert _greedy(client) == before


def test_a_request_paused_in_keep_mode_continues_on_the_new_weights(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    run_dir = tmp_path / "run"
    command = serve_command(folders["first"], "--num-kv-blocks", "128", "--run-dir", str(run_dir))
    with (
        serving_process(command) as (_process, ready),
        httpx.Client(base_url=ready["url"], timeout=300) as client,
    ):
        body = {"prompt": [4, 5], "max_tokens": 1500, "temperature": 1.0, "seed": 11, "request_id": "kept"}
        body |= {"logprobs": 1}
        result: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: result.update(client.post("/v1/completions", json=body).json())
        )
        thread.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            record = client.get("/requests/kept")
            if record.status_code == 200 and len(record.json()["token_ids"]) >= 10:
                break
            time.sleep(0.02)
        assert client.post("/pause", params={"mode": "keep"}).json()["mode"] == "keep"
        held = len(client.get("/requests/kept").json()["token_ids"])
        time.sleep(0.5)
        assert len(client.get("/requests/kept").json()["token_ids"]) == held  # nothing runs while paused
        assert client.post("/update_weights", json={"weight_dir": str(folders["second"])}).status_code == 200
        client.post("/resume")
        thread.join(timeout=300)
        choice = result["choices"][0]
        assert choice["token_ids"][:held] == client.get("/requests/kept").json()["token_ids"][:held]
        assert len(choice["token_ids"]) == 1500 == len(choice["logprobs"]["token_logprobs"])
        if held < 1500:  # it was still running when paused (the usual case): it was held and resumed
            assert choice["num_resumes"] == 1
            assert "belayer_router_pause_resumes_total 1" in client.get("/metrics").text
    shutil.rmtree(run_dir, ignore_errors=True)


def _weight_server(run_dir: Path, slot: str = "slot0") -> list[int]:
    socket = str(run_dir / "slots" / slot / "mem" / "weights.sock")
    return sorted(set(processes_mentioning("belayer_gpumem")) & set(processes_mentioning(socket)))


def test_a_slot_restarted_from_scratch_serves_the_last_pushed_weights(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    """Update, then SIGKILL the slot's weight server: the slot restarts from scratch (new memory
    servers) and serves the pushed weights, not the model folder's, at the version it reports."""
    run_dir = tmp_path / "run"
    command = serve_command(
        folders["first"], "--num-kv-blocks", "128", "--run-dir", str(run_dir), "--recovery", "restart"
    )
    with (
        serving_process(command) as (_process, ready),
        httpx.Client(base_url=ready["url"], timeout=300) as client,
    ):
        original = _greedy(client)
        assert client.post("/update_weights", json={"weight_dir": str(folders["second"])}).status_code == 200
        pushed = _greedy(client)
        assert pushed != original
        (victim,) = _weight_server(run_dir)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 240
        while _weight_server(run_dir) in ([], [victim]):
            assert time.monotonic() < deadline, "the slot's weight server was not restarted"
            time.sleep(0.2)
        assert _greedy(client) == pushed  # held until the slot is back, then on the pushed weights
        (_version, tensors), *_ = _servers(run_dir)
        assert _same(tensors, folders["second"])


def test_an_update_while_a_slot_restarts_does_not_wait_for_it_and_the_slot_returns_on_it(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    """SIGKILL slot1's weight server, then update at once: the update succeeds (before, it waited
    5 s to attach to the dead server and failed with a 400), and slot1, back from its restart from
    scratch, holds the new folder, as slot0 does, and serves its outputs."""
    run_dir = tmp_path / "run"
    command = serve_command(
        folders["first"], "--slots", "2", "--num-kv-blocks", "64", "--run-dir", str(run_dir)
    )
    with (
        serving_process(command) as (_process, ready),
        httpx.Client(base_url=ready["url"], timeout=300) as client,
    ):
        (victim,) = _weight_server(run_dir, "slot1")
        os.kill(victim, signal.SIGKILL)
        response = client.post("/update_weights", json={"weight_dir": str(folders["second"])})
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 240
        while _weight_server(run_dir, "slot1") in ([], [victim]):
            assert time.monotonic() < deadline, "slot1's weight server was not restarted"
            time.sleep(0.2)
        # The new server's process runs before its socket exists and before the refill commits
        # the kept folder: wait for both servers to hold the second folder.
        servers: list[tuple[int, dict[str, torch.Tensor]]] = []
        while not (len(servers) == 2 and all(_same(t, folders["second"]) for _v, t in servers)):
            assert time.monotonic() < deadline, (
                f"slot1 did not come back on the new folder: {len(servers)} servers"
            )
            time.sleep(0.5)
            try:
                servers = _servers(run_dir)
            except (OSError, BelayerGpumemError):  # a socket there, its server not answering yet
                servers = []
        events = (run_dir / "slots" / "slot1" / "events.jsonl").read_text()
        assert "memory.lost" in events  # slot1 did restart from scratch
        outputs = {tuple(_greedy(client)) for _ in range(4)}  # over both slots: one answer
        assert len(outputs) == 1
