"""SkyRL's checkpoint-delta weight sync through `belayer-shadow serve`'s control plane, with plain
HTTP, on real weight servers: init at the served checkpoint, fetch while a request runs (nothing
served changes), pause (keep), start, update, finish, resume: the held request completes whole,
every slot holds the new weights bit-exact under one new version, and each slot keeps them for a
restart. A corrupt delta is a 400 naming the problem and the previous weights stay served.
SkyRL's own code drives the same routes in integrations/tests/test_skyrl.py."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from delta_helpers import PAYLOAD, publish_delta
from serve_helpers import serve_command, serving_process, write_model_folder

from belayer_gpumem import WeightClient
from belayer_shadow import load_safetensors

pytestmark = [pytest.mark.timeout(600)]


def _servers(run_dir: Path) -> list[tuple[int, dict[str, torch.Tensor]]]:
    found = []
    for socket in sorted(run_dir.glob("slots/*/mem/weights.sock")):
        client = WeightClient.attach(socket)
        try:
            found.append((client.version, {k: v.clone() for k, v in client.tensors().items()}))
        finally:
            client.detach()
    return found


def _same(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(tensors[name], expected[name]) for name in tensors)


def _greedy(client: httpx.Client) -> list[float]:
    body = {"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0.0, "logprobs": 0}
    return list(client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"])


def _corrupt(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    payloads = load_file(str(folder / PAYLOAD))
    name = sorted(payloads)[0]
    tensor = payloads[name].clone()
    tensor[len(tensor) // 2] ^= 0x5A
    payloads[name] = tensor
    save_file(payloads, str(folder / PAYLOAD))


def test_a_skyrl_delta_sync_holds_a_kept_request_and_a_corrupt_delta_changes_nothing(tmp_path: Path) -> None:
    first = write_model_folder(tmp_path / "first", seed=0)
    second = write_model_folder(tmp_path / "second", seed=1)
    third = write_model_folder(tmp_path / "third", seed=2)
    weights = [load_safetensors(folder) for folder in (first, second, third)]
    sync = tmp_path / "sync"
    run_dir = tmp_path / "run"
    command = serve_command(first, "--slots", "2", "--num-kv-blocks", "128", "--run-dir", str(run_dir))
    with (
        serving_process(command) as (_process, ready),
        httpx.Client(base_url=ready["url"], timeout=300) as client,
    ):
        start = [version for version, _ in _servers(run_dir)]
        before = _greedy(client)
        # Fetch before init: refused.
        early = client.post("/fetch_weights", json={"target_version": 1, "sync_dir": str(sync)})
        assert early.status_code == 400
        assert "init_weight_transfer_engine" in early.json()["error"]["message"]
        init_info = {"base_model_path": str(first), "local_checkpoint_dir": str(tmp_path / "local")}
        init = client.post("/init_weight_transfer_engine", json={"init_info": init_info})
        assert init.status_code == 200, init.text
        wrong = client.post(
            "/init_weight_transfer_engine", json={"init_info": {"base_model_path": str(sync)}}
        )
        assert wrong.status_code == 400  # not a folder here: the chain set up above stays
        assert "not a folder" in wrong.json()["error"]["message"]

        publish_delta(sync, 1, weights[0], weights[1])
        body = {"prompt": [4, 5], "max_tokens": 1500, "temperature": 1.0, "seed": 11, "request_id": "kept"}
        body |= {"logprobs": 0}
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
        fetched = client.post("/fetch_weights", json={"target_version": 1, "sync_dir": str(sync)})
        assert fetched.status_code == 200, fetched.text
        assert fetched.json()["result"]["version"] == 1
        servers = _servers(run_dir)
        assert [v for v, _ in servers] == start  # fetching touched no weight server
        assert all(_same(tensors, weights[0]) for _, tensors in servers)

        assert client.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
        held = len(client.get("/requests/kept").json()["token_ids"])
        assert client.post("/start_weight_update").status_code == 200
        update = client.post(
            "/update_weights", json={"update_info": {"target_version": 1, "sync_dir": str(sync)}}
        )
        assert update.status_code == 200, update.text
        assert update.json()["version"] == 1
        assert client.post("/finish_weight_update").json()["version"] == 1
        assert len(client.get("/requests/kept").json()["token_ids"]) == held  # still held
        client.post("/resume")
        thread.join(timeout=300)
        choice = result["choices"][0]
        assert len(choice["token_ids"]) == 1500 == len(choice["logprobs"]["token_logprobs"])
        if held < 1500:
            assert choice["num_resumes"] == 1
        servers = _servers(run_dir)
        assert [v for v, _ in servers] == [v + 1 for v in start]  # one commit on each slot
        assert all(_same(tensors, weights[1]) for _, tensors in servers)
        after = _greedy(client)
        assert after != before
        for slot in ("slot0", "slot1"):  # kept for a restart from scratch
            kept = load_safetensors(run_dir / "slots" / slot / "kept-weights")
            assert _same({k: kept[k] for k in servers[0][1]}, weights[1])

        # A corrupt delta: 400, nothing staged, the served weights unchanged.
        _corrupt(publish_delta(sync, 2, weights[1], weights[2]))
        corrupt = client.post("/fetch_weights", json={"target_version": 2, "sync_dir": str(sync)})
        assert corrupt.status_code == 400
        message = corrupt.json()["error"]["message"]
        assert "delta-00000002" in message, message
        assert "the last version fetched is 1" in message, message
        not_fetched = client.post("/update_weights", json={"update_info": {"target_version": 2}})
        assert not_fetched.status_code == 400
        assert "was not fetched" in not_fetched.json()["error"]["message"]
        servers = _servers(run_dir)
        assert [v for v, _ in servers] == [v + 1 for v in start]
        assert all(_same(tensors, weights[1]) for _, tensors in servers)
        assert _greedy(client) == after
        assert "belayer_router_weight_updates_total 1" in client.get("/metrics").text

        # Published again, whole: it applies (without a pause: the update waits for what runs).
        publish_delta(sync, 2, weights[1], weights[2])
        assert (
            client.post("/fetch_weights", json={"target_version": 2, "sync_dir": str(sync)}).status_code
            == 200
        )
        assert (
            client.post("/update_weights", json={"update_info": {"target_version": 2}}).json()["version"] == 2
        )
        assert all(_same(tensors, weights[2]) for _, tensors in _servers(run_dir))
