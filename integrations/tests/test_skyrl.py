"""SkyRL's own `RemoteInferenceClient` (skyrl 0.4.0) against `belayer-shadow serve`.

skyrl 0.4.0 requires Python >= 3.12 (0.3.0's pydantic models do not import on 3.11), and the
project runs on 3.11: the client runs in a virtual environment of its own
(`$BELAYER_SKYRL_PYTHON`, which the `integrations_skyrl` nox session builds: skyrl with `--no-deps`
plus what its client imports, integrations/requirements-skyrl.txt), the service in this one.
`integrations/skyrl_driver.py` drives the service with SkyRL's client and reports what it saw.

Checked: `/get_world_size`, `/tokenize`, `/detokenize`, `/inference/v1/generate` with session
headers (token ids and one logprob per token), `/v1/chat/completions` with tools and a tool
result, `pause(mode="keep")` with a 800-token request in flight, a weight load by folder while
paused, `resume()`: the request completes whole (every token, one logprob each) and the service's
counters show it was held and continued; the version advanced and the same seeded request
answers differently on the new weights.

And SkyRL's delta weight sync (`weight_sync_backend="delta"`), published and driven by SkyRL's own
trainer-side code (`integrations/skyrl_delta_driver.py`: `DeltaTrainerWeightTransferEngine` built
through vLLM's trainer factory, `SkyrlWeightSyncClient`, `FsdpWeightSource` over a transformers
model after one optimizer step, `send_weights()` off the event loop as SkyRL's worker calls it), with
a 1500-token request in flight: SkyRL writes the XOR delta (manifest + zstd payloads) and calls
`/init_weight_transfer_engine`, `/fetch_weights`, `/pause?mode=keep`, `/start_weight_update`,
`/update_weights {"update_info"}`, `/finish_weight_update`, `/resume`; the version advances, the
request completes whole with a logprob per token (held and continued), every slot's weight server
holds the trainer's weights bit-exact, and the same seeded request answers with other logprobs.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from serving import belayer_serve, write_model_folder

pytestmark = [pytest.mark.timeout(600)]

DRIVER = Path(__file__).parents[1] / "skyrl_driver.py"
DELTA_DRIVER = Path(__file__).parents[1] / "skyrl_delta_driver.py"
MODEL = "skyrl-policy"


def _skyrl_python() -> str:
    python = os.environ.get("BELAYER_SKYRL_PYTHON")
    if not python:  # the `integrations` session (TRL); `integrations_skyrl` always sets it
        pytest.skip(
            "needs SkyRL's Python >= 3.12 venv in $BELAYER_SKYRL_PYTHON: run `nox -s integrations_skyrl`"
        )
    return python


def test_skyrl_remote_inference_client_generates_chats_and_holds_a_request_across_a_weight_load(
    tmp_path: Path,
) -> None:
    python = _skyrl_python()
    folder = write_model_folder(tmp_path / "model", seed=0)
    update = write_model_folder(tmp_path / "step_1", seed=1)  # what the trainer would publish
    flags = ("--slots", "2", "--num-kv-blocks", "256", "--served-model-name", MODEL)
    with belayer_serve(folder, tmp_path / "serve", *flags) as ready:
        done = subprocess.run(
            [python, str(DRIVER), ready["url"], MODEL, str(update)],
            capture_output=True,
            text=True,
            timeout=480,
        )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    assert seen["world_size"] == [2, 2]  # two slots serving
    generated = seen["generate"]
    assert [len(ids) for ids in generated["response_ids"]] == [12, 12]
    assert [len(lps) for lps in generated["response_logprobs"]] == [12, 12]
    assert all(math.isfinite(lp) and lp <= 0 for lps in generated["response_logprobs"] for lp in lps)
    assert generated["response_ids"][0] == generated["response_ids"][1]  # the same seed
    assert seen["detokenized"] == generated["responses"]
    assert generated["stop_reasons"] == ["length", "length"]

    for answer in seen["chat"]:
        choice = answer["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] in ("length", "stop", "tool_calls")
        assert answer["usage"]["completion_tokens"] >= 1
    # The tool call and its result were rendered into the second prompt.
    assert seen["chat"][1]["usage"]["prompt_tokens"] > seen["chat"][0]["usage"]["prompt_tokens"]

    assert seen["is_paused"] == {"is_paused": True}
    assert seen["done_while_paused"] is False  # held, not failed
    assert seen["update"]["status"] == 200
    assert seen["update"]["body"]["version"] == 1
    kept = seen["kept"]
    assert len(kept["response_ids"]) == 800 == len(kept["response_logprobs"])
    assert kept["stop_reason"] == "length"
    assert all(math.isfinite(lp) for lp in kept["response_logprobs"])
    metrics = seen["metrics"]
    assert "belayer_router_pause_resumes_total 1" in metrics  # cut by the pause, continued
    assert "belayer_router_required_weight_version 1" in metrics
    assert "belayer_router_weight_updates_total 1" in metrics
    after = seen["after_update"]["response_logprobs"]
    assert after != generated["response_logprobs"]  # the new weights answer


def _weight_servers(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """Each slot's weight server: its version and a copy of its live tensors."""
    from belayer_gpumem import WeightClient

    found = []
    for socket in sorted(run_dir.glob("slots/*/mem/weights.sock")):
        client = WeightClient.attach(socket)
        try:
            found.append((client.version, {k: v.clone() for k, v in client.tensors().items()}))
        finally:
            client.detach()
    return found


