"""`belayer-cluster serve MODEL_DIR`: the real command joining the session's Ray cluster by address,
two slots on two nodes of the built-in engine from a seeded Qwen3 folder on the shared folder.

One command for the module (starting one takes a while on a loaded machine), in this order: the
OpenAI routes across both nodes; `/update_weights` by folder (every slot reports the new version,
greedy outputs change; a bad folder is a 400 and changes nothing); a node killed mid-stream
(every stream completes exactly; the lost slot is replaced on the spare node, from the weights
last committed, and serves the same outputs); SIGTERM (exit 130, the cluster's CPUs free again,
no process of the slots left). An unsupported architecture is refused before Ray is touched.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from cluster_helpers import PROMPTS, Rollout, gone, processes_mentioning, rollout, wait_until

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 96
START_TIMEOUT_S = 300


def _write_model(folder: Path, seed: int) -> Path:
    """A folder as `save_pretrained` writes it, the built-in model's shape, with a chat tokenizer."""
    import torch
    from transformers import Qwen3ForCausalLM

    from belayer_router.testing import write_chat_tokenizer
    from belayer_shadow import ModelConfig

    torch.manual_seed(seed)
    Qwen3ForCausalLM(ModelConfig.default().to_hf()).save_pretrained(folder)
    write_chat_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def models(shared_dir: Path) -> dict[str, Path]:
    """The served model (seed 0) and other weights of the same shapes (seed 1), on the shared folder."""
    return {"first": _write_model(shared_dir / "m0", 0), "second": _write_model(shared_dir / "m1", 1)}


class Served:
    """The running command: its ready document and its stderr, read in a thread."""

    def __init__(self, process: subprocess.Popen[str], ready: dict[str, Any]) -> None:
        self.process, self.ready, self.url = process, ready, str(ready["url"])
        self.stderr: list[str] = []
        assert process.stderr is not None
        stream = process.stderr
        threading.Thread(target=lambda: self.stderr.extend(iter(stream.readline, "")), daemon=True).start()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^belayer_router_(\S+) (\S+)$", text, re.MULTILINE)}

    def versions(self) -> dict[str, float]:
        found = self.metrics()
        return {
            k[len('slot_weight_version{slot="') : -2]: v
            for k, v in found.items()
            if "slot_weight_version{" in k
        }

    def healthy(self) -> dict[str, float]:
        found = self.metrics()
        return {
            k[len('slot_healthy{slot="') : -2]: v for k, v in found.items() if k.startswith("slot_healthy{")
        }


@pytest.fixture(scope="module")
def served(local_ray: Any, shared_dir: Path, models: dict[str, Path]) -> Iterator[Served]:
    argv = [sys.executable, "-m", "belayer_cluster", "serve", str(models["first"]), "--slots", "2"]
    argv += ["--address", local_ray.address, "--host", "0.0.0.0", "--port", "0", "--json"]
    argv += ["--shared-dir", str(shared_dir / "s"), "--num-kv-blocks", "128", "--served-model-name", "tiny"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        line: list[str] = []
        reader = threading.Thread(
            target=lambda: line.append(process.stdout.readline() if process.stdout else "")
        )
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not line or not line[0]:
            process.kill()
            raise AssertionError(f"serve did not come up: {process.communicate(timeout=60)[1][-4000:]}")
        yield Served(process, json.loads(line[0]))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)


def test_the_command_serves_completions_and_chat_from_slots_on_two_nodes(served: Served) -> None:
    slots = served.ready["slots"]
    assert sorted(slots) == ["slot0", "slot1"]
    assert slots["slot0"]["node_id"] != slots["slot1"]["node_id"]  # spread
    assert served.ready["openai_base_url"] == served.url + "/v1"
    with httpx.Client(base_url=served.url, timeout=300) as client:
        assert client.get("/health").json() == {"status": "ok", "num_active_workers": 2}
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 6, "logprobs": 1, "temperature": 0}
        choices = [client.post("/v1/completions", json=body).json()["choices"][0] for _ in range(4)]
        assert all(len(c["token_ids"]) == 6 == len(c["logprobs"]["token_logprobs"]) for c in choices)
        assert len({tuple(c["token_ids"]) for c in choices}) == 1  # same weights on both nodes
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        answer = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
        assert answer["prompt_token_ids"][0] == 257  # <|im_start|>: the folder's chat template


