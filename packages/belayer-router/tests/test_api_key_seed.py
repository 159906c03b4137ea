"""`RouterConfig.api_keys` (`serve --api-key`) and `RouterConfig.seed` (`serve --seed`), on both
servers, with a real worker process stand-in (`FakeWorker`: token ``i`` of a request is a pure
function of its seed and ``i``, as in the engines).

- API keys: every route but ``GET /health`` answers 401 with an OpenAI-shaped JSON error unless
  ``Authorization: Bearer <key>`` names one of the keys (or the admin token, which the slots'
  workers hold); the OpenAI client's ``api_key`` is that header.
- Seed: a request that names no seed gets one derived from the server seed, its body and how many
  identical bodies came before it, so the same requests to a router with the same seed give the
  same tokens, identical requests in one run differ, and another seed gives other tokens.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import httpx
import openai
import pytest
from router_helpers import ADMIN_TOKEN

from belayer_router import RouterClient, RouterClientError, RouterConfig, api_keys_from, running_router
from belayer_router._core._seeds import SeedSource
from belayer_router.testing import expected_tokens, running_worker

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers

KEY = "sk-belayer-test"
_COMPLETION = {"model": "belayer", "prompt": [1, 2, 3], "max_tokens": 6}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/completions", _COMPLETION),
        (
            "POST",
            "/v1/chat/completions",
            {"model": "belayer", "messages": [{"role": "user", "content": "x"}]},
        ),
        ("GET", "/v1/models", None),
        ("POST", "/generate", {"prompt_token_ids": [1, 2], "max_tokens": 4, "stream": False}),
        ("POST", "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"max_tokens": 4}}),
        ("POST", "/update_weights", {"weight_dir": "/nowhere"}),
        ("POST", "/pause", None),
        ("GET", "/is_paused", None),
        ("GET", "/metrics", None),
        ("GET", "/workers", None),
        ("POST", "/tokenize", {"prompt": "x"}),
    ],
)
async def test_every_route_but_health_needs_the_key(method: str, path: str, body: Any) -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, api_keys=[KEY, "second-key"], resume_wait_s=0.3)
    async with running_router(config) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"X-Api-Key": KEY}):
            response = await http.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (headers, response.text)
            error = response.json()["error"]
            assert error["type"] == "authentication_error"
            assert "Authorization: Bearer" in error["message"]
        assert (await http.get("/health")).status_code == 200  # open, as in vLLM
        for key in (KEY, "second-key"):  # any key passes the check (the route may still refuse)
            response = await http.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
            if path == "/workers":  # an admin route: an API key is not the admin token
                assert "admin call" in response.json()["error"]["message"]
            else:
                assert response.status_code != 401, response.text


async def test_clients_with_the_key_are_served_and_the_slots_admin_token_still_works() -> None:
    config = RouterConfig(admin_token=ADMIN_TOKEN, api_keys=[KEY])
    async with (
        running_worker(1) as (worker_url, _worker),
        running_router(config) as (url, _app),
        RouterClient(url, admin_token=ADMIN_TOKEN) as admin,  # the slots register with the admin token
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as client,
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="not-it", max_retries=0) as stranger,
    ):
        await admin.register("a", worker_url, 1)
        completion = await client.completions.create(model="belayer", prompt=[1, 2, 3], max_tokens=6, seed=5)
        assert completion.choices[0].text is not None
        assert (completion.usage and completion.usage.completion_tokens) == 6
        with pytest.raises(openai.AuthenticationError):
            await stranger.completions.create(model="belayer", prompt=[1, 2, 3], max_tokens=6)
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()


async def _tokens(url: str, body: dict[str, Any]) -> list[int]:
    async with httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/generate", json={**body, "stream": False})
        assert response.status_code == 200, response.text
        return list(response.json()["token_ids"])


async def _run(seed: int | None, bodies: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[int]]]:
    """One router with `seed`: the tokens of `bodies` by /generate, then by /v1/completions."""
    async with (
        running_worker(1) as (worker_url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN, seed=seed)) as (url, _app),
        RouterClient(url, admin_token=ADMIN_TOKEN) as admin,
        httpx.AsyncClient(base_url=url) as http,
    ):
        await admin.register("a", worker_url, 1)
        generated = [await _tokens(url, body) for body in bodies]
        completed = []
        for body in bodies:
            openai_body = {
                "model": "belayer",
                "prompt": body["prompt_token_ids"],
                "max_tokens": body["max_tokens"],
            }
            answer = await http.post("/v1/completions", json={**openai_body, "n": 2})
            assert answer.status_code == 200, answer.text
            completed += [list(c["token_ids"]) for c in answer.json()["choices"]]
        return generated, completed


async def test_the_same_seed_gives_the_same_tokens_and_identical_requests_still_differ() -> None:
    bodies = [
        {"prompt_token_ids": [1, 2, 3], "max_tokens": 8},
        {"prompt_token_ids": [1, 2, 3], "max_tokens": 8},  # the same request again: another draw
        {"prompt_token_ids": [4, 5], "max_tokens": 8},
    ]
    first = await _run(7, bodies)
    assert await _run(7, bodies) == first  # a new router with the same seed: the same tokens
    # In another order, each distinct request still gets its own tokens.
    generated, _ = await _run(7, [bodies[2], bodies[0], bodies[1]])
    assert generated == [first[0][2], first[0][0], first[0][1]]
    assert first[0][0] != first[0][1]  # a GRPO group of identical requests is not one sample
    assert first[1][0] != first[1][1]  # the n choices of one request differ
    other = await _run(8, bodies)
    assert other[0][0] != first[0][0]
    assert other[1] != first[1]
    unseeded = await _run(None, bodies)
    assert unseeded != await _run(None, bodies)  # no server seed: a random seed each
    # A request's own seed wins over the server's.
    async with (
        running_worker(1) as (worker_url, _worker),
        running_router(RouterConfig(admin_token=ADMIN_TOKEN, seed=7)) as (url, _app),
        RouterClient(url, admin_token=ADMIN_TOKEN) as admin,
    ):
        await admin.register("a", worker_url, 1)
        assert await _tokens(url, {**bodies[0], "seed": 42}) == expected_tokens(42, 8)


def test_seed_source_counts_identical_bodies_and_forgets_the_oldest() -> None:
    source = SeedSource(3, max_bodies=2)
    a, b, c = {"prompt": [1]}, {"prompt": [2]}, {"prompt": [3]}
    first_a, second_a = source.next(a), source.next(a)
    assert first_a != second_a
    assert source.next({**a, "request_id": "x", "stream": True}) not in (first_a, second_a)  # ids ignored
    assert 0 <= first_a < 2**63
    source.next(b)
    source.next(c)  # three bodies: the oldest (a) is forgotten and starts again at k = 0
    assert source.next(a) == first_a
    assert SeedSource(3).next(a) == first_a
    assert SeedSource(4).next(a) != first_a


def test_api_keys_and_seed_are_checked() -> None:
    with pytest.raises(ValueError, match="API key"):
        RouterConfig(api_keys=["has space"])
    with pytest.raises(ValueError, match="API key"):
        RouterConfig(api_keys=[""])
    with pytest.raises(ValueError, match="seed"):
        RouterConfig(seed=-1)
    assert RouterConfig(api_keys=["a", "b"]).api_keys == ("a", "b")


async def test_the_multiplexed_client_sends_its_token_on_the_client_link() -> None:
    """`RouterClient(multiplex=True)` (belayer-grpo's default) opens ``POST /client-link``; with
    API keys on, the link needs the key like every other route."""
    config = RouterConfig(admin_token=ADMIN_TOKEN, api_keys=[KEY])
    async with (
        running_worker(1) as (worker_url, _worker),
        running_router(config) as (url, _app),
        RouterClient(url, admin_token=ADMIN_TOKEN) as admin,
        RouterClient(url, admin_token=KEY, multiplex=True) as client,
        RouterClient(url, multiplex=True, reconnect_timeout_s=1.0) as stranger,
    ):
        await admin.register("a", worker_url, 1)
        completion = await client.generate([1, 2, 3], 6, seed=5)
        assert len(completion.token_ids) == 6
        with pytest.raises(RouterClientError) as refused:
            await stranger.generate([1, 2, 3], 6, seed=5)
        assert refused.value.status == 401


def test_the_flag_wins_over_vllm_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert api_keys_from(None) == ()
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys_from(None) == ("from-env",)
    assert api_keys_from([]) == ("from-env",)
    assert api_keys_from(["a", "b"]) == ("a", "b")


async def test_serve_takes_api_key_and_seed_as_vllm_serve_does() -> None:
    # `belayer-router serve --api-key K --seed 7`, a real process: 401 without the key, /health
    # open, the slots' admin token accepted, and unseeded requests draw from seed 7 (the tokens an
    # in-process router with seed 7 gives, not those of seed 8).
    body = {"prompt_token_ids": [1, 2, 3], "max_tokens": 8, "stream": False}
    argv = [sys.executable, "-m", "belayer_router", "serve", "--port", "0", "--json"]
    argv += ["--admin-token", ADMIN_TOKEN, "--api-key", KEY, "--seed", "7"]
    process = await anyio.open_process(argv)
    try:
        assert process.stdout is not None
        line = b""
        with anyio.fail_after(60):
            while not line.endswith(b"\n"):
                line += await process.stdout.receive(1)
        url = json.loads(line)["url"]
        async with (
            running_worker(1) as (worker_url, _worker),
            RouterClient(url, admin_token=ADMIN_TOKEN) as admin,
            httpx.AsyncClient(base_url=url) as http,
        ):
            await admin.register("a", worker_url, 1)
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/v1/models")).status_code == 401
            assert (await http.post("/generate", json=body)).status_code == 401
            keyed = await http.post("/generate", json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert keyed.status_code == 200, keyed.text
            served = list(keyed.json()["token_ids"])
    finally:
        process.kill()
        await process.wait()
    assert served == (await _run(7, [body]))[0][0]
    assert served != (await _run(8, [body]))[0][0]
