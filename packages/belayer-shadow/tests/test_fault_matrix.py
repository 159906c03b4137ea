"""The rows of the fault matrix (docs/architecture.md) that no other test covers: SIGKILL and SIGSTOP
of the shadow, the guardian and the slot supervisor itself.  Real processes, built-in engine."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
from handover_helpers import PROMPTS, TOKEN, Streams, generate_all, router, supervised

from belayer_router import RouterClient, RouterClientError, TokenEvent

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

MAX_TOKENS = 64


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


async def test_a_sigkilled_standby_shadow_is_replaced_and_nothing_else_moves(tmp_path: Path) -> None:
    async with router() as (url, app), supervised(url, tmp_path / "slot") as slot:
        reference = await generate_all(url, PROMPTS, MAX_TOKENS)
        assert slot.shadow is not None
        assert slot.main is not None
        old_shadow, main_pid = slot.shadow.pid, slot.main.pid
        streams = Streams(url, PROMPTS, MAX_TOKENS)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            os.kill(old_shadow, signal.SIGKILL)
        assert streams.tokens == reference
        with anyio.fail_after(120):
            while slot.shadow is None or slot.shadow.pid == old_shadow:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        await anyio.to_thread.run_sync(slot.wait_protected, 120.0)
        assert slot.main.pid == main_pid  # the main served on, untouched
        assert slot.num_handovers == 0
        assert app.registry.slots["s0"].max_epoch == 1
        slot.kill_main()  # the new shadow protects the slot
        assert await generate_all(url, PROMPTS, MAX_TOKENS) == reference
        await anyio.to_thread.run_sync(slot.wait_handovers, 1)


async def test_a_hung_standby_shadow_is_replaced_before_the_main_fails(tmp_path: Path) -> None:
    async with (
        router(resume_wait_s=120.0) as (url, app),
        supervised(url, tmp_path / "slot", standby_stale_s=2.0) as slot,
    ):
        reference = await generate_all(url, PROMPTS, MAX_TOKENS)
        assert slot.shadow is not None
        assert slot.main is not None
        hung, main_pid = slot.shadow.pid, slot.main.pid
        os.kill(hung, signal.SIGSTOP)
        try:
            with anyio.fail_after(120):
                while slot.shadow is None or slot.shadow.pid == hung:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            await anyio.to_thread.run_sync(slot.wait_protected, 120.0)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        assert _gone(hung)
        assert slot.main.pid == main_pid  # the main served on, untouched
        hung_events = [e for e in slot.events() if e["event"] == "shadow.hung"]
        assert [e["pid"] for e in hung_events] == [hung]
        assert hung_events[0]["age_s"] >= 2.0
        # The new shadow protects the slot: the main's failure is a plain handover, no restart.
        streams = Streams(url, PROMPTS, MAX_TOKENS)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            slot.kill_main()
        assert streams.tokens == reference
        await anyio.to_thread.run_sync(slot.wait_handovers, 1, 120.0)
        names = [e["event"] for e in slot.events()]
        assert "memory.restart" not in names
        assert "shadow.stuck" not in names
        assert app.registry.slots["s0"].max_epoch == 2
        assert app.registry.slots["s0"].healthy


async def test_a_hung_shadow_is_found_when_the_main_fails_and_the_slot_restarts(tmp_path: Path) -> None:
    # The fallback behind the standby check: a shadow that hangs after the last check and before
    # the main fails (here: a standby check too slow to see it first) leaves the flag unanswered.
    async with (
        router(resume_wait_s=120.0) as (url, app),
        supervised(url, tmp_path / "slot", handover_timeout_s=2.0, standby_stale_s=600.0) as slot,
    ):
        reference = await generate_all(url, PROMPTS, MAX_TOKENS)
        assert slot.shadow is not None
        hung = slot.shadow.pid
        os.kill(hung, signal.SIGSTOP)  # unnoticed while the main serves (it is only a standby)
        assert await generate_all(url, PROMPTS, MAX_TOKENS) == reference
        streams = Streams(url, PROMPTS, MAX_TOKENS)
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(streams.run)
                await streams.wait_tokens(4)
                slot.kill_main()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        assert streams.tokens == reference
        await anyio.to_thread.run_sync(slot.wait_handovers, 1, 120.0)
        await anyio.to_thread.run_sync(slot.wait_protected, 120.0)
        names = [e["event"] for e in slot.events()]
        assert "shadow.stuck" in names
        assert "memory.restart" in names
        assert _gone(hung)
        assert app.registry.slots["s0"].healthy
        assert await generate_all(url, PROMPTS, MAX_TOKENS) == reference


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
async def test_the_guardian_lost_or_hung_changes_nothing_for_clients_and_stop_leaves_nothing(
    tmp_path: Path, signum: int
) -> None:
    async with router() as (url, _app):
        async with supervised(url, tmp_path / "slot", standby_stale_s=2.0) as slot:
            guardian = slot._guardian
            assert guardian is not None
            old = guardian.popen.pid
            os.kill(old, signum)
            (tokens,) = await generate_all(url, PROMPTS[:1], 16)
            assert len(tokens) == 16
            with anyio.fail_after(60):
                while "guardian.started" not in [e["event"] for e in slot.events()]:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            names = [e["event"] for e in slot.events()]
            assert ("guardian.lost" if signum == signal.SIGKILL else "guardian.hung") in names
            assert slot._guardian is not None
            assert slot._guardian.popen.pid != old
            assert slot._guardian.popen.poll() is None
            assert _gone(old)
            pids = [p.pid for p in (slot.main, slot.shadow, slot.weights_server, slot.kv_server) if p]
            new_guardian = slot._guardian.popen.pid if slot._guardian is not None else old
        assert all(_gone(pid) for pid in [*pids, old, new_guardian])


# The owner of a slot as its own process (a trainer, `belayer-shadow slot`): prints the main's pid.
_OWNER = textwrap.dedent(
    """
    import json, sys, time
    from belayer_shadow import SlotConfig, SlotSupervisor
    config = SlotConfig(slot="owned", router_url=sys.argv[1], run_dir=sys.argv[2],
                        admin_token=sys.argv[3], num_kv_blocks=256, stale_s=1.0,
                        standby_stale_s=2.0)
    slot = SlotSupervisor(config)
    slot.start()
    slot.wait_protected()
    pids = {"main": slot.main.pid, "shadow": slot.shadow.pid, "weights": slot.weights_server.pid,
            "kv": slot.kv_server.pid, "guardian": slot._guardian.popen.pid}
    print(json.dumps(pids), flush=True)
    time.sleep(3600)
    """
)


@contextlib.asynccontextmanager
async def _owned_slot(url: str, run_dir: Path) -> AsyncIterator[tuple[anyio.abc.Process, dict[str, int]]]:
    owner = await anyio.open_process([sys.executable, "-c", _OWNER, url, str(run_dir), TOKEN])
    try:
        assert owner.stdout is not None
        line = b""
        with anyio.fail_after(180):
            while not line.endswith(b"\n"):
                line += await owner.stdout.receive()
        yield owner, json.loads(line)
    finally:
        with contextlib.suppress(ProcessLookupError):
            owner.send_signal(signal.SIGCONT)
        if owner.returncode is None:
            owner.kill()
        await owner.wait()


async def test_a_sigkilled_supervisor_takes_its_slot_down_and_clients_get_an_error_event_then_503(
    tmp_path: Path,
) -> None:
    prompt = PROMPTS[0]
    async with router(resume_wait_s=2.0) as (url, app), _owned_slot(url, tmp_path / "slot") as (owner, pids):
        events: list[object] = []

        async def stream(client: RouterClient) -> None:
            async for event in client.generate_stream(prompt, 4096, temperature=0.0, seed=0):
                events.append(event)
                if len(events) == 4:
                    owner.kill()  # SIGKILL: the workers die with it, the guardian reaps the rest

        async with RouterClient(url) as client:
            with pytest.raises(RouterClientError) as raised:
                await stream(client)
        assert sum(isinstance(e, TokenEvent) for e in events) >= 4
        assert raised.value.status == 503
        assert "no healthy worker" in raised.value.message
        with anyio.fail_after(60):
            while not (_gone(pids["main"]) and _gone(pids["shadow"])):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            body = {"model": "belayer", "prompt": prompt, "max_tokens": 4}
            response = await http.post("/v1/completions", json=body)
        assert response.status_code == 503
        assert "slot 'owned'" in response.json()["error"]["message"]
        assert app.registry.slots["owned"].healthy  # not the GPU's fault: a new supervisor may serve it


async def test_a_hung_supervisor_does_not_stop_a_handover(tmp_path: Path) -> None:
    async with router() as (url, app), _owned_slot(url, tmp_path / "slot") as (owner, pids):
        reference = await generate_all(url, PROMPTS, MAX_TOKENS)
        owner.send_signal(signal.SIGSTOP)  # the supervisor (and its reaper) no longer runs
        streams = Streams(url, PROMPTS, MAX_TOKENS)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            os.kill(pids["main"], signal.SIGKILL)  # no reaper: the heartbeat goes stale
        assert streams.tokens == reference
        assert app.registry.slots["owned"].max_epoch == 2  # the shadow took over by itself
        owner.send_signal(signal.SIGCONT)
        assert await generate_all(url, PROMPTS, MAX_TOKENS) == reference


async def test_a_hung_guardian_is_replaced_so_a_sigkilled_supervisor_still_leaves_nothing(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "slot"
    async with router() as (url, _app), _owned_slot(url, run_dir) as (owner, pids):
        os.kill(pids["guardian"], signal.SIGSTOP)
        try:
            with anyio.fail_after(60):
                while "guardian.started" not in _event_names(run_dir):  # noqa: ASYNC110
                    await anyio.sleep(0.05)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids["guardian"], signal.SIGCONT)
        assert "guardian.hung" in _event_names(run_dir)
        assert _gone(pids["guardian"])
        owner.kill()  # the new guardian reaps the memory servers (the workers die with the owner)
        await owner.wait()
        with anyio.fail_after(60):
            while not all(_gone(pid) for pid in pids.values()):  # noqa: ASYNC110
                await anyio.sleep(0.05)


def _event_names(run_dir: Path) -> list[str]:
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [json.loads(line)["event"] for line in lines if line.strip()]


async def test_a_kept_slot_whose_supervisor_is_sigkilled_comes_back_and_the_streams_finish_exactly(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "slot"
    argv = [sys.executable, "-m", "belayer_shadow", "slot", "--slot", "kept", "--run-dir", str(run_dir)]
    argv += ["--admin-token", TOKEN, "--num-kv-blocks", "256", "--json", "--keep-running"]
    async with router(resume_wait_s=120.0) as (url, app):
        keeper = await anyio.open_process([*argv, "--router", url])
        try:
            assert keeper.stdout is not None
            stdout = keeper.stdout
            buffer = b""

            async def report() -> dict[str, int]:
                nonlocal buffer
                with anyio.fail_after(240):
                    while b"\n" not in buffer:
                        buffer += await stdout.receive()
                line, buffer = buffer.split(b"\n", 1)
                document: dict[str, int] = json.loads(line)
                return document

            first = await report()
            reference = await generate_all(url, PROMPTS, MAX_TOKENS)
            streams = Streams(url, PROMPTS, MAX_TOKENS)
            async with anyio.create_task_group() as group:
                group.start_soon(streams.run)
                await streams.wait_tokens(4)
                os.kill(first["pid"], signal.SIGKILL)  # the supervisor; its workers die with it
                killed = time.monotonic()
            # In flight: each stream waited for the slot's new main and resumed there, exactly.
            assert streams.tokens == reference
            second = await report()
            print(f"kept slot: SIGKILL to the new supervisor serving {time.monotonic() - killed:.1f} s")
            assert second["pid"] != first["pid"]
            assert second["epoch"] > first["epoch"]
            assert app.registry.slots["kept"].healthy
            assert await generate_all(url, PROMPTS, MAX_TOKENS) == reference  # new requests
            keeper.send_signal(signal.SIGTERM)  # passed on: the supervisor stops its slot
            with anyio.fail_after(120):
                assert await keeper.wait() == 130
        finally:
            if keeper.returncode is None:
                keeper.kill()
                await keeper.wait()
    assert _gone(first["pid"])
    assert _gone(second["pid"])
    assert not (run_dir / "processes.json").exists()  # the last supervisor stopped everything