def test_skyrl_delta_weight_sync_published_by_skyrl_reaches_every_slot_and_holds_a_request(
    tmp_path: Path,
) -> None:
    import torch
    from safetensors.torch import load_file

    python = _skyrl_python()
    folder = write_model_folder(tmp_path / "model", seed=0)
    work = tmp_path / "trainer"
    work.mkdir()
    run_dir = tmp_path / "serve"
    flags = ("--slots", "2", "--num-kv-blocks", "256", "--served-model-name", MODEL)
    with belayer_serve(folder, run_dir, *flags) as ready:
        start = [version for version, _ in _weight_servers(run_dir)]
        done = subprocess.run(
            [python, str(DELTA_DRIVER), ready["url"], MODEL, str(folder), str(work)],
            capture_output=True,
            text=True,
            timeout=480,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        servers = _weight_servers(run_dir)
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    assert seen["engine"] == "DeltaTrainerWeightTransferEngine"
    # SkyRL's publisher wrote version 1 as a delta: a manifest and zstd XOR payloads.
    assert "delta-00000001/manifest.json" in seen["published"]
    assert any(p.startswith("delta-00000001/delta-rank00000-file") for p in seen["published"])
    manifest = json.loads((work / "sync" / "delta-00000001" / "manifest.json").read_text())
    assert (manifest["version"], manifest["base_version"]) == (1, 0)
    assert len(manifest["tensors"]) >= 10  # the step moved every parameter

    # The request in flight was held by the pause (keep) and completed whole after the resume.
    kept = seen["kept"]
    assert len(kept["response_ids"]) == 1500 == len(kept["response_logprobs"])
    assert kept["stop_reason"] == "length"
    assert all(math.isfinite(lp) for lp in kept["response_logprobs"])
    metrics = seen["metrics"]
    assert "belayer_router_pause_resumes_total 1" in metrics  # cut by the pause, continued
    assert "belayer_router_required_weight_version 1" in metrics  # the version advanced
    assert "belayer_router_weight_updates_total 1" in metrics

    # Every slot committed once and holds the trainer's weights, bit-exact.
    trained = load_file(str(work / "trained.safetensors"))
    assert [version for version, _ in servers] == [version + 1 for version in start]
    for _, tensors in servers:
        assert all(torch.equal(tensors[name], trained[name]) for name in tensors)
    # The same seeded request answers with other logprobs on the new weights.
    assert len(seen["after"]["response_logprobs"]) == 12
    assert seen["after"]["response_logprobs"] != seen["before"]["response_logprobs"]
