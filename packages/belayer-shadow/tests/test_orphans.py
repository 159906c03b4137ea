"""Nothing orphaned: a SIGKILLed supervisor leaves no process; a new one reaps an earlier run's leftovers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anyio
import pytest
from handover_helpers import PROMPTS, TOKEN, generate_all, router, supervised
from serve_helpers import processes_mentioning, wait_until_gone

from belayer_shadow import SlotConfig, SlotSupervisor, SupervisorError, reap_stale_processes
from belayer_shadow._workers._processes import process_start_time

pytestmark = [pytest.mark.timeout(300)]

# The owner of a slot, as a trainer would be: starts it from a short-lived thread (as
# anyio.to_thread does), reports its children, then waits to be killed.
_OWNER = textwrap.dedent(
    """
    import json, sys, threading, time
    from belayer_shadow import SlotConfig, SlotSupervisor
    config = SlotConfig(slot="orphans", router_url=sys.argv[1], run_dir=sys.argv[2],
                        admin_token=sys.argv[3], num_kv_blocks=64)
    slot = SlotSupervisor(config)
    starter = threading.Thread(target=lambda: (slot.start(), slot.wait_protected()))
    starter.start()
    starter.join()
    pids = [slot.main.pid, slot.shadow.pid, slot.weights_server.pid, slot.kv_server.pid]
    print(json.dumps(pids), flush=True)
    time.sleep(3600)
    """
)


# The owner of a slot held inside the start of its memory servers until the test SIGKILLs it:
# while it fills the new weight server, or once the KV server is ready (both up, as a restart from
# scratch has them). A hook in the owner only; nothing reaches a router (no worker starts).
_OWNER_IN_MEMORY_START = textwrap.dedent(
    """
    import sys, threading, time
    import belayer_gpumem._process as process
    import belayer_shadow._workers._slot as slot_module
    from belayer_shadow import SlotConfig, SlotSupervisor

    def hold(*args, **kwargs):
        print("held", flush=True)
        time.sleep(3600)

    if sys.argv[3] == "weights-fill":
        slot_module.fill_weight_server = hold
    else:
        wait_ready = process._wait_ready
        def ready_then_hold(popen, argv, *rest):
            info = wait_ready(popen, argv, *rest)
            if "kv" in argv:
                hold()
            return info
        process._wait_ready = ready_then_hold
    config = SlotConfig(slot="window", router_url=sys.argv[1], run_dir=sys.argv[2], num_kv_blocks=64)
    starter = threading.Thread(target=SlotSupervisor(config).start)  # as anyio.to_thread would
    starter.start()
    starter.join()
    """
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _alive(pid: int, start: int | None) -> bool:
    """Still the same process and not a zombie (a zombie holds nothing but its pid)."""
    if start is None or process_start_time(pid) != start:
        return False
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:4]
    except FileNotFoundError:
        return False


async def _wait_gone(pids: dict[int, int | None], timeout_s: float) -> list[int]:
    with anyio.move_on_after(timeout_s):
        while any(_alive(pid, start) for pid, start in pids.items()):  # noqa: ASYNC110
            await anyio.sleep(0.05)
    return [pid for pid, start in pids.items() if _alive(pid, start)]


@pytest.mark.anyio
async def test_sigkilled_owner_leaves_no_process_of_its_slot(tmp_path: Path) -> None:
    run_dir = tmp_path / "slot"
    async with router() as (url, _app):
        owner = await anyio.open_process([sys.executable, "-c", _OWNER, url, str(run_dir), TOKEN])
        try:
            assert owner.stdout is not None
            with anyio.fail_after(180):
                line = b""
                while not line.endswith(b"\n"):
                    line += await owner.stdout.receive()
            children = json.loads(line)
            recorded = json.loads((run_dir / "processes.json").read_text())["processes"]
            assert {p["pid"] for p in recorded} >= set(children)  # + the guardian
            pids = {p["pid"]: process_start_time(p["pid"]) for p in recorded}
            assert all(start is not None for start in pids.values())
            owner.send_signal(signal.SIGKILL)
            await owner.wait()
            left = await _wait_gone(pids, 60.0)
            assert left == [], f"left behind: {left}"
        finally:
            if owner.returncode is None:
                owner.kill()
                await owner.wait()
        # Workers died with the owner; the guardian reaped the memory servers, sockets included.
        assert not any((run_dir / "mem").glob("*.sock"))
        # A new supervisor in the same run folder starts cleanly.
        async with supervised(url, run_dir, "orphans", protected=False) as slot:
            (tokens,) = await generate_all(url, PROMPTS[:1], 8)
            assert len(tokens) == 8
            assert slot.main is not None
            assert slot.main.pid not in pids


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], start_new_session=True)


def _record(run_dir: Path, entries: list[dict[str, object]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "processes.json").write_text(json.dumps({"supervisor": 1, "processes": entries}))


def test_reap_kills_recorded_leftovers_but_never_a_recycled_pid(tmp_path: Path) -> None:
    leftover, stranger = _sleeper(), _sleeper()
    try:
        start = process_start_time(leftover.pid)
        other = process_start_time(stranger.pid)
        assert start is not None
        assert other is not None
        _record(
            tmp_path,
            [
                {"pid": leftover.pid, "start_time": start, "role": "main", "group": True},
                # Same pid as recorded, another start time: the kernel gave the pid to someone else.
                {"pid": stranger.pid, "start_time": other - 1, "role": "shadow", "group": True},
            ],
        )
        assert reap_stale_processes(tmp_path) == [leftover.pid]
        assert leftover.wait(timeout=60) == -signal.SIGKILL
        assert stranger.poll() is None
        assert not (tmp_path / "processes.json").exists()
        assert reap_stale_processes(tmp_path) == []  # nothing recorded: nothing to do
    finally:
        for process in (leftover, stranger):
            process.kill()
            process.wait()


def test_reap_refuses_a_run_folder_whose_supervisor_still_runs(tmp_path: Path) -> None:
    owner, child = _sleeper(), _sleeper()
    try:
        entry = {"pid": child.pid, "start_time": process_start_time(child.pid), "role": "main", "group": True}
        supervisor = {"pid": owner.pid, "start_time": process_start_time(owner.pid)}
        (tmp_path / "processes.json").write_text(json.dumps({"supervisor": supervisor, "processes": [entry]}))
        with pytest.raises(SupervisorError, match=f"running supervisor \\(pid {owner.pid}\\)"):
            reap_stale_processes(tmp_path)
        assert child.poll() is None
        owner.kill()
        owner.wait()
        assert reap_stale_processes(tmp_path) == [child.pid]  # its owner is gone: a leftover now
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        for process in (owner, child):
            process.kill()
            process.wait()


def test_new_supervisor_reaps_an_earlier_run_and_survives_its_starting_thread(tmp_path: Path) -> None:
    leftover = _sleeper()
    try:
        start = process_start_time(leftover.pid)
        _record(tmp_path, [{"pid": leftover.pid, "start_time": start, "role": "kv-server", "group": False}])
        # No router needed to reap; the slot then fails to register (nothing listens on port 9).
        config = SlotConfig(slot="r", router_url="http://127.0.0.1:9", run_dir=tmp_path, start_timeout_s=60)
        slot = SlotSupervisor(config)
        with pytest.raises(SupervisorError, match="worker"):
            slot.start()
        assert leftover.wait(timeout=60) == -signal.SIGKILL
        events = [e for e in slot.events() if e["event"] == "stale.reaped"]
        assert events
        assert events[0]["pids"] == [leftover.pid]
        assert not (tmp_path / "processes.json").exists()  # start() failed and stopped cleanly
    finally:
        leftover.kill()
        leftover.wait()


@pytest.mark.anyio
async def test_workers_outlive_the_thread_that_started_the_supervisor(tmp_path: Path) -> None:
    # PR_SET_PDEATHSIG fires when the *forking thread* ends: children must be forked by the
    # supervisor's own long-lived thread, not by the short-lived caller of start().
    async with router() as (url, _app):
        config = SlotConfig(slot="t", router_url=url, run_dir=tmp_path, admin_token=TOKEN, num_kv_blocks=64)
        slot = SlotSupervisor(config)

        def start() -> None:
            slot.start()
            slot.wait_protected()

        starter = threading.Thread(target=start)
        starter.start()
        await anyio.to_thread.run_sync(starter.join)
        try:
            assert slot.main is not None
            assert slot.shadow is not None
            main, shadow = slot.main.pid, slot.shadow.pid
            (tokens,) = await generate_all(url, PROMPTS[:1], 16)
            assert len(tokens) == 16
            assert slot.num_handovers == 0
            assert slot.main.pid == main
            assert slot.main.alive()
            assert slot.shadow is not None
            assert slot.shadow.pid == shadow
            assert slot.shadow.alive()
        finally:
            await anyio.to_thread.run_sync(slot.stop)


@pytest.mark.parametrize("window", ["weights-fill", "kv-ready"])
def test_a_supervisor_killed_while_it_starts_its_memory_servers_leaves_none(
    tmp_path: Path, window: str
) -> None:
    # Before belayer-shadow 0.4.4 the servers were recorded only once both were up and filled, and
    # had no death signal: a SIGKILL in this window (a `serve` killed during a restart from
    # scratch) left both running, orphaned.
    run_dir = tmp_path / "slot"
    command = [sys.executable, "-c", _OWNER_IN_MEMORY_START, "http://127.0.0.1:9", str(run_dir), window]
    owner = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        assert owner.stdout.readline() == "held\n"
        servers = [pid for pid in processes_mentioning(str(run_dir / "mem")) if pid != owner.pid]
        assert len(servers) == (1 if window == "weights-fill" else 2), servers
        owner.kill()
        owner.wait()
        assert wait_until_gone(str(run_dir), 60.0) == []  # servers, and the guardian once it reaped
    finally:
        owner.kill()
        owner.wait()
    assert not any((run_dir / "mem").glob("*.sock"))
