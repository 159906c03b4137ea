"""The slot supervisor: an idle shadow's CPU, clean stop, dead memory, conventional recovery, bad input."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from handover_helpers import PROMPTS, Streams, generate_all, router, supervised

from belayer_shadow import SlotConfig

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


def _refused(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


async def test_idle_shadow_uses_about_no_cpu_and_stop_leaves_nothing(tmp_path: Path) -> None:
    async with router() as (url, _app):
        async with supervised(url, tmp_path / "slot") as slot:
            assert slot.shadow is not None
            assert slot.main is not None
            assert slot.weights_server is not None
            assert slot.kv_server is not None
            shadow_pid = slot.shadow.pid
            before = _cpu_seconds(shadow_pid)
            await anyio.sleep(3.0)
            used = _cpu_seconds(shadow_pid) - before
            # A 50 ms poll loop of two stat calls costs well under 1% of a core; allow 5%.
            assert used < 0.15, f"idle shadow used {used:.3f} s of CPU in 3 s"
            # Each worker checked its own weights against its mapping of the weight server: every
            # one a view (docs/architecture.md: weights live once, in the weight server).
            checks = {e["source"].split(":")[0]: e for e in slot.events() if e["event"] == "weights.private"}
            assert sorted(checks) == ["shadow", "worker"]
            assert [checks[role]["count"] for role in ("worker", "shadow")] == [0, 0], checks
            pids = [slot.main.pid, shadow_pid, slot.weights_server.pid, slot.kv_server.pid]
            main_url = slot.main_url
            sockets = [slot.weights_socket, slot.kv_socket]
            assert all(path.exists() for path in sockets)
        assert all(_gone(pid) for pid in pids)
        assert not any(path.exists() for path in sockets)
        assert not (tmp_path / "slot" / "mem").exists()
        assert main_url is not None
        assert _refused(main_url)
        assert "belayer-gpumem" not in Path("/proc/self/maps").read_text()  # noqa: ASYNC240
        for fd in os.listdir("/proc/self/fd"):
            try:
                assert "belayer-gpumem" not in os.readlink(f"/proc/self/fd/{fd}")
            except FileNotFoundError:
                continue


async def test_dead_memory_server_and_main_the_shadow_refuses_and_the_slot_restarts_from_scratch(
    tmp_path: Path,
) -> None:
    async with router() as (url, app), supervised(url, tmp_path / "slot") as slot:
        assert slot.kv_server is not None
        reference = await generate_all(url, PROMPTS[:1], 16)
        slot.kv_server.kill()
        slot.kill_main()
        # Whichever sees it first (the supervisor's check of its memory servers, or the shadow's
        # handover, which refuses to serve from lost memory): a restart from scratch, not a GPU
        # failure.
        await anyio.to_thread.run_sync(slot.wait_handovers, 1, 120.0)
        await anyio.to_thread.run_sync(slot.wait_protected, 120.0)
        names = [e["event"] for e in slot.events()]
        assert "memory.lost" in names
        assert "handover.register" not in names  # nobody served from the lost memory
        assert "slot.unhealthy" not in names
        assert slot.healthy
        assert app.registry.slots["s0"].healthy
        assert await generate_all(url, PROMPTS[:1], 16) == reference


async def test_conventional_recovery_restarts_and_regenerates(tmp_path: Path) -> None:
    options: dict[str, Any] = {"recovery": "conventional", "health_interval_s": 0.2, "health_misses": 2}
    async with router() as (url, _app), supervised(url, tmp_path / "slot", **options) as slot:
        assert slot.shadow is None
        reference = await generate_all(url, PROMPTS, 96)
        streams = Streams(url, PROMPTS, 96)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            slot.kill_main()
        assert streams.tokens == reference
        # The streams can end before the supervisor has counted the restart: wait for it.
        await anyio.to_thread.run_sync(slot.wait_handovers, 1)
        assert slot.num_handovers == 1
        events = [e["event"] for e in slot.events()]
        assert events.count("conventional.miss") >= 2
        for step in ("conventional.detect", "conventional.reallocate", "conventional.restart"):
            assert step in events
        assert slot.main_url is not None
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{slot.main_url}/metrics")).text
        regenerated = next(
            line for line in metrics.splitlines() if line.startswith("belayer_shadow_tokens_regenerated")
        )
        assert int(regenerated.split()[1]) >= 4 * len(PROMPTS)


async def test_restart_baseline_detects_at_once_and_resumes_without_regenerating(tmp_path: Path) -> None:
    async with router() as (url, _app), supervised(url, tmp_path / "slot", recovery="restart") as slot:
        assert slot.shadow is None
        reference = await generate_all(url, PROMPTS, 96)
        streams = Streams(url, PROMPTS, 96)
        async with anyio.create_task_group() as group:
            group.start_soon(streams.run)
            await streams.wait_tokens(4)
            slot.kill_main()
        assert streams.tokens == reference
        # The streams can end before the supervisor has counted the restart: wait for it.
        await anyio.to_thread.run_sync(slot.wait_handovers, 1)
        assert slot.num_handovers == 1
        events = [e["event"] for e in slot.events()]
        assert "conventional.miss" not in events  # detected by waitpid, not by health checks
        for step in ("restart.detect", "restart.reallocate", "restart.restart"):
            assert step in events
        assert slot.main_url is not None
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{slot.main_url}/metrics")).text
        regenerated = next(
            line for line in metrics.splitlines() if line.startswith("belayer_shadow_tokens_regenerated")
        )
        assert int(regenerated.split()[1]) == 0  # token-level resume: prompt + streamed tokens prefilled


def test_slot_config_rejects_bad_values(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="recovery"):
        SlotConfig(slot="s", router_url="http://x", run_dir=tmp_path, recovery="magic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="health_misses"):
        SlotConfig(slot="s", router_url="http://x", run_dir=tmp_path, health_misses=0)


def test_cpu_probe_sees_a_busy_process() -> None:
    # The CPU measurement itself must be able to fail: a busy loop shows up in it.
    # Spin until the probe shows 0.1 s more (on a loaded machine that takes longer than 0.1 s of
    # wall-clock time); a probe that never moves fails at the generous deadline.
    before = _cpu_seconds(os.getpid())
    deadline = time.monotonic() + 120
    while _cpu_seconds(os.getpid()) - before <= 0.1 and time.monotonic() < deadline:
        end = time.monotonic() + 0.05
        while time.monotonic() < end:
            pass
    assert _cpu_seconds(os.getpid()) - before > 0.1
