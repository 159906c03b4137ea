"""A lost memory server (weights or KV; SIGKILLed or hung) is no GPU failure: the slot restarts from
scratch (new memory servers, the current weights reloaded, a new main and shadow), the
interrupted streams finish token-exact through the router, and it serves again; only a second
failure within the window takes the slot out.  Real processes, built-in engine."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import anyio
import httpx
import pytest
from handover_helpers import PROMPTS, Streams, generate_all, router, supervised

from belayer_shadow import SlotSupervisor

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _server_pid(slot: SlotSupervisor, kind: str) -> int:
    server = slot.weights_server if kind == "weights" else slot.kv_server
    assert server is not None
    return server.pid


async def _restarted(slot: SlotSupervisor, count: int = 1) -> None:
    """Until `count` restarts completed and a new shadow stands by."""
    await anyio.to_thread.run_sync(slot.wait_handovers, count, 120.0)
    await anyio.to_thread.run_sync(slot.wait_protected, 120.0)


@pytest.mark.parametrize("kind", ["weights", "kv"])
async def test_a_sigkilled_memory_server_mid_stream_restarts_the_slot_and_the_streams_finish_exactly(
    tmp_path: Path, kind: str
) -> None:
    async with router(resume_wait_s=120.0) as (url, app), supervised(url, tmp_path / "slot") as slot:
        reference = await generate_all(url, PROMPTS, 96)
        old_pid, old_main = _server_pid(slot, kind), slot.main
        streams = Streams(url, PROMPTS, 96)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            os.kill(old_pid, signal.SIGKILL)
        assert streams.tokens == reference  # resumed from the tokens streamed so far, exactly
        assert all(indices == list(range(96)) for indices in streams.indices)
        await _restarted(slot)
        assert slot.healthy
        assert app.registry.slots["s0"].healthy
        assert _server_pid(slot, kind) != old_pid
        assert slot.main is not old_main
        events = slot.events()
        lost = next(e for e in events if e["event"] == "memory.lost")
        assert "exited" in lost["cause"] or "gone" in lost["cause"]
        names = [e["event"] for e in events]
        assert "memory.reallocate" in names
        assert "slot.unhealthy" not in names
        assert await generate_all(url, PROMPTS, 96) == reference  # a second, failure-free round


async def test_the_last_kept_weights_are_reloaded_after_the_weight_server_is_lost(tmp_path: Path) -> None:
    from belayer_shadow import ModelConfig, fill_weight_server, init_weights, save_safetensors

    pushed = tmp_path / "step-1"
    pushed.mkdir()
    new_weights = init_weights(ModelConfig.default(), 1)
    save_safetensors(new_weights, pushed / "model.safetensors")
    async with router(resume_wait_s=120.0) as (url, _app), supervised(url, tmp_path / "slot") as slot:
        (initial,) = await generate_all(url, PROMPTS[:1], 32)
        await anyio.to_thread.run_sync(fill_weight_server, slot.weights_socket, new_weights)
        await anyio.to_thread.run_sync(slot.keep_weights, pushed)
        (served,) = await generate_all(url, PROMPTS[:1], 32)
        assert served != initial
        (pushed / "model.safetensors").unlink()  # the trainer's folder may go: the slot kept a copy
        os.kill(_server_pid(slot, "weights"), signal.SIGKILL)
        await _restarted(slot)
        assert await generate_all(url, PROMPTS[:1], 32) == [served]
        assert slot.checkpoint == tmp_path / "slot" / "kept-weights"


async def test_a_supervisor_started_again_adopts_the_newer_copy_when_its_predecessor_died_between_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from belayer_shadow import SlotConfig

    config = SlotConfig(slot="kept", router_url="http://127.0.0.1:9", run_dir=tmp_path / "slot")
    first = SlotSupervisor(config)
    for version in (1, 2):
        (tmp_path / f"step-{version}").mkdir()
        (tmp_path / f"step-{version}" / "model.safetensors").write_bytes(bytes([version]) * 64)
    first.keep_weights(tmp_path / "step-1", version=1)
    rename = Path.rename

    def dies_at_the_second_rename(self: Path, target: Path) -> Path:
        if self.name == "kept-weights.new" and Path(target).name == "kept-weights":
            raise KeyboardInterrupt("SIGKILLed between the renames")  # nothing after this runs
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", dies_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        first.keep_weights(tmp_path / "step-2", version=2)  # committed to the server as version 2
    monkeypatch.setattr(Path, "rename", rename)
    assert not (tmp_path / "slot" / "kept-weights").exists()

    again = SlotSupervisor(config)
    assert again.adopt_kept_weights() == 2
    assert again.checkpoint == tmp_path / "slot" / "kept-weights"
    assert (again.checkpoint / "model.safetensors").read_bytes() == bytes([2]) * 64


@pytest.mark.parametrize("kind", ["weights", "kv"])
async def test_a_hung_memory_server_is_found_by_its_pings_and_the_slot_restarts(
    tmp_path: Path, kind: str
) -> None:
    async with (
        router(resume_wait_s=120.0) as (url, app),
        supervised(url, tmp_path / "slot", memory_check_s=0.5, memory_misses=3) as slot,
    ):
        reference = await generate_all(url, PROMPTS, 48)
        hung = _server_pid(slot, kind)
        os.kill(hung, signal.SIGSTOP)
        try:
            await _restarted(slot)
        finally:
            with contextlib.suppress(ProcessLookupError):  # SIGKILLed by the supervisor: gone
                os.kill(hung, signal.SIGCONT)
        events = slot.events()
        assert sum(e["event"] == "memory.miss" for e in events) >= 3
        lost = next(e for e in events if e["event"] == "memory.lost")
        assert "not answering" in lost["cause"]
        assert _server_pid(slot, kind) != hung
        assert app.registry.slots["s0"].healthy
        assert await generate_all(url, PROMPTS, 48) == reference


async def test_a_second_memory_loss_within_the_window_takes_the_slot_out_with_a_503_that_says_so(
    tmp_path: Path,
) -> None:
    async with router(resume_wait_s=1.0) as (url, app), supervised(url, tmp_path / "slot") as slot:
        os.kill(_server_pid(slot, "weights"), signal.SIGKILL)
        await _restarted(slot)
        assert slot.healthy
        started = time.time()
        os.kill(_server_pid(slot, "kv"), signal.SIGKILL)  # within the 60 s window
        with anyio.fail_after(60):
            while app.registry.slots["s0"].healthy:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert not slot.healthy
        assert "slot.second_failure" in [e["event"] for e in slot.events()]
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"model": "belayer", "prompt": PROMPTS[0], "max_tokens": 4}
            response = await client.post("/v1/completions", json=body)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        message = response.json()["error"]["message"]
        assert "slot 's0' is unhealthy since" in message
        unhealthy_since = app.registry.slots["s0"].unhealthy_since
        assert unhealthy_since is not None
        assert started <= unhealthy_since
