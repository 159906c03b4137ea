"""The HTTP API: validation, admin authentication, metrics, contexts, OpenAI compatibility."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from belayer_router import ByteTokenizer, RouterClient, RouterClientError, RouterConfig, running_router
from belayer_router.testing import expected_tokens, running_worker, wait_until

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers

TOKEN = "s3cret"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 4}, "'prompt_token_ids' is required"),
        ({"prompt_token_ids": [1], "max_tokens": 0}, "'max_tokens' must be in [1, "),
        ({"prompt_token_ids": "hi", "max_tokens": 4}, "'prompt_token_ids' must be a list"),
        ({"prompt_token_ids": [1, -2], "max_tokens": 4}, "non-negative token ids"),
        ({"prompt_token_ids": [1], "max_tokens": 4, "top_p": 0}, "'top_p' must be in (0.0, 1.0]"),
        ({"prompt_token_ids": [1], "max_tokens": 4, "temperature": "hot"}, "'temperature' must be a finite"),
        ({"prompt_token_ids": [1], "max_tokens": 4, "turn": 1}, "'trajectory_id' and 'turn'"),
        ([1, 2], "must be a JSON object"),
        ({"prompt_token_ids": [1, 2**64], "max_tokens": 4}, "token ids of at most 4294967295"),
        ({"prompt_token_ids": [1], "max_tokens": 2**64}, "'max_tokens' must be in [1, 2147483647]"),
        ({"prompt_token_ids": [1], "max_tokens": 4, "stop_token_ids": [2**32]}, "'stop_token_ids' must"),
    ],
)
async def test_malformed_generate_requests_get_400_with_a_clear_message(body: object, message: str) -> None:
    async with running_router() as (url, _), httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/generate", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "path", ["/generate", "/v1/completions", "/v1/chat/completions", "/workers/register"]
)
async def test_deeply_nested_json_is_a_400_not_a_recursion_error(path: str) -> None:
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    async with running_router() as (url, _), httpx.AsyncClient(base_url=url) as http:
        response = await http.post(path, content=body)
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["error"]["message"]


async def test_invalid_json_unknown_route_and_no_worker() -> None:
    async with (
        running_router(RouterConfig(resume_wait_s=0.05)) as (url, _),
        httpx.AsyncClient(base_url=url) as http,
    ):
        bad_json = await http.post("/generate", content=b"{nope")
        unknown = await http.get("/nowhere")
        no_worker = await http.post("/generate", json={"prompt_token_ids": [1], "max_tokens": 2})
    assert bad_json.status_code == 400
    assert "not valid JSON" in bad_json.json()["error"]["message"]
    assert unknown.status_code == 404
    assert no_worker.status_code == 503
    assert "no healthy worker" in no_worker.json()["error"]["message"]


async def test_admin_calls_need_the_bearer_token() -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN)) as (url, _),
        httpx.AsyncClient(base_url=url) as http,
    ):
        calls = [
            ("POST", "/workers/register", {"slot": "s0", "url": "http://127.0.0.1:1", "epoch": 1}),
            ("POST", "/workers/unregister", {"slot": "s0", "epoch": 1}),
            ("POST", "/slots/s0/unhealthy", None),
            ("GET", "/workers", None),
        ]
        for method, path, body in calls:
            response = await http.request(method, path, json=body)
            assert response.status_code == 401, path
            assert "Authorization: Bearer" in response.json()["error"]["message"]
        wrong = await http.get("/workers", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        async with RouterClient(url, admin_token=TOKEN) as admin:
            await admin.register("s0", "http://127.0.0.1:1", 1)
            assert [s["epoch"] for s in await admin.workers()] == [1]


@pytest.mark.parametrize("path", ["/workers/register", "/workers/unregister"])
async def test_registration_without_a_slot_name_is_refused(path: str) -> None:
    async with running_router() as (url, app), httpx.AsyncClient(base_url=url) as http:
        response = await http.post(path, json={"url": "http://127.0.0.1:1", "epoch": 1})
        assert response.status_code == 400
        assert "'slot'" in response.json()["error"]["message"]
        assert app.registry.slots == {}


async def test_admin_numbers_and_context_token_ids_out_of_range_are_400s_and_not_journaled() -> None:
    async with running_router() as (url, app), httpx.AsyncClient(base_url=url) as http:
        calls = [
            ("/workers/register", {"slot": "s0", "url": "http://127.0.0.1:1", "epoch": 2**64}, "'epoch'"),
            ("/workers/unregister", {"slot": "s0", "epoch": 2**63}, "'epoch'"),
            ("/slots/s0/weights", {"version": 2**64}, "'version'"),
            ("/weights/required", {"version": -1}, "'version'"),
            ("/contexts/t/0", {"token_ids": [1, 2**32]}, "'token_ids'"),
        ]
        for path, body, field in calls:
            response = await http.post(path, content=json.dumps(body))
            assert response.status_code == 400, path
            assert field in response.json()["error"]["message"]
        assert app.registry.slots == {}
        assert (await http.get("/contexts/t")).status_code == 404
        # The largest values are taken: an epoch of 2^63 - 1 registers.
        ok = {"slot": "s0", "url": "http://127.0.0.1:1", "epoch": 2**63 - 1}
        assert (await http.post("/workers/register", json=ok)).status_code == 200


async def test_epoch_fencing_on_registration() -> None:
    async with running_router() as (url, _), RouterClient(url) as client:
        await client.register("s0", "http://127.0.0.1:1", 2)
        await client.register("s0", "http://127.0.0.1:1", 2)  # idempotent
        with pytest.raises(RouterClientError) as stale:
            await client.register("s0", "http://127.0.0.1:2", 1)
        assert stale.value.status == 409
        assert "epoch >= 3" in stale.value.message
        with pytest.raises(RouterClientError) as old:
            await client.unregister("s0", 1)
        assert old.value.status == 409
        await client.unregister("s0", 2)
        with pytest.raises(RouterClientError):
            await client.register("s0", "http://127.0.0.1:1", 2)  # a zombie may not come back
        await client.register("s0", "http://127.0.0.1:3", 3)
        with pytest.raises(RouterClientError) as bad:
            await client.register("bad/slot", "http://127.0.0.1:3", 1)
        assert bad.value.status == 400


async def test_health_metrics_and_context_log() -> None:
    async with running_router() as (url, _), running_worker(1) as (wurl, _), RouterClient(url) as client:
        await client.register("s0", wurl, 1)
        assert (await client.health())["num_active_workers"] == 1
        await client.generate([1, 2], 6, seed=1, trajectory_id="traj", turn=0)
        await client.put_context("traj", 1, [1, 2, 3])
        assert await client.get_context("traj", 0) == (0, [1, 2, *expected_tokens(1, 6)])
        assert await client.get_context("traj") == (1, [1, 2, 3])
        # What a turn adds after its response goes alone: the router owns L_turn.
        await client.generate([1, 2, 5], 4, seed=2, trajectory_id="traj", turn=2)
        assert await client.append_context("traj", 2, [60, 61]) == 3 + 4 + 2
        assert await client.get_context("traj", 2) == (2, [1, 2, 5, *expected_tokens(2, 4), 60, 61])
        with pytest.raises(RouterClientError) as nothing:
            await client.append_context("traj", 3, [1])  # no generation recorded L_3
        assert nothing.value.status == 404
        await client.drop_trajectory("traj")
        with pytest.raises(RouterClientError) as missing:
            await client.get_context("traj")
        assert missing.value.status == 404
        text = await client.metrics()
    for line in (
        "belayer_router_requests_total 2",
        "belayer_router_tokens_total 10",
        "belayer_router_resumes_total 0",
        "belayer_router_handovers_total 0",
        "belayer_router_tokens_regenerated_total 0",
        "belayer_router_requests_waiting 0",
        'belayer_router_slot_outstanding{slot="s0"} 0',
    ):
        assert line in text.splitlines()


async def test_non_streaming_generate_and_request_id_reuse() -> None:
    async with (
        running_router() as (url, _),
        running_worker(1) as (wurl, _),
        httpx.AsyncClient(base_url=url) as http,
    ):
        async with RouterClient(url) as client:
            await client.register("s0", wurl, 1)
        body = {"prompt_token_ids": [3], "max_tokens": 5, "seed": 9, "stream": False, "request_id": "x"}
        first = (await http.post("/generate", json=body)).json()
        again = (await http.post("/generate", json=body)).json()  # finished: replayed from the journal
        conflict = await http.post("/generate", json={**body, "prompt_token_ids": [4]})
    assert first["token_ids"] == again["token_ids"] == expected_tokens(9, 5)
    assert first["finish_reason"] == "length"
    assert len(first["logprobs"]) == 5
    assert conflict.status_code == 409


async def test_a_client_that_leaves_a_non_streamed_request_cancels_it_and_can_retry_it() -> None:
    """A harness timing out on a whole (non-streamed) answer: the router stops the request at the
    disconnect (it kept generating, and a retry with the same request id got 409 until it ended);
    the retry resumes it exactly."""
    async with (
        running_router(RouterConfig(tokenizer=ByteTokenizer())) as (url, app),
        running_worker(1, token_delay_s=0.01) as (wurl, _),
    ):
        async with RouterClient(url) as client:
            await client.register("s0", wurl, 1)
        impatient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=0.3)
        request: dict[str, Any] = {"model": "m", "prompt": [1], "max_tokens": 300, "seed": 5}
        with pytest.raises(openai.APITimeoutError):
            await impatient.completions.create(**request, extra_body={"request_id": "job-7"})
        await impatient.close()
        await wait_until(lambda: app.metrics.num_in_flight == 0, 1.5)  # not ~3 s later
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        retry = await oai.completions.create(**request, extra_body={"request_id": "job-7"})
        await oai.close()
        body = {"prompt_token_ids": [1], "max_tokens": 300, "seed": 6, "stream": False, "request_id": "g"}
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as http:
            with pytest.raises(httpx.TimeoutException):
                await http.post("/generate", json=body)
        await wait_until(lambda: app.metrics.num_in_flight == 0, 1.5)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            again = (await http.post("/generate", json=body)).json()
    assert retry.choices[0].token_ids == expected_tokens(5, 300)  # type: ignore[attr-defined]
    assert retry.choices[0].num_resumes == 1  # type: ignore[attr-defined]
    assert (again["token_ids"], again["num_resumes"]) == (expected_tokens(6, 300), 1)


async def test_openai_client_completions_with_token_ids_and_text() -> None:
    config = RouterConfig(tokenizer=ByteTokenizer())
    async with running_router(config) as (url, _), running_worker(1) as (wurl, _):
        async with RouterClient(url) as client:
            await client.register("s0", wurl, 1)
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        whole = await oai.completions.create(model="m", prompt=[1, 2, 3], max_tokens=7, seed=4, logprobs=1)
        chunks = [
            c
            async for c in await oai.completions.create(
                model="m",
                prompt="hi",
                max_tokens=7,
                seed=4,
                stream=True,
                stream_options={"include_usage": True},
            )
        ]
        with pytest.raises(openai.BadRequestError):
            await oai.completions.create(model="m", prompt=[1], max_tokens=2, best_of=2)
        await oai.close()
    expected = expected_tokens(4, 7)
    choice = whole.choices[0]
    assert choice.token_ids == expected  # type: ignore[attr-defined]
    assert choice.finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 7
    assert choice.text == ByteTokenizer().decode(expected)
    assert choice.logprobs is not None
    assert len(choice.logprobs.token_logprobs or []) == 7
    streamed = [t for c in chunks for choice in c.choices for t in choice.token_ids or []]  # type: ignore[attr-defined]
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == 2


async def test_openai_client_retrieves_the_served_model() -> None:
    async with running_router(RouterConfig(model_name="Qwen/Qwen3-8B")) as (url, _):
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = await oai.models.retrieve("Qwen/Qwen3-8B")
        with pytest.raises(openai.NotFoundError, match="--model-name"):
            await oai.models.retrieve("gpt-4")
        await oai.close()
    assert (model.id, model.object, model.owned_by) == ("Qwen/Qwen3-8B", "model", "belayer")


async def test_openai_text_prompt_without_tokenizer_is_refused() -> None:
    async with running_router() as (url, _), httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/v1/completions", json={"model": "m", "prompt": "hello"})
    assert response.status_code == 400
    assert "--tokenizer" in response.json()["error"]["message"]
