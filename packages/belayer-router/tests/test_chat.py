"""The OpenAI surface harnesses use, with the real `openai` client and litellm against a router.

A real router (uvicorn on loopback) with a chat tokenizer folder written by
`belayer_router.testing.write_chat_tokenizer`, and a scripted `FakeWorker` behind it that answers
the decoded prompt: a tool call when asked for the weather, a sentence using the tool's result when
the prompt holds one, the seed when asked for a sample.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import litellm
import openai
import pytest

from belayer_router import (
    ChatTemplateTokenizer,
    ChatTokenizer,
    RouterClient,
    RouterConfig,
    load_tokenizer,
    running_router,
)
from belayer_router.testing import running_worker, text_script, write_chat_tokenizer

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("http_server")]  # on both servers

TOOLS: list[Any] = [  # the openai client's TypedDicts, as plain JSON
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
STORY = "Once upon a time. STOP and then more words that never reach the client."


def respond(prompt: str) -> str:
    """The scripted model: a pure function of the rendered prompt."""
    turn = prompt.rsplit("<|im_start|>", 2)[-2]  # the last message before the generation prompt
    if "<tool_response>" in turn:
        result = turn.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
        return f"It is {result} in Paris."
    if "weather" in turn:
        return (
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        )
    if "story" in turn:
        return STORY
    return "Hello from the scripted worker! Ünïcödé ✓"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplateTokenizer:
    loaded = load_tokenizer(write_chat_tokenizer(tmp_path_factory.mktemp("tok")))
    assert isinstance(loaded, ChatTemplateTokenizer)
    return loaded


def end_id(tokenizer: ChatTemplateTokenizer) -> int:
    return tokenizer.encode("<|im_end|>")[0]


@pytest.fixture
async def router(tokenizer: ChatTemplateTokenizer) -> AsyncIterator[str]:
    script = text_script(tokenizer, respond, end_id(tokenizer))
    config = RouterConfig(tokenizer=tokenizer, model_name="qwen3-test", max_body_bytes=64 * 1024)
    async with running_router(config) as (url, _app), running_worker(1, script=script) as (wurl, _w):
        async with RouterClient(url) as client:
            await client.register("s0", wurl, 1)
        yield url


def oai(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def user(text: str) -> list[Any]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


async def test_chat_renders_the_template_and_returns_exact_tokens(
    router: str, tokenizer: ChatTemplateTokenizer
) -> None:
    client = oai(router)
    reply = await client.chat.completions.create(
        model="qwen3-test", messages=user("hi"), max_tokens=200, logprobs=True
    )
    await client.close()
    expected = respond(tokenizer.decode(tokenizer.render_chat(user("hi"), None)))
    choice = reply.choices[0]
    assert choice.message.content == expected
    assert choice.finish_reason == "stop"
    assert choice.token_ids == [*tokenizer.encode(expected), end_id(tokenizer)]  # type: ignore[attr-defined]
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tokenizer.render_chat(user("hi"), None))
    assert reply.usage.completion_tokens == len(choice.token_ids)  # type: ignore[attr-defined]
    assert choice.logprobs is not None
    assert choice.logprobs.content is not None
    assert len(choice.logprobs.content) == len(choice.token_ids)  # type: ignore[attr-defined]
    assert reply.model == "qwen3-test"


async def test_a_chat_answer_carries_its_prompt_token_ids_at_the_top_where_verifiers_reads_them(
    router: str, tokenizer: ChatTemplateTokenizer
) -> None:
    # vLLM's `return_token_ids` answer; verifiers' chat client takes the prompt's ids from there
    # (`response.prompt_token_ids`) and gives the step no tokens without them.
    client = oai(router)
    reply = await client.chat.completions.create(model="m", messages=user("hi"), max_tokens=200, n=2)
    await client.close()
    rendered = list(tokenizer.render_chat(user("hi"), None))
    assert reply.model_extra is not None
    assert reply.model_extra["prompt_token_ids"] == rendered
    assert [c.prompt_token_ids for c in reply.choices] == [rendered, rendered]  # type: ignore[attr-defined]


async def test_streaming_chat_holds_nothing_back_that_it_later_takes_back(
    router: str, tokenizer: ChatTemplateTokenizer
) -> None:
    client = oai(router)
    stream = await client.chat.completions.create(
        model="m", messages=user("hi"), max_tokens=200, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the scripted worker! Ünïcödé ✓"
    assert "\ufffd" not in text
    token_ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]  # type: ignore[attr-defined]
    assert token_ids == [*tokenizer.encode(text), end_id(tokenizer)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(token_ids)


async def test_tool_calls_are_parsed_and_tool_results_rendered_back(router: str) -> None:
    client = oai(router)
    messages: list[Any] = user("What is the weather in Paris?")
    first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=300)
    call_message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert call_message.content == "Let me look."
    assert call_message.tool_calls is not None
    assert len(call_message.tool_calls) == 1
    call = call_message.tool_calls[0]
    assert call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    messages += [call_message.model_dump(exclude_none=True)]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=300)
    assert second.choices[0].message.content == "It is sunny, 21 C in Paris."
    assert second.choices[0].message.tool_calls is None

    stream = await client.chat.completions.create(
        model="m", messages=user("weather?"), tools=TOOLS, max_tokens=300, stream=True
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # the same content, whole or streamed
    assert "".join(d.content or "" for d in deltas) == call_message.content
    assert not any("<tool_call>" in (d.content or "") for d in deltas)
    streamed_calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert [tc.function.name for tc in streamed_calls if tc.function] == ["get_weather"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


async def test_tool_call_arguments_sent_back_as_json_text_render_as_an_object(tmp_path: Path) -> None:
    """Templates that apply ``tojson`` to the arguments (Llama 3's, many others) got the
    client's JSON text and encoded it a second time: the model saw a quoted string."""
    folder = write_chat_tokenizer(tmp_path)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    string_case = (
        "{% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}"
    )
    assert string_case in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(string_case, "{{ fn.arguments | tojson }}")
    config_path.write_text(json.dumps(config))
    tokenizer = load_tokenizer(folder)
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[Any] = [
        *user("weather?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    async with running_router(RouterConfig(tokenizer=tokenizer)) as (url, _), running_worker(1) as (wurl, _):
        async with RouterClient(url) as admin:
            await admin.register("s0", wurl, 1)
        client = oai(url)
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=2)
        bad = {**call, "function": {"name": "get_weather", "arguments": "{city: Paris"}}
        bad_messages: list[Any] = [*messages[:2], {**messages[2], "tool_calls": [bad]}]
        with pytest.raises(
            openai.BadRequestError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments"
        ):
            await client.chat.completions.create(model="m", messages=bad_messages, max_tokens=2)
        await client.close()
    prompt = tokenizer.decode(reply.choices[0].prompt_token_ids)  # type: ignore[attr-defined]
    assert '"arguments": {"city": "Paris"}}' in prompt
    assert '\\"city' not in prompt


class GatedTokenizer:
    """The chat tokenizer, except that encoding a large text waits (at most 20 s) for the test to
    open the gate: the test can only open it if the router's event loop is still serving."""

    def __init__(self, inner: ChatTemplateTokenizer) -> None:
        self.inner, self.entered, self.gate = inner, threading.Event(), threading.Event()
        self.end_token_ids = inner.end_token_ids
        self.decode, self.decode_reply = inner.decode, inner.decode_reply
        self.gate_opened_in_time: list[bool] = []

    def encode(self, text: str) -> list[int]:
        if len(text) > 100_000:
            self.entered.set()
            self.gate_opened_in_time.append(self.gate.wait(20))
        return self.inner.encode(text)

    def render_chat(self, messages: Any, tools: Any) -> list[int]:
        return self.encode(
            self.inner.inner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_a_huge_prompt_is_tokenized_off_the_event_loop(
    tokenizer: ChatTemplateTokenizer, endpoint: str
) -> None:
    gated = GatedTokenizer(tokenizer)
    assert isinstance(gated, ChatTokenizer)
    text = "word " * 50_000
    config = RouterConfig(tokenizer=gated, max_prompt_tokens=1000)
    async with running_router(config) as (url, _), httpx.AsyncClient(base_url=url, timeout=60) as http:
        responses: list[httpx.Response] = []

        async def post() -> None:
            if endpoint == "chat":
                body: dict[str, Any] = {"messages": [{"role": "user", "content": text}]}
                responses.append(await http.post("/v1/chat/completions", json=body))
            else:
                responses.append(await http.post("/v1/completions", json={"prompt": text}))

        async with anyio.create_task_group() as group:
            group.start_soon(post)
            await anyio.to_thread.run_sync(gated.entered.wait, 30)
            health = await http.get("/health")  # answered while the prompt is being encoded
            gated.gate.set()
    assert health.status_code == 200
    assert gated.gate_opened_in_time == [True]  # a blocked loop could not have opened it
    assert responses[0].status_code == 400
    assert "max_prompt_tokens" in responses[0].json()["error"]["message"]


async def test_n_choices_are_resumable_requests_with_derived_seeds(tokenizer: ChatTemplateTokenizer) -> None:
    def script(prompt: list[int], seed: int) -> list[int]:
        return [*tokenizer.encode(f"sample {seed % 100_000}"), end_id(tokenizer)]

    config = RouterConfig(tokenizer=tokenizer)
    async with running_router(config) as (url, _app), running_worker(1, script=script) as (wurl, _w):
        async with RouterClient(url) as admin:
            await admin.register("s0", wurl, 1)
        client = oai(url)
        kwargs: dict[str, Any] = {
            "model": "m",
            "messages": user("sample"),
            "max_tokens": 50,
            "n": 3,
            "seed": 11,
        }
        whole = await client.chat.completions.create(**kwargs)
        again = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(**kwargs, stream=True)
        chunks = [chunk async for chunk in stream]
        await client.close()
    texts = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert texts[0] == "sample 11"
    assert len(set(texts)) == 3  # three different seeds
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    streamed = {i: "" for i in range(3)}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts
    assert whole.usage is not None
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in whole.choices)  # type: ignore[attr-defined]


async def test_stop_strings_cut_the_text_and_stop_the_worker(
    router: str, tokenizer: ChatTemplateTokenizer
) -> None:
    client = oai(router)
    whole = await client.chat.completions.create(
        model="m", messages=user("story"), stop=["STOP"], max_tokens=300
    )
    stream = await client.chat.completions.create(
        model="m", messages=user("story"), stop="STOP", max_tokens=300, stream=True
    )
    chunks = [chunk async for chunk in stream]
    await client.close()
    choice = whole.choices[0]
    assert choice.message.content == "Once upon a time. "
    assert choice.finish_reason == "stop"
    assert choice.token_ids == tokenizer.encode("Once upon a time. STOP")  # type: ignore[attr-defined]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Once upon a time. "


async def test_litellm_chat_stream_and_tools(router: str) -> None:
    common: dict[str, Any] = {"model": "openai/qwen3-test", "api_base": f"{router}/v1", "api_key": "unused"}
    reply = await litellm.acompletion(messages=user("hi"), max_tokens=200, **common)
    assert reply.choices[0].message.content == "Hello from the scripted worker! Ünïcödé ✓"
    tools = await litellm.acompletion(messages=user("weather?"), tools=TOOLS, max_tokens=300, **common)
    call = tools.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    stream = await litellm.acompletion(
        messages=user("story"), stop=["STOP"], stream=True, max_tokens=300, **common
    )
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == "Once upon a time. "


async def test_completions_with_batched_prompts_and_n(tokenizer: ChatTemplateTokenizer) -> None:
    config = RouterConfig(tokenizer=tokenizer)
    async with running_router(config) as (url, _app), running_worker(1) as (wurl, _w):
        async with RouterClient(url) as admin:
            await admin.register("s0", wurl, 1)
        client = oai(url)
        batch = await client.completions.create(
            model="m", prompt=[[1, 2], [3, 4, 5]], max_tokens=4, n=2, seed=3
        )
        models = await client.models.list()
        await client.close()
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    ids = [c.token_ids for c in batch.choices]  # type: ignore[attr-defined]
    assert all(len(i) == 4 for i in ids)
    assert ids[0] == ids[2]
    assert ids[1] == ids[3]
    assert ids[0] != ids[1]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == 5
    assert batch.usage.completion_tokens == 16
    assert [m.id for m in models.data] == ["belayer"]


MALFORMED: list[tuple[str, dict[str, Any], int, str]] = [
    ("chat", {"model": "m"}, 400, "'messages'"),
    ("chat", {"messages": []}, 400, "'messages'"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "'role'"),
    ("chat", {"messages": [{"role": "user"}]}, 400, "needs 'content'"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text parts"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 400, "content must be"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{}]}]}, 400, "function.name"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, 400, "tools[0]"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "'n'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 1000}, 400, "max_choices"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "'max_tokens'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "'temperature'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "'stop'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "'stream'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400, "'logprobs'"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 5}, 400, "top_logprobs"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "seed": -4}, 400, "'seed'"),
    ("chat", {"messages": [{"role": "user", "content": "x" * 70_000}]}, 413, "limit of 65536 bytes"),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "tools": ["x"]}, 400, "tools[0]"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**64},
        400,
        "'max_completion_tokens' must be at most 2147483647",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [2**64]},
        400,
        "'stop_token_ids' must hold token ids of at most 4294967295",
    ),
    ("completions", {"prompt": [1], "max_tokens": 2**64}, 400, "'max_tokens' must be at most"),
    ("completions", {"prompt": [1, 2**64]}, 400, "'prompt' holds a token id over 4294967295"),
    ("completions", {"prompt": [1, -2]}, 400, "'prompt'"),
    ("completions", {"prompt": [[1], "x", {}]}, 400, "'prompt'"),
    ("completions", {"prompt": []}, 400, "empty"),
    ("completions", {"prompt": [[]]}, 400, "empty"),
    ("completions", {"prompt": [1], "echo": True}, 400, "'echo'"),
    ("completions", {"prompt": list(range(3000))}, 400, "max_prompt_tokens"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "message"), MALFORMED)
