"""`belayer-shadow serve --api-key KEY --seed S` as a real command (built-in engine): every route
but /health needs the key (401 JSON otherwise; `VLLM_API_KEY` when no flag, as `vllm serve`),
the slots still register (they hold the admin token), and a sampled request that names no seed
gives the same tokens from a new server with the same --seed, while two identical requests to
one server differ (a GRPO group is not one sample repeated)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_helpers import serve_command, serving_process, write_model_folder

pytestmark = [pytest.mark.timeout(600)]

KEY = "sk-serve-test"
BODY: dict[str, Any] = {"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_folder(tmp_path_factory.mktemp("qwen3-seed"))


def _sampled(client: httpx.Client, headers: dict[str, str]) -> list[int]:
    response = client.post("/v1/completions", json=BODY, headers=headers)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def _two_samples(model_dir: Path, *flags: str, env_key: str | None = None) -> tuple[list[int], list[int]]:
    command = serve_command(model_dir, "--num-kv-blocks", "64", *flags)
    env = None if env_key is None else {**os.environ, "VLLM_API_KEY": env_key}
    with (
        serving_process(command, env=env) as (_process, ready),
        httpx.Client(base_url=ready["url"], timeout=300) as client,
    ):
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/health").status_code == 200  # open, as in vLLM
        for path in ("/v1/models", "/is_paused", "/metrics"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer nope"}).status_code == 401
            assert client.get(path, headers=auth).status_code == 200
        refused = client.post("/v1/completions", json=BODY)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        assert client.post("/update_weights", json={"weight_dir": str(model_dir)}).status_code == 401
        return _sampled(client, auth), _sampled(client, auth)


def test_api_key_and_seed_through_serve(model_dir: Path) -> None:
    first, second = _two_samples(model_dir, "--api-key", KEY, "--seed", "11")
    assert first != second  # identical requests to one server: two draws
    again = _two_samples(model_dir, "--seed", "11", env_key=KEY)  # the key from VLLM_API_KEY
    assert again == (first, second)  # a new server, the same seed: the same tokens
    other = _two_samples(model_dir, "--api-key", KEY, "--seed", "12")
    assert other != (first, second)
