"""mini-swe-agent, unmodified, against the router, in a belayer-envckpt sandbox, through failures.

The agent is mini-swe-agent's `DefaultAgent` with its `LitellmModel` (tool calls through litellm
and the router's ``/v1/chat/completions``) and belayer-envckpt's `SandboxEnvironment` (a busybox
sandbox, real Docker and CRIU).  Behind the router a scripted `FakeWorker` writes valid actions
(a CPU model cannot).  The faulty run kills the sandbox while the agent waits for its third
response (restored from its checkpoint and brought back to the agent's context) and kills the
worker mid-response (the router resumes on the replacement); it must end exactly like the
failure-free run: same messages, same submission, every action's effect exactly once.

It lives in belayer-grpo's tests because it needs both belayer-router and belayer-envckpt (and
mini-swe-agent, a test extra here), which only belayer-grpo depends on together.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini-swe-agent's banner
# litellm would fetch its model price map from the internet at import; use the copy it ships.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from minisweagent.agents.default import DefaultAgent
from minisweagent.models.litellm_model import LitellmModel

from belayer_envckpt import CheckpointStore, Engine, Sandbox, SandboxConfig
from belayer_envckpt.harness import SandboxEnvironment
from belayer_router import ChatTemplateTokenizer, RouterClient, RouterConfig, load_tokenizer, running_router
from belayer_router.testing import FakeWorker, running_worker, text_script, write_chat_tokenizer

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # uvicorn serves on asyncio only


COMMANDS = [
    "printf '3 4\\n10 20\\n' > input.txt; echo step1 >> log.txt",
    "while read a b; do echo $((a + b)); done < input.txt > sums.txt; echo step2 >> log.txt",
    "cat sums.txt; echo step3 >> log.txt",
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat sums.txt log.txt",
]
SUBMISSION = "7\n30\nstep1\nstep2\nstep3\n"


def respond(prompt: str) -> str:
    """The scripted policy: the next command, by the number of tool results so far."""
    turn = prompt.count("<tool_response>")
    command = COMMANDS[min(turn, len(COMMANDS) - 1)]
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"Step {turn + 1}: running the next command.\n<tool_call>\n{call}\n</tool_call>"


def comparable(messages: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The conversation without timings, costs, ids and raw responses."""
    out = []
    for message in messages:
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        out.append((message["role"], message.get("content"), calls))
    return out


def run_agent(url: str, env: SandboxEnvironment) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    model = LitellmModel(
        model_name="openai/belayer",
        model_kwargs={"api_base": f"{url}/v1", "api_key": "unused", "max_tokens": 400, "seed": 5},
        cost_tracking="ignore_errors",
    )
    agent = DefaultAgent(
        model,
        # mini-swe-agent's Environment protocol declares `config` settable; SandboxEnvironment
        # computes it from its working directory and timeout (a read-only property)
        env,  # type: ignore[arg-type]
        system_template="You are a shell agent. Use the bash tool.",
        instance_template="Task: {{task}}",
        step_limit=12,
        cost_limit=0,
    )
    result = agent.run("add the numbers on each line of input.txt and submit the sums")
    return result, agent.messages


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplateTokenizer:
    loaded = load_tokenizer(write_chat_tokenizer(tmp_path_factory.mktemp("tok")))
    assert isinstance(loaded, ChatTemplateTokenizer)
    return loaded


async def one_run(tokenizer: ChatTemplateTokenizer, store_dir: Path, *, faulty: bool) -> dict[str, Any]:
    end = tokenizer.encode("<|im_end|>")[0]
    script = text_script(tokenizer, respond, end)
    engine = Engine.connect()
    sandbox = Sandbox.create(
        engine,
        SandboxConfig(
            image="belayer/busybox:latest", working_dir="/work", labels={"belayer.test": "router-e2e"}
        ),
        trajectory="swe",
    )
    env = SandboxEnvironment(
        sandbox, CheckpointStore(store_dir), "swe", decide=lambda step: step.step_index % 2 == 0
    )
    killed_sandbox = False

    def respond_and_fail(prompt: list[int], seed: int) -> Sequence[int]:
        nonlocal killed_sandbox
        if faulty and not killed_sandbox and tokenizer.decode(prompt).count("<tool_response>") == 3:
            env.sandbox.kill()  # the sandbox dies while the agent waits for its next response
            killed_sandbox = True
        return script(prompt, seed)

    options: dict[str, Any] = {"script": respond_and_fail}
    first: dict[str, Any] = {**options, "die_after_total": 150} if faulty else options
    try:
        async with (
            running_router(RouterConfig(tokenizer=tokenizer, resume_wait_s=60.0)) as (url, app),
            running_worker(1, **first) as (url_a, worker_a),
            running_worker(2, **options) as (url_b, worker_b),
        ):
            async with RouterClient(url) as admin:
                await admin.register("s0", url_a, 1)

            async def replace(dead: FakeWorker) -> None:
                await dead.died.wait()
                async with RouterClient(url) as admin:
                    await admin.register("s0", url_b, 2)

            with anyio.fail_after(300):
                async with anyio.create_task_group() as group:
                    group.start_soon(replace, worker_a)
                    result, messages = await anyio.to_thread.run_sync(run_agent, url, env)
                    group.cancel_scope.cancel()
            return {
                "result": result,
                "messages": comparable(messages),
                "worker_died": worker_a.died.is_set(),
                "worker_b_requests": len(worker_b.requests),
                "router_resumes": app.metrics.num_resumes,
                "restores": env.state.num_restores,
                "replayed": env.state.num_replayed,
                "checkpoints": env.state.num_checkpoints,
            }
    finally:
        env.cleanup()
        engine.close()


async def test_mini_swe_agent_survives_a_sandbox_and_a_worker_failure(
    tokenizer: ChatTemplateTokenizer, tmp_path: Path
) -> None:
    clean = await one_run(tokenizer, tmp_path / "clean", faulty=False)
    assert clean["result"]["exit_status"] == "Submitted"
    assert clean["result"]["submission"] == SUBMISSION
    assert clean["restores"] == 0
    assert not clean["worker_died"]

    faulty = await one_run(tokenizer, tmp_path / "faulty", faulty=True)
    assert faulty["worker_died"]  # the worker died mid-response ...
    assert faulty["router_resumes"] >= 1  # ... and the router resumed the response on the replacement
    assert faulty["worker_b_requests"] >= 1
    assert faulty["restores"] == 1  # the sandbox was restored from its checkpoint (after action 2)
    assert faulty["replayed"] == 1  # and action 3, which the agent had seen, re-run on it
    assert faulty["result"] == clean["result"]
    assert faulty["messages"] == clean["messages"]  # the agent's whole conversation is the same
