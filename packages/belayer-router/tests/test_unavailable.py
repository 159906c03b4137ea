"""While no worker can serve, the router answers as OpenAI's API does when it is overloaded: a 503
with a JSON error naming the reason (each slot: unhealthy since when, restarting since when) and
a ``Retry-After``; a stream already running ends with an error event, never a silent stop; and
no route answers a bare 500 (an unexpected exception is a logged JSON 500).  On both servers."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import anyio
import httpx
import openai
import pytest
from router_helpers import ADMIN_TOKEN

from belayer_router import RouterClient, RouterConfig, running_router
from belayer_router.testing import expected_tokens, running_worker

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers

_STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(\d+\.\d s ago\)"


def _config(resume_wait_s: float = 0.3) -> RouterConfig:
    return RouterConfig(admin_token=ADMIN_TOKEN, resume_wait_s=resume_wait_s)


def _completion(stream: bool, **extra: Any) -> dict[str, Any]:
    return {"model": "belayer", "prompt": [1, 2], "max_tokens": 8, "stream": stream, **extra}


def _assert_503(response: httpx.Response, reason: str) -> dict[str, Any]:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == "1"  # ceil(resume_wait_s)
    error = response.json()["error"]
    assert error["type"] == "service_unavailable_error"
    assert error["code"] == "no_healthy_worker"
    assert error["status"] == 503
    assert re.search(reason, error["message"]), error["message"]
    return dict(error)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", _completion(False)),
        ("/v1/completions", _completion(True)),
        ("/v1/chat/completions", {"model": "belayer", "messages": [{"role": "user", "content": "x"}]}),
        ("/generate", {"prompt_token_ids": [1, 2], "max_tokens": 8, "stream": False}),
        ("/generate", {"prompt_token_ids": [1, 2], "max_tokens": 8, "stream": True}),
    ],
    ids=["completions", "completions-stream", "chat-no-tokenizer", "generate", "generate-stream"],
)
async def test_no_slot_at_all_is_a_503_that_says_so(path: str, body: dict[str, Any]) -> None:
    async with running_router(_config()) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        response = await http.post(path, json=body)
    if path == "/v1/chat/completions":  # refused before any worker is needed: a 400, as JSON
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"
        return
    _assert_503(response, r"no slot has registered a worker")


async def test_an_unhealthy_slot_and_a_restarting_slot_are_named_with_since_when() -> None:
    async with (
        running_worker(1) as (url_a, _),
        running_worker(1) as (url_b, _),
        running_router(_config()) as (url, _app),
        RouterClient(url, admin_token=ADMIN_TOKEN) as admin,
        httpx.AsyncClient(base_url=url) as http,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        await admin.register("a", url_a, 1)
        await admin.register("b", url_b, 1)
        assert (await http.post("/v1/completions", json=_completion(False))).status_code == 200
        await admin.mark_unhealthy("a")
        await admin.unregister("b", 1)
        response = await http.post("/v1/completions", json=_completion(False))
        error = _assert_503(response, rf"slot 'a' is unhealthy since {_STAMP}")
        assert re.search(rf"slot 'b' is restarting: no worker since {_STAMP}", error["message"])
        slots = {s["slot"]: s for s in await admin.workers()}
        assert isinstance(slots["a"]["unhealthy_since"], float)
        assert slots["a"]["vacant_since"] is None
        assert isinstance(slots["b"]["vacant_since"], float)
        assert slots["b"]["unhealthy_since"] is None
        # The openai client reads the same answer as an error of its own kind (after its retries,
        # which Retry-After spaces; none here).
        with pytest.raises(openai.InternalServerError) as raised:
            await client.completions.create(model="belayer", prompt=[1, 2], max_tokens=8)
        assert raised.value.status_code == 503
        assert "restarting" in str(raised.value)
        # A worker registered again: served at once, the slot no longer vacant.
        async with running_worker(2) as (url_b2, _):
            await admin.register("b", url_b2, 2)
            done = await client.completions.create(model="belayer", prompt=[1, 2], max_tokens=8)
            assert done.choices[0].finish_reason == "length"
            assert {s["slot"]: s for s in await admin.workers()}["b"]["vacant_since"] is None


async def test_a_request_waiting_for_a_restart_is_served_when_the_worker_comes_back() -> None:
    async with (
        running_worker(1, die_after=3, token_delay_s=0.01) as (url_a, worker),
        running_worker(2) as (url_a2, _),
        running_router(_config(resume_wait_s=30)) as (url, _app),
        RouterClient(url, admin_token=ADMIN_TOKEN) as admin,
    ):
        await admin.register("a", url_a, 1)
        tokens: list[int] = []

        async def run() -> None:
            async for event in admin.generate_stream([1, 2], 12, seed=5):
                tokens.extend(getattr(event, "token_ids", ()) or [getattr(event, "token_id", -1)])

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            with anyio.fail_after(30):
                await worker.died.wait()
            await anyio.sleep(0.3)  # the request waits on the empty slot meanwhile
            await admin.register("a", url_a2, 2)
        assert [t for t in tokens if t != -1] == expected_tokens(5, 12)


@pytest.mark.parametrize("api", ["openai", "generate"])
async def test_a_stream_whose_slot_never_comes_back_ends_with_an_error_event(api: str) -> None:
    async with (
        running_worker(1, die_after=3, token_delay_s=0.01) as (url_a, _),
        running_router(_config()) as (url, _app),
        RouterClient(url, admin_token=ADMIN_TOKEN) as admin,
        httpx.AsyncClient(base_url=url, timeout=60) as http,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        await admin.register("a", url_a, 1)
        if api == "openai":
            stream = await client.completions.create(
                model="belayer", prompt=[1, 2], max_tokens=20, stream=True
            )
            chunks: list[Any] = []

            async def read() -> None:
                async for chunk in stream:
                    chunks.append(chunk)

            with pytest.raises(openai.APIError) as raised:
                await read()
            assert chunks  # it had streamed before the error
            assert "no healthy worker" in raised.value.message
            assert "its worker's stream broke at" in raised.value.message
            return
        body = {"prompt_token_ids": [1, 2], "max_tokens": 20, "stream": True}
        async with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            lines = [json.loads(line) async for line in response.aiter_lines() if line]
        assert [e["type"] for e in lines[:3]] == ["token"] * 3
        assert lines[-1]["type"] == "error"
        assert lines[-1]["status"] == 503
        assert "no healthy worker" in lines[-1]["message"]


class FakeBrokenTokenizer:
    """A tokenizer with a bug: the router's own code path must still answer JSON."""

    def encode(self, text: str) -> list[int]:
        raise RuntimeError("tokenizer bug")

    def decode(self, token_ids: list[int]) -> str:
        return ""


async def test_an_unexpected_exception_is_a_logged_json_500_not_a_bare_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = RouterConfig(tokenizer=FakeBrokenTokenizer())
    with caplog.at_level(logging.ERROR, logger="belayer_router"):
        async with running_router(config) as (url, _app), httpx.AsyncClient(base_url=url) as http:
            response = await http.post("/v1/completions", json={**_completion(False), "prompt": "hi"})
            assert (await http.get("/health")).status_code == 200  # the router still serves
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "internal_router")
    assert "RuntimeError: tokenizer bug" in error["message"]
    assert any("POST /v1/completions failed" in r.getMessage() and r.exc_info for r in caplog.records)
