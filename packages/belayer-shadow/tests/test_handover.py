"""Failover with real processes: SIGKILL and SIGSTOP of the main worker under concurrent requests."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import anyio
import pytest
from handover_helpers import PROMPTS, Streams, generate_all, router, supervised

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]
MAX_TOKENS = 160


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


async def test_sigkill_mid_generation_shadow_resumes_every_request_exactly(tmp_path: Path) -> None:
    async with router() as (url, app), supervised(url, tmp_path / "slot") as slot:
        reference = await generate_all(url, PROMPTS, MAX_TOKENS)
        first_main = slot.main
        assert first_main is not None
        streams = Streams(url, PROMPTS, MAX_TOKENS)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            slot.kill_main(signal.SIGKILL)
        assert streams.tokens == reference
        for indices in streams.indices:
            assert indices == list(range(MAX_TOKENS))  # nothing lost, nothing repeated
        assert all(f is not None and f.num_resumes >= 1 for f in streams.finishes)
        assert app.metrics.num_tokens_regenerated == 0
        await anyio.to_thread.run_sync(slot.wait_handovers, 1)
        events = [e["event"] for e in slot.events()]
        for step in ("handover.flag", "handover.detect", "handover.health_check", "handover.flush"):
            assert step in events
        for step in ("handover.remap", "handover.register", "handover.complete"):
            assert step in events
        detect = next(e for e in slot.events() if e["event"] == "handover.detect")
        assert detect["trigger"] == "flag"
        assert slot.main is not first_main
        assert app.registry.slots["s0"].max_epoch == 2
        # A fresh shadow protects the slot again.
        await anyio.to_thread.run_sync(slot.wait_protected)
        assert slot.shadow is not None
        assert slot.shadow.alive()


async def test_stale_main_is_fenced_and_never_reaches_a_client(tmp_path: Path) -> None:
    async with router() as (url, app), supervised(url, tmp_path / "slot") as slot:
        reference = await generate_all(url, PROMPTS, MAX_TOKENS)
        assert slot.main is not None
        stale_pid = slot.main.pid
        streams = Streams(url, PROMPTS, MAX_TOKENS)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            slot.kill_main(signal.SIGSTOP)  # a hang: nobody reaps it, the heartbeat goes stale
            await anyio.to_thread.run_sync(slot.wait_handovers, 1)
            with contextlib.suppress(ProcessLookupError):
                os.kill(stale_pid, signal.SIGCONT)
        assert streams.tokens == reference
        for indices in streams.indices:
            assert indices == list(range(MAX_TOKENS))
        detect = next(e for e in slot.events() if e["event"] == "handover.detect")
        assert detect["trigger"] == "stale_heartbeat"
        fenced = next(e for e in slot.events() if e["event"] == "handover.fenced")
        assert fenced["detail"] == f"killed main {stale_pid}"
        assert _gone(stale_pid)
        assert app.registry.slots["s0"].max_epoch == 2


async def test_second_failure_in_window_marks_slot_unhealthy_and_requests_move(tmp_path: Path) -> None:
    async with (
        router() as (url, app),
        supervised(url, tmp_path / "a", "a") as slot_a,
        supervised(url, tmp_path / "b", "b", recovery="conventional") as slot_b,
    ):
        reference = await generate_all(url, PROMPTS, MAX_TOKENS)
        slot_a.kill_main()
        await anyio.to_thread.run_sync(slot_a.wait_handovers, 1)
        assert slot_a.healthy
        streams = Streams(url, PROMPTS, MAX_TOKENS)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            slot_a.kill_main()  # second failure within the window
        assert streams.tokens == reference
        assert not slot_a.healthy
        assert not app.registry.slots["a"].healthy
        assert app.registry.slots["b"].healthy
        assert "slot.second_failure" in [e["event"] for e in slot_a.events()]
        assert slot_b.num_handovers == 0


async def test_weights_pushed_to_the_slot_are_served_before_and_after_a_handover(tmp_path: Path) -> None:
    from belayer_shadow import (
        LLMEngine,
        ModelConfig,
        SamplingParams,
        allocate_kv_arena,
        fill_weight_server,
        init_weights,
    )

    config = ModelConfig.default()
    new_weights = init_weights(config, 1)
    engine = LLMEngine(config, new_weights, allocate_kv_arena(config, 64, 16))
    engine.add_request("ref", PROMPTS[0], SamplingParams(max_tokens=32, temperature=0.0))
    expected: list[int] = []
    while engine.has_unfinished():
        expected += [out.token_id for out in engine.step()]
    async with router() as (url, _app), supervised(url, tmp_path / "slot") as slot:
        (before,) = await generate_all(url, PROMPTS[:1], 32)
        assert before != expected  # the slot starts on the seed-0 init
        version = await anyio.to_thread.run_sync(fill_weight_server, slot.weights_socket, new_weights)
        assert version == 2
        (after,) = await generate_all(url, PROMPTS[:1], 32)
        assert after == expected
        slot.kill_main()
        (handed_over,) = await generate_all(url, PROMPTS[:1], 32)
        assert handed_over == expected
        await anyio.to_thread.run_sync(slot.wait_handovers, 1)
