"""SkyRL's own `RemoteInferenceClient` (skyrl 0.4.0) driving a `belayer-shadow serve` service.

Run by tests/test_skyrl.py in a Python >= 3.12 interpreter of its own (skyrl 0.4.0 requires it;
the service runs in the project's 3.11 environment): ``python skyrl_driver.py URL MODEL
WEIGHT_DIR``. It prints one JSON document of what it saw; the test checks it. Every call to the
service here goes through SkyRL's client except two plain HTTP reads of the service's state
(`/metrics`, `/is_paused`) and the weight load by folder (`POST /update_weights {"weight_dir"}`,
prime-rl's route: skyrl 0.4.0 has no folder load of its own over HTTP).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from typing import Any

import aiohttp
from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

LONG_TOKENS = 800  # the request held across the pause: long enough to be cut mid-generation

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def main(url: str, model: str, weight_dir: str) -> dict[str, Any]:
    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name=model)
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as http:
        out["world_size"] = list(await client.get_world_size())
        prompt = (await client.tokenize(["Add 2 and 3."]))[0]
        out["prompt"] = prompt

        # Token in, token out: one request per prompt, each with its session header.
        batch = {
            "prompt_token_ids": [prompt, prompt],
            "sampling_params": {
                "max_tokens": 12,
                "temperature": 1.0,
                "seed": 7,
                "logprobs": 0,
                "ignore_eos": True,
            },
            "session_ids": ["episode-0", "episode-1"],
        }
        generated = await client.generate(batch)  # type: ignore[arg-type]
        out["generate"] = {key: generated[key] for key in ("responses", "response_ids", "response_logprobs")}
        out["generate"]["stop_reasons"] = generated["stop_reasons"]
        out["detokenized"] = await client.detokenize(generated["response_ids"])

        # Chat with tools: a tool call and its result go through the folder's chat template.
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3? Use the tool."}]
        first = await client.chat_completion(
            {
                "json": {
                    "model": model,
                    "messages": messages,
                    "tools": TOOLS,
                    "max_tokens": 16,
                    "session_id": "chat-0",
                }
            }
        )
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        }
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "5"},
        ]
        second = await client.chat_completion(
            {
                "json": {
                    "model": model,
                    "messages": messages,
                    "tools": TOOLS,
                    "max_tokens": 16,
                    "session_id": "chat-0",
                }
            }
        )
        out["chat"] = [first, second]

        # pause(keep) with a request in flight, a weight load while paused, resume: the request
        # goes on and completes as one answer.
        async with http.get(f"{url}/metrics") as answer:
            before = await answer.text()
        long_batch = {
            "prompt_token_ids": [prompt],
            "sampling_params": {
                "max_tokens": LONG_TOKENS,
                "temperature": 1.0,
                "logprobs": 0,
                "ignore_eos": True,
            },
            "session_ids": ["long-0"],
        }
        running = asyncio.create_task(client.generate(long_batch))  # type: ignore[arg-type]
        base_tokens = _metric(before, "belayer_router_tokens_total")
        for _ in range(6000):  # until it has generated some tokens (at most 60 s)
            async with http.get(f"{url}/metrics") as answer:
                if _metric(await answer.text(), "belayer_router_tokens_total") >= base_tokens + 16:
                    break
            await asyncio.sleep(0.01)
        out["pause"] = await client.pause(mode="keep")
        async with http.get(f"{url}/is_paused") as answer:
            out["is_paused"] = await answer.json()
        await asyncio.sleep(1.0)
        out["done_while_paused"] = running.done()
        async with http.post(f"{url}/update_weights", json={"weight_dir": weight_dir}) as answer:
            out["update"] = {"status": answer.status, "body": await answer.json()}
        out["resume"] = await client.resume()
        kept = await running
        out["kept"] = {
            "response_ids": kept["response_ids"][0],
            "response_logprobs": kept["response_logprobs"][0] if kept["response_logprobs"] else None,
            "stop_reason": kept["stop_reasons"][0],
        }
        async with http.get(f"{url}/metrics") as answer:
            out["metrics"] = await answer.text()
        # After the load: the same seeded request again, computed on the new weights.
        after = await client.generate(batch)  # type: ignore[arg-type]
        out["after_update"] = {"response_logprobs": after["response_logprobs"]}
    await client.teardown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