async def test_every_malformed_request_is_a_clear_4xx(
    tokenizer: ChatTemplateTokenizer, endpoint: str, body: dict[str, Any], status: int, message: str
) -> None:
    config = RouterConfig(
        tokenizer=tokenizer, max_body_bytes=64 * 1024, max_prompt_tokens=2048, max_choices=16
    )
    async with running_router(config) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        response = await http.post(path, json={"model": "m", **body})
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]


async def test_chat_without_a_chat_template_and_invalid_json_are_400s(tmp_path: Path) -> None:
    async with running_router(RouterConfig()) as (url, _app), httpx.AsyncClient(base_url=url) as http:
        no_template = await http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        bad_json = await http.post("/v1/chat/completions", content=b"{not json")
    assert no_template.status_code == 400
    assert "--tokenizer DIR" in no_template.json()["error"]["message"]
    assert bad_json.status_code == 400


async def test_a_chat_stream_survives_a_worker_killed_mid_response(tokenizer: ChatTemplateTokenizer) -> None:
    script = text_script(tokenizer, respond, end_id(tokenizer))
    config = RouterConfig(tokenizer=tokenizer, resume_wait_s=30.0)
    async with (
        running_router(config) as (url, _app),
        running_worker(1, script=script, die_after=9, token_delay_s=0.002) as (url_a, worker_a),
        running_worker(2, script=script) as (url_b, _worker_b),
    ):
        async with RouterClient(url) as admin:
            await admin.register("s0", url_a, 1)
        client = oai(url)

        async def replace_the_dead_worker() -> None:
            await worker_a.died.wait()
            async with RouterClient(url) as admin:
                await admin.register("s0", url_b, 2)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(replace_the_dead_worker)
                stream = await client.chat.completions.create(
                    model="m", messages=user("hi"), max_tokens=200, stream=True
                )
                chunks = [chunk async for chunk in stream]
        await client.close()
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello from the scripted worker! Ünïcödé ✓"
    token_ids = [t for c in chunks for ch in c.choices for t in ch.token_ids]  # type: ignore[attr-defined]
    assert token_ids == [*tokenizer.encode(text), end_id(tokenizer)]  # nothing lost, nothing repeated
    last = [ch for c in chunks for ch in c.choices][-1]
    assert last.num_resumes >= 1  # type: ignore[attr-defined]
