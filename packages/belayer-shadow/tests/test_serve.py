"""`belayer-shadow serve MODEL_DIR`: the router and N slots from one Hugging Face folder, as a real
command on the built-in engine: OpenAI routes with token ids and logprobs, chat through the
folder's template, a worker SIGKILLed mid-request (the request completes), SIGTERM and SIGKILL of
the command (nothing left), and bad folders refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import (
    processes_mentioning,
    serve_command,
    serving_process,
    wait_until_gone,
    write_model_folder,
)

from belayer_shadow import ModelConfigError, UnsupportedModelError, WeightsError
from belayer_shadow._serve._config import ServeConfig
from belayer_shadow._serve._model_folder import ModelFolder

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("qwen3-tiny"))


# The folder, checked before anything starts.


def test_model_folder_reads_a_saved_qwen3(model_dir: Path) -> None:
    folder = ModelFolder.inspect(model_dir)
    assert folder.config.vocab_size == 512
    assert folder.config.num_hidden_layers == 4
    assert folder.has_tokenizer


def _folder_with(tmp_path: Path, model_dir: Path, **changes: Any) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    data = json.loads((model_dir / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(data))
    (folder / "model.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    return folder


def test_another_architecture_is_a_typed_error_naming_what_is_served(tmp_path: Path, model_dir: Path) -> None:
    folder = _folder_with(tmp_path, model_dir, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelFolder.inspect(folder)


def test_missing_config_weights_or_folder_say_what_to_do(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        ModelFolder.inspect(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        ModelFolder.inspect(tmp_path / "empty")
    folder = _folder_with(tmp_path, model_dir)
    (folder / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="safetensors"):
        ModelFolder.inspect(folder)


def test_max_model_len_must_fit_the_model_and_the_kv_pool(model_dir: Path) -> None:
    folder = ModelFolder.inspect(model_dir)  # max_position_embeddings 4096
    assert ServeConfig(model_dir, num_kv_blocks=64).prompt_limit(folder) == 1024  # the pool's
    assert ServeConfig(model_dir, max_model_len=300).prompt_limit(folder) == 300
    with pytest.raises(ModelConfigError, match="max_position_embeddings"):
        ServeConfig(model_dir, max_model_len=5000, num_kv_blocks=1024).prompt_limit(folder)
    with pytest.raises(ModelConfigError, match="--num-kv-blocks to at least 32"):
        ServeConfig(model_dir, max_model_len=512, num_kv_blocks=16).prompt_limit(folder)


def test_unsupported_architecture_command_exits_2_before_starting_anything(
    tmp_path: Path, model_dir: Path
) -> None:
    folder = _folder_with(tmp_path, model_dir, architectures=["MistralForCausalLM"])
    result = subprocess.run(
        serve_command(folder, "--run-dir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "belayer-shadow: error:" in result.stderr
    assert "Qwen3ForCausalLM" in result.stderr
    assert not (tmp_path / "run" / "slots").exists()


# The command, serving.


def _main_pids(run_dir: Path) -> list[int]:
    pids = []
    for table in sorted(run_dir.glob("slots/*/processes.json")):
        for entry in json.loads(table.read_text())["processes"]:
            if entry["role"] == "main":
                pids.append(entry["pid"])
    return pids


def test_serve_two_slots_survives_a_worker_kill_and_stops_on_sigterm(tmp_path: Path, model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    command = serve_command(model_dir, "--slots", "2", "--num-kv-blocks", "256", "--run-dir", str(run_dir))
    command += ["--served-model-name", "tiny", "--max-model-len", "4096"]
    with serving_process(command) as (process, ready):
        url = ready["url"]
        assert ready["openai_base_url"] == url + "/v1"
        assert ready["slots"] == ["slot0", "slot1"]
        with httpx.Client(base_url=url, timeout=300) as client:
            assert client.get("/health").json() == {"status": "ok", "num_active_workers": 2}
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 6, "logprobs": 1, "seed": 3}
            choice = client.post("/v1/completions", json=body).json()["choices"][0]
            assert len(choice["token_ids"]) == 6 == len(choice["logprobs"]["token_logprobs"])
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            answer = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
            assert answer["prompt_token_ids"][0] == 257  # <|im_start|>: the folder's template
            assert (
                client.post("/v1/completions", json=body | {"prompt": list(range(4097))}).status_code == 400
            )

            # Kill every main worker while a long request runs: the shadows take over and the
            # request completes with one logprob per token.
            long = body | {"max_tokens": 1500, "request_id": "long-1", "temperature": 1.0}
            result: dict[str, Any] = {}
            thread = threading.Thread(
                target=lambda: result.update(client.post("/v1/completions", json=long).json())
            )
            thread.start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                record = client.get("/requests/long-1")
                if record.status_code == 200 and len(record.json()["token_ids"]) >= 20:
                    break
                time.sleep(0.05)
            for pid in _main_pids(run_dir):
                os.kill(pid, signal.SIGKILL)
            thread.join(timeout=300)
            choice = result["choices"][0]
            assert len(choice["token_ids"]) == 1500 == len(choice["logprobs"]["token_logprobs"])
            assert choice["num_resumes"] >= 1
            metrics = client.get("/metrics").text
            assert "belayer_router_resumes_total" in metrics
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 130
    assert wait_until_gone(str(run_dir)) == []
    assert not list(run_dir.glob("slots/*/mem/*.sock"))
    assert run_dir.exists()  # a run folder given by the user is kept (logs, events)


def test_sigkill_of_the_command_leaves_no_process_and_no_folder(model_dir: Path) -> None:
    with serving_process(serve_command(model_dir, "--num-kv-blocks", "64")) as (process, ready):
        run_dir = ready["run_dir"]
        assert len(processes_mentioning(run_dir)) >= 5  # memory servers, main, shadow, guardians
        with httpx.Client(base_url=ready["url"], timeout=120) as client:
            body = {"prompt": [5, 6], "max_tokens": 3}
            assert len(client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]) == 3
        process.kill()
        process.wait(timeout=60)
        assert wait_until_gone(run_dir) == []
        deadline = time.monotonic() + 30
        while Path(run_dir).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(run_dir).exists()
