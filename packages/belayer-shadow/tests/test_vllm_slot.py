"""A slot on vLLM: a real vLLM main worker and shadow, a real router, SIGKILL mid-generation.

`nox -s tests_vllm`; skipped where vLLM is not installed (the normal shadow session).
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

pytest.importorskip("vllm")

from vllm_helpers import TOKEN, builtin_greedy, gone, running_slot, vllm_slot_config

from belayer_router import RouterClient, RouterConfig, TokenEvent, running_router

pytestmark = pytest.mark.anyio

NUM_REQUESTS, MAX_TOKENS = 16, 32
PROMPTS = [[(13 * i + 7 * j) % 256 for j in range(4 + i % 5)] for i in range(NUM_REQUESTS)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_sigkill_of_the_vllm_main_mid_generation_shadow_resumes_every_request_exactly(
    tmp_path: Path,
) -> None:
    async with (
        running_router(RouterConfig(admin_token=TOKEN, resume_wait_s=120.0)) as (url, app),
        running_slot(vllm_slot_config(url, tmp_path / "slot", max_num_seqs=NUM_REQUESTS)) as slot,
    ):
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        indices: list[list[int]] = [[] for _ in PROMPTS]
        resumes = [0 for _ in PROMPTS]
        async with RouterClient(url) as client:

            async def one(i: int) -> None:
                stream = client.generate_stream(PROMPTS[i], MAX_TOKENS, temperature=0.0, seed=i)
                async for event in stream:
                    if isinstance(event, TokenEvent):
                        tokens[i].append(event.token_id)
                        indices[i].append(event.index)
                    else:
                        resumes[i] = event.num_resumes

            old_main = slot.main
            assert old_main is not None
            async with anyio.create_task_group() as group:
                for i in range(NUM_REQUESTS):
                    group.start_soon(one, i)
                with anyio.fail_after(300):
                    while min(len(t) for t in tokens) < 4:  # noqa: ASYNC110 (no event to wait on)
                        await anyio.sleep(0.005)
                assert max(len(t) for t in tokens) < MAX_TOKENS  # really mid-generation
                slot.kill_main(signal.SIGKILL)
        assert tokens == builtin_greedy(PROMPTS, MAX_TOKENS)
        for got in indices:
            assert got == list(range(MAX_TOKENS))  # nothing lost, nothing repeated
        assert all(r >= 1 for r in resumes)
        assert app.metrics.num_tokens_regenerated == 0
        await anyio.to_thread.run_sync(slot.wait_handovers, 1)
        events = [e["event"] for e in slot.events()]
        for step in ("handover.detect", "handover.health_check", "handover.flush", "handover.register"):
            assert step in events
        # Every vLLM worker checked its parameters against its mapping of the weight server: no
        # private copy of a weight in the main, nor in the shadow (merged projections included).
        checks = [e for e in slot.events() if e["event"] == "weights.private"]
        assert {e["source"].split(":")[0] for e in checks} >= {"worker", "shadow"}
        assert [e["count"] for e in checks] == [0] * len(checks), checks
        # Nothing of the old worker is left: vLLM ran inside it (no engine-core process).
        assert gone(old_main.pid)
        assert app.registry.slots["s0"].max_epoch == 2
