"""vLLM's token routes as SkyRL and verifiers call them (``/inference/v1/generate``, ``/tokenize``,
``/detokenize``) and sticky routing by ``X-Session-ID``: real routers on loopback (both HTTP
servers), `FakeWorker`s, the byte-level chat tokenizer folder."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from belayer_router import RouterClient, RouterConfig, load_tokenizer, running_router
from belayer_router.testing import expected_tokens, logprob_of, running_worker, write_chat_tokenizer

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]

TOKEN = "tok"


async def test_inference_generate_answers_token_ids_and_logprobs_in_vllms_shape() -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN)) as (url, _app),
        running_worker(1) as (w_url, _worker),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        await client.register("s", w_url, 1)
        params: dict[str, object] = {
            "max_tokens": 8,
            "seed": 3,
            "temperature": 1.0,
            "logprobs": 0,
            "skip_special_tokens": True,
        }
        answer = await http.post(
            "/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": params}
        )
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        assert choice["token_ids"] == expected_tokens(3, 8)
        assert choice["finish_reason"] == "length"
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == [
            logprob_of(t) for t in choice["token_ids"]
        ]
        plain = await http.post(
            "/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": {"seed": 3}}
        )
        assert plain.json()["choices"][0]["logprobs"] is None
        assert len(plain.json()["choices"][0]["token_ids"]) == 16  # vLLM's default max_tokens
        cases: list[tuple[dict[str, object], str]] = [
            ({"top_k": 5}, "top_k"),
            ({"n": 2}, "'n'"),
            ({"stop": ["x"]}, "stop"),
        ]
        for params, name in cases:
            refused = await http.post(
                "/inference/v1/generate", json={"token_ids": [5], "sampling_params": params}
            )
            assert refused.status_code == 400
            assert name in refused.json()["error"]["message"]
        missing = await http.post("/inference/v1/generate", json={"sampling_params": {}})
        assert missing.status_code == 400


async def test_a_session_stays_on_its_slot_and_moves_only_when_the_slot_is_out() -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN)) as (url, _app),
        running_worker(1) as (a_url, a),
        running_worker(1) as (b_url, _b),
        RouterClient(url, admin_token=TOKEN) as client,
        httpx.AsyncClient(base_url=url) as http,
    ):
        await client.register("a", a_url, 1)
        await client.register("b", b_url, 1)

        async def turn(session: str | None, rid: str) -> None:
            headers = {} if session is None else {"X-Session-ID": session}
            body = {"token_ids": [1], "sampling_params": {"max_tokens": 2, "seed": 1}, "request_id": rid}
            assert (await http.post("/inference/v1/generate", json=body, headers=headers)).status_code == 200

        def served_by(rid: str) -> str:
            return "a" if any(r["request_id"] == rid for r in a.requests) else "b"

        for i in range(6):
            await turn("traj-1", f"t{i}")
        first = served_by("t0")
        other = "b" if first == "a" else "a"
        # Sticky: without the session, least-loaded routing would have alternated the slots.
        assert {served_by(f"t{i}") for i in range(6)} == {first}
        for i in range(4):
            await turn(None, f"free{i}")
        assert {served_by(f"free{i}") for i in range(4)} == {other}  # no session: the less used slot
        await client.mark_unhealthy(first)  # its slot is out: the session moves, and stays moved
        for i in range(6, 10):
            await turn("traj-1", f"t{i}")
        assert {served_by(f"t{i}") for i in range(6, 10)} == {other}
        chat = {"model": "belayer", "prompt": [1, 2], "max_tokens": 2}
        completion = await http.post("/v1/completions", json=chat, headers={"X-Session-ID": "traj-1"})
        assert completion.status_code == 200


async def test_tokenize_and_detokenize_with_the_served_tokenizer(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(write_chat_tokenizer(tmp_path / "tok"))
    config = RouterConfig(tokenizer=tokenizer, max_prompt_tokens=1000)
    async with running_router(config) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        answer = (await http.post("/tokenize", json={"model": "belayer", "prompt": "hi"})).json()
        assert answer == {"count": 2, "max_model_len": 1000, "tokens": [104, 105], "token_strs": None}
        messages = {"messages": [{"role": "user", "content": "hi"}]}
        assert (await http.post("/tokenize", json=messages)).json()["tokens"][0] == 257  # <|im_start|>
        assert (await http.post("/detokenize", json={"tokens": [104, 105]})).json() == {"prompt": "hi"}
        assert (await http.post("/detokenize", json={"tokens": "hi"})).status_code == 400
    async with running_router(RouterConfig()) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/tokenize", json={"prompt": "hi"})).status_code == 400