def test_update_weights_by_folder_bumps_every_slots_version_and_changes_greedy_output(
    served: Served, models: dict[str, Path], shared_dir: Path
) -> None:
    before = rollout(served.url, PROMPTS, 16).tokens
    with httpx.Client(base_url=served.url, timeout=300) as client:
        bad = shared_dir / "not-weights"
        bad.mkdir()
        (bad / "model.safetensors").write_bytes(b"truncated")
        refused = client.post("/update_weights", json={"weight_dir": str(bad)})
        assert refused.status_code == 400, refused.text
        assert rollout(served.url, PROMPTS, 16).tokens == before  # the old weights still served
        done = client.post("/update_weights", json={"weight_dir": str(models["second"])})
        assert done.status_code == 200, done.text
        version = done.json()["version"]
    assert served.versions() == {"slot0": version, "slot1": version}
    assert served.metrics()["required_weight_version"] == version
    after = rollout(served.url, PROMPTS, 16).tokens
    assert after != before
    assert rollout(served.url, PROMPTS, 16).tokens == after  # every slot serves the new weights


def test_a_node_killed_mid_stream_resumes_exactly_and_its_slot_is_replaced(
    served: Served, local_ray: Any
) -> None:
    reference = rollout(served.url, PROMPTS, MAX_TOKENS).tokens
    version = served.metrics()["required_weight_version"]
    lost = served.ready["slots"]["slot1"]
    streams = Rollout(served.url, PROMPTS, MAX_TOKENS).start()
    streams.wait_tokens(4)
    local_ray.remove_node(lost["node_id"])
    streams.join(240)
    assert streams.tokens == reference  # token-exact through the router
    assert all(indices == list(range(MAX_TOKENS)) for indices in streams.indices)
    # The lost slot is replaced in its bundle on the node left free, from the weights last
    # committed, and serves once it reports the required version.
    try:
        wait_until(lambda: served.healthy().get("slot1-r1") == 1.0, 240, "slot1's replacement to register")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the command said: {''.join(served.stderr)[-4000:]}") from None
    assert served.healthy()["slot1"] == 0.0
    wait_until(lambda: served.versions().get("slot1-r1") == version, 60, "the replacement's version")
    # The command says so right after the replacement reports its version: wait for the line.
    wait_until(
        lambda: any("replaced by slot1-r1" in line for line in served.stderr), 30, "the replacement's line"
    )
    assert rollout(served.url, PROMPTS, MAX_TOKENS).tokens == reference
    with httpx.Client(base_url=served.url, timeout=300) as client:
        assert client.get("/health").json()["num_active_workers"] == 2


def test_sigterm_stops_every_slot_and_actor(served: Served, shared_dir: Path, local_ray: Any) -> None:
    total = ray.cluster_resources()["CPU"]
    kept = served.ready["slots"]["slot0"]  # its node lives on: its SlotHost actor must end
    host = local_ray.host_pid(kept["node_id"], kept["pid"])
    assert host
    assert not gone(host)
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=180) == 130
    wait_until(lambda: gone(host), 60, "slot0's SlotHost actor to exit")
    wait_until(lambda: ray.available_resources().get("CPU", 0.0) == total, 120, "the slots' CPUs to be free")
    wait_until(lambda: not processes_mentioning(str(shared_dir / "s")), 60, "every slot process to exit")


def test_an_unsupported_architecture_exits_2_before_anything_starts(
    tmp_path: Path, models: dict[str, Path]
) -> None:
    folder = tmp_path / "llama"
    folder.mkdir()
    config = json.loads((models["first"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForCausalLM"]}))
    (folder / "model.safetensors").write_bytes((models["first"] / "model.safetensors").read_bytes())
    argv = [sys.executable, "-m", "belayer_cluster", "serve", str(folder), "--address", "127.0.0.1:9"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("belayer-cluster: error: ")
    assert "LlamaForCausalLM" in done.stderr
    assert "Qwen3ForCausalLM" in done.stderr
    assert "Traceback" not in done.stderr
